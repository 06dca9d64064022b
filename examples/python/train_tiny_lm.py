#!/usr/bin/env python3
"""Train a small byte-level language model of the llama2.c architecture and save it in llama2.c format.

The corpus is text that Debian ships with its Python: the standard library's sources
(/usr/lib/python3.11/**/*.py without the test suites), one file held out for evaluation
(argparse.py by default). Tokens are bytes (vocabulary 256), or with --vocab bpe:N the tokens of a
byte-level BPE of N tokens (bpe.py) trained on the same corpus and saved beside the checkpoint, in the
--out path with ".tokenizer.json" appended (model_eval.py and generate.py read it with --tokenizer).
The defaults (4 layers, dim 64, 2 query
heads of size 32 over 1 key/value head, context 1024, SwiGLU hidden 192, batches of 2 sequences) are
sized for 2 shared CPU cores with Debian's python3-torch; training stops at the step count or the time
budget (--minutes), whichever comes first, and the learning-rate schedule (linear warm-up, cosine
decay) follows the same progress. Not run in CI.

    nice -n 5 /usr/bin/python3 examples/python/train_tiny_lm.py --out /work/models/tiny_lm.bin --minutes 20

Attention: torch's exact softmax by default; --attention METHOD (--option key=value, repeatable) runs
every attention layer's forward and backward through randattn's METHOD instead (attention_layers.py).
A learned feature map (hedgehog; favor and favor-hyp unless --fixed-features) is trained with the
model and saved beside the checkpoint, in the --out path with ".feature_maps.npz" appended.
--init CHECKPOINT fine-tunes a trained model (with the feature maps of CHECKPOINT.feature_maps.npz when
that file exists and is of the same method). --valid-every N prints the validation loss (nats/byte)
on the held-out file every N steps and at the end (nats/byte, or nats/token with a BPE); --write-corpus FILE writes the training corpus
(for convert_model.py --data) and exits.
"""

import argparse
import math
import pathlib
import sys
import time

import numpy as np
import torch

import attention_layers
import bpe
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


def validation_loss(model, attention, tokens, length, seqs):
    """Mean next-token loss (nats/token) over `seqs` consecutive windows of length + 1 tokens."""
    seqs = min(seqs, (tokens.numel() - 1) // length)
    windows = torch.stack([tokens[i * length:(i + 1) * length + 1] for i in range(seqs)])
    with torch.no_grad():
        logits = model(windows[:, :-1], attention)
        return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()))


def add_model_arguments(ap):
    """The model's shape options (defaults: the model of docs/model_eval.md's A)."""
    for flag, default in (("--dim", 64), ("--hidden", 192), ("--layers", 4), ("--heads", 2), ("--kv-heads", 1)):
        ap.add_argument(flag, type=int, default=default)


def model_config(args, vocab_size, seq_len):
    return llama2c.Config(args.dim, args.hidden, args.layers, args.heads, args.kv_heads, vocab_size, seq_len)


def optimizer(model, learned, lr):
    """AdamW (β 0.9, 0.95), weight decay 0.1 on the matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2] + list(learned)
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def train_step(model, attention, batch, opt, params):
    """One optimiser step on the windows `batch` (b, n + 1), gradients clipped to norm 1 over
    `params`; returns the loss (nats per token)."""
    logits = model(batch[:, :-1], attention)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return loss


def parse_vocab(text, error):
    """N of "bpe:N" (N >= 256), None for "bytes"; error(message) on anything else."""
    if text == "bytes":
        return None
    kind, _, size = text.partition(":")
    if kind != "bpe" or not size.isdigit() or int(size) < 256:
        error(f"--vocab {text}: expected bytes or bpe:N with N >= 256")
    return int(size)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="checkpoint path (llama2.c format)")
    ap.add_argument("--force", action="store_true", help="overwrite --out (and its feature maps) if it exists")
    ap.add_argument("--corpus", default="/usr/lib/python3.11")
    ap.add_argument("--holdout", nargs="*", default=["argparse.py"], help="file names left out of training")
    ap.add_argument("--valid", default=None, help="validation text (default: the first held-out file in --corpus)")
    ap.add_argument("--valid-seqs", type=int, default=4, help="validation windows of --seq-len tokens")
    ap.add_argument("--valid-every", type=int, default=0, help="steps between validation losses (0: at the end only)")
    ap.add_argument("--write-corpus", default=None, help="write the training corpus to this file and exit")
    ap.add_argument("--attention", default=None, help="a randattn method for every attention layer")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="an option of --attention")
    ap.add_argument("--fixed-features", action="store_true",
                    help="favor, favor-hyp: keep the seed's projections instead of learning them")
    ap.add_argument("--vocab", default="bytes", help="bytes (256 tokens) or bpe:N (a BPE of N >= 256 tokens)")
    add_model_arguments(ap)
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
    args = ap.parse_args(argv)
    options = dict(llama2c.parse_option(text, ap.error) for text in args.option)
    if options and not args.attention:
        ap.error("--option needs --attention")
    if args.write_corpus is None and args.out is None:
        ap.error("--out is required (or --write-corpus)")
    torch.set_num_threads(args.threads)
    data, n_files = corpus(args.corpus, set(args.holdout))
    if args.write_corpus:
        pathlib.Path(args.write_corpus).write_bytes(data)
        print(f"wrote {len(data)} bytes of {n_files} files to {args.write_corpus}")
        return
    out = pathlib.Path(args.out)
    maps_path = attention_layers.feature_map_path(out)
    bpe_size = parse_vocab(args.vocab, ap.error)
    tokenizer_path = bpe.tokenizer_path(out)
    attention_layers.refuse_existing(out, args.force, ap.error, also=[tokenizer_path] if bpe_size else [])
    try:
        tokenizer = None
        if args.init and bpe.tokenizer_path(args.init).exists():
            tokenizer = bpe.Tokenizer.load(bpe.tokenizer_path(args.init))
        elif args.init and bpe_size:
            raise ValueError(f"{args.init} has no tokenizer ({bpe.tokenizer_path(args.init)}); --vocab bpe "
                             "trains one for a new model only")
        elif bpe_size:
            began = time.perf_counter()
            tokenizer = bpe.Tokenizer.train(data, bpe_size)
            print(f"trained a BPE of {tokenizer.vocab_size} tokens in {time.perf_counter() - began:.1f} s", flush=True)
        vocab_size = tokenizer.vocab_size if tokenizer else 256
        encode, _ = llama2c.text_codec(vocab_size, tokenizer=tokenizer)
        tokens = encode(data)
        if args.init:
            model = llama2c.read_checkpoint(args.init).train()
            config = model.config
            if config.vocab_size != vocab_size or config.seq_len < args.seq_len:
                raise ValueError(f"{args.init}: needs a vocabulary of {vocab_size} (its tokenizer's, or bytes) and "
                                 f"seq_len >= {args.seq_len}, has {config.vocab_size} and {config.seq_len}")
        else:
            config = model_config(args, vocab_size, args.seq_len)
            model = llama2c.Transformer(config)
            init_weights(model, args.seed)
        llama2c.check_windows(tokens, args.seq_len, args.corpus)
        valid_path = args.valid
        if valid_path is None and args.holdout:
            valid_path = next(pathlib.Path(args.corpus).rglob(args.holdout[0]), None)
        valid = encode(pathlib.Path(valid_path).read_bytes()) if valid_path else None
        if valid is not None:
            llama2c.check_windows(valid, args.seq_len, valid_path)
        attention = llama2c.exact_attention
        if args.attention:
            attention = attention_layers.ModelAttention(args.attention, config, options,
                                                        learn=not args.fixed_features, seed=args.seed)
            init_maps = attention_layers.feature_map_path(args.init) if args.init else None
            if init_maps is not None and init_maps.exists():
                attention.load(init_maps)
            probe = torch.zeros(1, min(8, args.seq_len), dtype=torch.long)
            with torch.no_grad():
                model(probe, attention)  # bad options fail here, before training
    except (OSError, ValueError, TypeError) as e:
        print(f"train_tiny_lm.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    n_params = sum(p.numel() for p in model.parameters())
    learned = [p for p in attention.parameters()] if isinstance(attention, torch.nn.Module) else []
    unit = "nats/token" if tokenizer else "nats/byte"
    print(f"corpus: {n_files} files, {len(data)} bytes"
          f"{f' = {len(tokens)} tokens ({len(data) / len(tokens):.2f} bytes/token)' if tokenizer else ''}; model: {config}, {n_params} parameters; attention: "
          f"{llama2c.method_label(args.attention, options) if args.attention else 'torch exact'}"
          f"{f' ({sum(p.numel() for p in learned)} learned feature-map parameters)' if learned else ''}", flush=True)

    opt = optimizer(model, learned, args.lr)
    params = list(model.parameters()) + learned
    rng = np.random.default_rng(args.seed)
    budget = 60.0 * args.minutes
    start = time.perf_counter()
    step, smoothed, step_seconds, validated, paused = 0, None, [], {}, [0.0]

    def elapsed():
        """Seconds of training so far (validation excluded: the budget is training time)."""
        return time.perf_counter() - start - paused[0]

    def report_validation():
        if valid is not None and step not in validated:
            began = time.perf_counter()
            validated[step] = validation_loss(model, attention, valid, args.seq_len, args.valid_seqs)
            paused[0] += time.perf_counter() - began
            print(f"valid step {step} time {elapsed():.1f} s loss {validated[step]:.4f} {unit}", flush=True)
        return validated.get(step)

    while step < args.steps:
        progress = max(step / args.steps, elapsed() / budget)
        if progress >= 1.0:
            break
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = lr
        batch = llama2c.sample_windows(tokens, args.seq_len, args.batch, rng)
        began = time.perf_counter()
        loss = train_step(model, attention, batch, opt, params)
        step_seconds.append(time.perf_counter() - began)
        step += 1
        smoothed = loss.item() if smoothed is None else 0.9 * smoothed + 0.1 * loss.item()
        if step % 10 == 0 or step == 1:
            print(f"step {step:5d}  loss {loss.item():.3f} (smoothed {smoothed:.3f}) {unit}  lr {lr:.2e}  "
                  f"{elapsed():7.1f} s", flush=True)
        if args.valid_every and step % args.valid_every == 0:
            report_validation()
    final = report_validation()
    llama2c.write_checkpoint(model, out)
    if learned:
        attention.save(maps_path)
    if tokenizer:
        tokenizer.save(tokenizer_path)
    median = float(np.median(step_seconds)) if step_seconds else float("nan")
    print(f"trained {step} steps ({step * args.batch * args.seq_len} tokens) in {elapsed():.0f} s "
          f"(median {median:.3f} s/step); final smoothed loss {smoothed:.3f} {unit}"
          f"{f'; validation {final:.4f} {unit}' if final is not None else ''}; wrote {out}"
          f"{f' and {maps_path}' if learned else ''}{f' and {tokenizer_path}' if tokenizer else ''}")


if __name__ == "__main__":
    main()
