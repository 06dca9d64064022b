#!/usr/bin/env python3
"""Token-by-token generation from a llama2.c-format checkpoint with one randattn.KVCache per layer.

    PYTHONPATH=build/python:examples/python /usr/bin/python3 examples/python/generate.py model.bin prompt.txt \\
        --prompt-len 512 --steps 128 --mode exact --mode blocks --option page_size=16 --option top_pages=8 \\
        --mode lsh-sample --option bits=8 --option tables=16

The prompt is the first --prompt-len tokens of the text file from byte --start (tokens = bytes +
--token-offset, or the BPE of --tokenizer FILE, as in model_eval.py). Exact decoding (mode "exact") runs first and continues the prompt greedily for
--steps tokens; every mode then decodes the same tokens (the prompt and exact's continuation) one at a
time: per position and layer, the new key and value are appended to the layer's cache and the query
attends to the cache. Printed per mode: tokens per second of the whole decode loop, microseconds per
token spent in the caches (append and attend, all layers), the top-1 agreement of its next-token
distributions with exact decoding's over the generated positions (and over all positions), the mean
KL divergence from exact's distributions, the share of cached keys scored per step, the KL of the
oracle at the same keys per step ("oracle KL": at every position and layer, each query head attends
exactly to its own highest-logit keys, as many in all as the mode scored there), the ratio of the two
("KL/oracle"), the same four figures over the generated positions alone (the steps that decode after
the prompt, where the cache is longest; the early positions of the prompt have too few keys for any
mode to leave many out), and the means of the numeric fields of the caches' reports.
Options after a --mode are KVCache's keywords (sinks, window, scale, page_size, top_pages, bits,
tables, filters, eta, seed).
"""

import argparse
import sys
import time

import numpy as np
import torch

import llama2c


def decode(model, prompt, make_cache, steps=0):
    """Runs the prompt (1-D tokens) through the model one position at a time with a cache per layer,
    then appends `steps` greedily chosen tokens. Returns (tokens, logits (len(tokens), vocab), seconds
    of the loop, seconds in the caches, the caches' reports)."""
    c = model.config
    caches = [make_cache() for _ in range(c.n_layers)]
    weights = model.layer_weights()
    tokens = prompt.tolist()
    logits, reports = [], []
    cache_seconds = 0.0
    start = time.perf_counter()
    pos = 0
    while pos < len(tokens):
        x = model.tok_embeddings[tokens[pos]].view(1, 1, -1)
        rotation = llama2c.rope_rotation([pos], c.head_size, x.dtype)
        for w, cache in zip(weights, caches):
            q, k, v = model.qkv(w, x, rotation)
            k_np, v_np = k[0].contiguous().numpy(), v[0].contiguous().numpy()  # (kv_heads, 1, hs)
            q_np = q[0, :, 0].contiguous().numpy()  # (n_heads, hs)
            t0 = time.perf_counter()
            cache.append(k_np, v_np)
            out, report = cache.attend(q_np, report=True)
            cache_seconds += time.perf_counter() - t0
            reports.append(report)
            attended = torch.from_numpy(np.asarray(out, dtype=np.float32)).view(1, c.n_heads, 1, c.head_size)
            x = model.finish_layer(w, x, attended)
        logits.append(model.logits(x)[0, 0])
        if pos + 1 == len(tokens) < len(prompt) + steps:
            tokens.append(int(logits[-1].argmax()))
        pos += 1
    seconds = time.perf_counter() - start
    assert all(len(cache) == len(tokens) for cache in caches)
    return torch.tensor(tokens), torch.stack(logits), seconds, cache_seconds, reports


class OracleCache:
    """A stand-in for randattn.KVCache that attends exactly to each query head's highest-logit keys:
    as many keys per call, summed over query heads, as budgets (an iterator) gives, split evenly."""

    def __init__(self, config, budgets):
        # Room for the model's context: decoding never passes it.
        self.keys = np.empty((config.n_kv_heads, config.seq_len, config.head_size), dtype=np.float32)
        self.values = np.empty_like(self.keys)
        self.size, self.budgets = 0, budgets
        self.group = config.n_heads // config.n_kv_heads
        self.scale = config.head_size ** -0.5

    def __len__(self):
        return self.size

    def append(self, k, v):  # (kv_heads, 1, hs) each
        self.keys[:, self.size] = k[:, 0]
        self.values[:, self.size] = v[:, 0]
        self.size += 1

    def attend(self, q, report=False):  # q (n_heads, hs)
        keys, values = self.keys[:, :self.size], self.values[:, :self.size]  # (kv_heads, t, hs)
        heads, t = q.shape[0], self.size
        total = next(self.budgets)
        out = np.empty_like(q)
        for h in range(heads):
            k_top = min(t, max(1, total // heads + (h < total % heads)))
            scores = keys[h // self.group] @ q[h] * self.scale
            top = np.argpartition(-scores, k_top - 1)[:k_top]
            w = np.exp(scores[top] - scores[top].max())
            out[h] = w @ values[h // self.group][top] / w.sum()
        return (out, {"keys_scored": total}) if report else out


def kl_text(kl):
    """A KL for the table: four decimals, or two significant digits below 0.001 (compressed caches
    stay far below that)."""
    return f"{kl:.4f}" if kl >= 1e-3 or kl == 0 else f"{kl:.1e}"


def report_means(reports):
    """Mean of every numeric (non-bool) field over the reports, in first-seen order."""
    sums, counts = {}, {}
    for r in reports:
        for key, value in r.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                sums[key] = sums.get(key, 0.0) + float(value)
                counts[key] = counts.get(key, 0) + 1
    return {key: sums[key] / counts[key] for key in sums}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="llama2.c-format model file")
    ap.add_argument("text", help="file holding the prompt (read as bytes)")
    ap.add_argument("--prompt-len", type=int, default=256, help="prompt tokens")
    ap.add_argument("--steps", type=int, default=64, help="tokens generated after the prompt")
    ap.add_argument("--start", type=int, default=0, help="byte of the text where the prompt starts")
    ap.add_argument("--token-offset", type=int, default=0, help="token id of byte 0")
    ap.add_argument("--tokenizer", default=None, help="the model's BPE tokenizer file (bpe.py)")
    llama2c.add_method_arguments(ap, "--mode")
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    args = ap.parse_args(argv)
    try:
        import randattn
        if not hasattr(randattn, "KVCache"):
            raise ValueError("this randattn has no KVCache")
        if args.threads is not None:
            if args.threads < 1:
                raise ValueError(f"--threads must be positive, got {args.threads}")
            torch.set_num_threads(args.threads)
        if args.prompt_len < 1 or args.steps < 0:
            raise ValueError(f"--prompt-len must be positive and --steps non-negative, got {args.prompt_len}, "
                             f"{args.steps}")
        model = llama2c.read_checkpoint(args.checkpoint)
        c = model.config
        if args.prompt_len + args.steps > c.seq_len:
            raise ValueError(f"--prompt-len + --steps = {args.prompt_len + args.steps} exceeds the model's "
                             f"seq_len {c.seq_len}")
        encode, decode_text = llama2c.text_codec(c.vocab_size, args.token_offset, args.tokenizer)
        prompt = encode(open(args.text, "rb").read()[args.start:])[:args.prompt_len]
        if len(prompt) < args.prompt_len:
            raise ValueError(f"{args.text}: only {len(prompt)} tokens from byte {args.start}, "
                             f"--prompt-len is {args.prompt_len}")
        modes = args.methods or [("exact", {}), ("blocks", {}), ("lsh-sample", {}), ("lsf", {})]

        def factory(mode, options):
            def make():
                return randattn.KVCache(head_dim=c.head_size, value_dim=c.head_size, kv_heads=c.n_kv_heads,
                                        mode=mode, **options)
            make()  # bad modes and options fail here, before any output
            return make
        factories = [(mode, options, factory(mode, options)) for mode, options in modes]
    except (OSError, ValueError, TypeError) as e:
        ap.error(str(e))

    with torch.inference_mode():
        # Exact decoding: the greedy continuation and the reference distributions.
        tokens, reference, _, _, _ = decode(model, prompt, factory("exact", {}), args.steps)
        text = decode_text(tokens[len(prompt):].tolist())
        print(f"# {args.checkpoint}: {c.n_layers} layers, {c.n_heads} query heads of {c.head_size} over "
              f"{c.n_kv_heads} key/value heads; prompt {len(prompt)} tokens, {args.steps} generated, "
              f"torch threads {torch.get_num_threads()}")
        print(f"# exact greedy continuation: {text!r}")
        print("| mode | tokens/s | cache µs/token | top-1 (generated) | top-1 (all) | KL (nats) | keys scored "
              "| oracle KL | KL/oracle | KL (generated) | keys scored (generated) | oracle KL (generated) "
              "| KL/oracle (generated) | report means |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        ref_log = torch.log_softmax(reference.double(), -1)
        generated = slice(len(prompt) - 1, len(tokens) - 1)  # positions whose next token was generated

        def kl_top1(logits):
            """KL from exact decoding and top-1 agreement, per position."""
            log_p = torch.log_softmax(logits.double(), -1)
            return (ref_log.exp() * (ref_log - log_p)).sum(-1), (log_p.argmax(-1) == ref_log.argmax(-1)).double()

        def mean(x):
            return float(x.mean()) if len(x) else float("nan")

        def ratio_text(kl, oracle_kl):
            return f"{kl / oracle_kl:.2f}" if oracle_kl > 0 else "-"

        for mode, options, make in factories:
            _, logits, seconds, cache_seconds, reports = decode(model, tokens, make)
            kl, agree = kl_top1(logits)
            top1_gen = f"{mean(agree[generated]):.4f}" if args.steps > 0 else "-"
            # Reports come position by position, layer by layer: the order the oracle's attends run in.
            shares = torch.tensor([r["keys_scored"] / (c.n_heads * r["size"]) for r in reports],
                                  dtype=torch.float64).view(len(tokens), c.n_layers)
            if mode == "exact":
                oracle = ratio = oracle_gen = ratio_gen = "-"
            else:
                budgets = iter([r["keys_scored"] for r in reports])
                oracle_kl = kl_top1(decode(model, tokens, lambda: OracleCache(c, budgets))[1])[0]
                oracle, ratio = kl_text(mean(oracle_kl)), ratio_text(mean(kl), mean(oracle_kl))
                if args.steps > 0:
                    oracle_gen = kl_text(mean(oracle_kl[generated]))
                    ratio_gen = ratio_text(mean(kl[generated]), mean(oracle_kl[generated]))
                else:
                    oracle_gen = ratio_gen = "-"
            kl_gen, share_gen = ((kl_text(mean(kl[generated])), f"{mean(shares[generated]):.3f}")
                                 if args.steps > 0 else ("-", "-"))
            means = ", ".join(f"{k} {v:.4g}" for k, v in report_means(reports).items())
            print(f"| {llama2c.method_label(mode, options)} | {len(tokens) / seconds:.1f} | "
                  f"{1e6 * cache_seconds / len(tokens):.1f} | {top1_gen} | {mean(agree):.4f} | {kl_text(mean(kl))} | "
                  f"{mean(shares):.3f} | {oracle} | {ratio} | {kl_gen} | {share_gen} | {oracle_gen} | {ratio_gen} | "
                  f"{means} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
