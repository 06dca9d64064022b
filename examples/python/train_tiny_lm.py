#!/usr/bin/env python3
"""Train a small byte-level language model of the llama2.c architecture and save it in llama2.c format.

The corpus is text that Debian ships with its Python: the standard library's sources
(/usr/lib/python3.11/**/*.py without the test suites), one file held out for evaluation
(argparse.py by default). Tokens are bytes (vocabulary 256). The defaults (4 layers, dim 64, 2 query
heads of size 32 over 1 key/value head, context 1024, SwiGLU hidden 192, batches of 2 sequences) are
sized for 2 shared CPU cores with Debian's python3-torch; training stops at the step count or the time
budget (--minutes), whichever comes first, and the learning-rate schedule (linear warm-up, cosine
decay) follows the same progress. Not run in CI.

    nice -n 5 /usr/bin/python3 examples/python/train_tiny_lm.py --out /work/models/tiny_lm.bin --minutes 20
"""

import argparse
import math
import pathlib
import time

import numpy as np
import torch

import llama2c


def corpus(root, holdout):
    """The bytes of every .py file under root (sorted paths; no test directories, not the held-out
    names), joined by newlines."""
    files = [p for p in sorted(pathlib.Path(root).rglob("*.py"))
             if not any(part in ("test", "tests", "idle_test") for part in p.parts) and p.name not in holdout]
    return b"\n".join(p.read_bytes() for p in files), len(files)


def init_weights(model, seed):
    """Normal(0, 0.02) matrices and embeddings, residual projections (wo, w2) scaled by
    1/sqrt(2·layers) as in GPT-2; RMSNorm gains 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm"):
                p.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * model.config.n_layers) if name in ("wo", "w2") else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="checkpoint path (llama2.c format)")
    ap.add_argument("--corpus", default="/usr/lib/python3.11")
    ap.add_argument("--holdout", nargs="*", default=["argparse.py"], help="file names left out of training")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--minutes", type=float, default=20.0, help="time budget of the training loop")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", default=None,
                    help="continue from this llama2.c checkpoint (its architecture; new optimizer state)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    data, n_files = corpus(args.corpus, set(args.holdout))
    tokens = llama2c.byte_tokens(data)
    if args.init:
        model = llama2c.read_checkpoint(args.init).train()
        config = model.config
        if config.vocab_size != 256 or config.seq_len < args.seq_len:
            raise SystemExit(f"{args.init}: needs a byte vocabulary (256) and seq_len >= {args.seq_len}")
    else:
        config = llama2c.Config(args.dim, args.hidden, args.layers, args.heads, args.kv_heads, 256, args.seq_len)
        model = llama2c.Transformer(config)
        init_weights(model, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"corpus: {n_files} files, {len(tokens)} bytes; model: {config}, {n_params} parameters", flush=True)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    rng = np.random.default_rng(args.seed)
    budget = 60.0 * args.minutes
    start = time.perf_counter()
    step, smoothed = 0, None
    while step < args.steps:
        progress = max(step / args.steps, (time.perf_counter() - start) / budget)
        if progress >= 1.0:
            break
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = rng.integers(0, len(tokens) - args.seq_len - 1, size=args.batch)
        batch = torch.stack([tokens[s:s + args.seq_len + 1] for s in starts])
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        smoothed = loss.item() if smoothed is None else 0.9 * smoothed + 0.1 * loss.item()
        if step % 10 == 0 or step == 1:
            print(f"step {step:5d}  loss {loss.item():.3f} (smoothed {smoothed:.3f}) nats/byte  lr {lr:.2e}  "
                  f"{time.perf_counter() - start:7.1f} s", flush=True)
    llama2c.write_checkpoint(model, args.out)
    print(f"trained {step} steps ({step * args.batch * args.seq_len} tokens) in {time.perf_counter() - start:.0f} s; "
          f"final smoothed loss {smoothed:.3f} nats/byte; wrote {args.out}")


if __name__ == "__main__":
    main()
