#!/usr/bin/env python3
"""Seconds per training step of the model of examples/python/train_tiny_lm.py (its train_step:
forward, backward and optimiser step, on random tokens) with every attention layer through randattn,
one model per method, all of the same initial weights. The machine may be shared and noisy, so the methods take
their steps in turn (one step each per round, after two warm-up rounds) and each row is the median
over the rounds; the ratio column is the first method's median over the row's. A last row replaces
attention with its queries (no attention at all): what the rest of the model costs.

Usage (from a build with the module, e.g. scripts/test.sh's):
    PYTHONPATH=build/python /usr/bin/python3 bench/train_step_bench.py \\
        --context 4096 --attention exact --attention hedgehog --option features=32

The model's own products run in torch's BLAS. Debian's python3-torch uses the system BLAS; see
docs/training.md for the OpenBLAS settings the figures there were taken with.
"""

import argparse
import pathlib
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "python"))
import attention_layers  # noqa: E402
import llama2c  # noqa: E402
import train_tiny_lm  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    llama2c.add_method_arguments(ap, "--attention")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    train_tiny_lm.add_model_arguments(ap)
    args = ap.parse_args()
    if not args.methods:
        ap.error("give at least one --attention METHOD")
    if args.rounds < 1 or args.context < 1 or args.batch < 1:
        ap.error("--rounds, --context and --batch must be positive")
    torch.set_num_threads(args.threads)
    config = train_tiny_lm.model_config(args, 256, args.context)
    tokens = torch.randint(0, 256, (args.batch, args.context + 1), generator=torch.Generator().manual_seed(0))

    runs = []
    for method, options in args.methods + [(None, {})]:
        model = llama2c.Transformer(config)
        train_tiny_lm.init_weights(model, 0)
        if method is None:
            label, attention, learned = "(no attention)", (lambda q, k, v: q * 1.0), []
        else:
            label = llama2c.method_label(method, options)
            try:
                attention = attention_layers.ModelAttention(method, config, options, learn=True, seed=0)
            except (ValueError, TypeError) as e:
                sys.exit(f"train_step_bench.py: error: {label}: {e}")
            learned = list(attention.parameters())
        params = list(model.parameters()) + learned
        runs.append((label, model, attention, params, train_tiny_lm.optimizer(model, learned, 1e-3), []))

    for r in range(args.rounds + 2):
        for label, model, attention, params, opt, times in runs:
            start = time.perf_counter()
            train_tiny_lm.train_step(model, attention, tokens, opt, params)
            if r >= 2:
                times.append(time.perf_counter() - start)
    first = float(np.median(runs[0][5]))
    print(f"context {args.context}, batch {args.batch}, {args.threads} threads, {args.rounds} rounds")
    print(f"{'method':32s} {'median s/step':>14s} {'min':>8s} {'max':>8s} {'first / this':>13s}")
    for label, *_, times in runs:
        median = float(np.median(times))
        print(f"{label:32s} {median:14.3f} {min(times):8.3f} {max(times):8.3f} {first / median:13.2f}")


if __name__ == "__main__":
    main()
