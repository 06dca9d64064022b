#!/usr/bin/env python3
"""Convert a model trained with softmax attention to linear-cost attention with a learned feature map.

    PYTHONPATH=build/python:examples/python /usr/bin/python3 examples/python/convert_model.py \\
        /work/models/tiny_lm.bin --method hedgehog --data corpus.txt --steps 300 \\
        --finetune-steps 200 --out /work/models/tiny_hedgehog.bin

Two stages:
  1. attention transfer: every layer's feature maps (hedgehog's W, b per key/value head; favor's or
     favor-hyp's projections per layer) learn to reproduce the model's own softmax attention, on
     its activations with exact attention (each layer sees the exact model's queries, keys and
     values, so layers and heads train independently). --transfer ce (default, as Hedgehog) is the
     cross-entropy between the softmax attention rows and the linear-attention rows (printed less
     the softmax rows' entropy: the mean KL divergence of the rows, nats); --transfer mse the mean
     squared error of the layer's attention outputs (as LoLCATs). --steps counts its steps
     (each over --batch windows and every layer).
  2. optional fine-tuning (--finetune-steps N, default 0), every attention layer run forward and
     backward by randattn's method: all weights and the feature maps, or with --lora-rank R > 0
     low-rank adapters of every weight matrix (merged into the saved weights) and the feature maps.
     The loss (--finetune-loss) is the language-model loss on --data (lm, the default), or the KL
     divergence of the converted model's next-token distributions from the original model's with
     exact attention on the same windows (kl: distillation, which aims at what model_eval.py
     measures).
The result is written as --out (llama2.c format) and its feature maps as --out with
".feature_maps.npz" appended; model_eval.py --feature-maps reads them.

--data: a text file read as bytes (byte b is token b + --token-offset, as model_eval.py reads text) or
encoded by --tokenizer FILE (the model's BPE of bpe.py), or a .npy of token ids of shape (sequences,
length), so a model with any tokenizer is converted on token sequences it produced.
"""

import argparse
import math
import pathlib
import sys
import time

import numpy as np
import torch

import attention_layers
import llama2c


class Recorder:
    """Exact attention that keeps each layer's queries, keys, values and output."""

    def __init__(self):
        self.layers = []

    def __call__(self, q, k, v):
        out = llama2c.exact_attention(q, k, v)
        self.layers.append((q, k, v, out))
        return out


def causal_softmax(q, k, scale):
    n = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * scale
    return torch.softmax(scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")), dim=-1)


def transfer_loss(method, layer_attention, q, k, v, out, kind):
    """The attention-transfer loss of one layer on its exact activations (see the module docstring)."""
    heads = q.shape[1]
    params = layer_attention.parameters_of_map()
    if "weight" in params:  # per key/value head: repeat for the query heads of each group
        group = heads // params["weight"].shape[0]
        params = {name: p.repeat_interleave(group, dim=0) for name, p in params.items()}
    k, v = llama2c.repeat_kv(k, heads), llama2c.repeat_kv(v, heads)
    scale = q.shape[-1] ** -0.5
    fq = attention_layers.torch_features(method, q, params, scale, "query")
    fk = attention_layers.torch_features(method, k, params, scale, "key")
    kernel = (fq @ fk.transpose(-2, -1)).tril()
    rows = kernel / kernel.sum(-1, keepdim=True)
    if kind == "mse":
        return (rows @ v - out).pow(2).mean()
    teacher = causal_softmax(q, k, scale)  # the cross-entropy less the teacher's entropy: the rows' KL
    return (torch.xlogy(teacher, teacher) - teacher * torch.log(rows.clamp_min(1e-30))).sum(-1).mean()


def add_lora(model, rank, seed):
    """Freezes every weight matrix of the model and adds a trainable low-rank update B A to each
    (B zero, A small): returns the adapters' parameters. remove_lora() merges them."""
    from torch.nn.utils import parametrize

    class LowRank(torch.nn.Module):
        def __init__(self, shape, generator):
            super().__init__()
            layers, rows, cols = shape
            self.a = torch.nn.Parameter(torch.randn(layers, rank, cols, generator=generator) / cols ** 0.5)
            self.b = torch.nn.Parameter(torch.zeros(layers, rows, rank))

        def forward(self, w):
            return w + self.b @ self.a

    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.requires_grad_(False)
    adapters = []
    for name in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
        module = LowRank(getattr(model, name).shape, g)
        parametrize.register_parametrization(model, name, module)
        adapters += [module.a, module.b]
    return adapters


def remove_lora(model):
    from torch.nn.utils import parametrize
    for name in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
        parametrize.remove_parametrizations(model, name, leave_parametrized=True)


def cosine_lr(peak, step, steps, warmup=10):
    return peak * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="llama2.c-format model trained with softmax attention")
    ap.add_argument("--method", required=True, choices=sorted(attention_layers.LEARNED))
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="an option of --method (e.g. features=64)")
    ap.add_argument("--data", required=True, help="text file (bytes) or .npy of token ids (sequences, length)")
    ap.add_argument("--token-offset", type=int, default=0, help="token id of byte 0 for text --data")
    ap.add_argument("--tokenizer", default=None, help="the model's BPE tokenizer file (bpe.py) for text --data")
    ap.add_argument("--out", required=True, help="converted checkpoint (llama2.c format)")
    ap.add_argument("--force", action="store_true", help="overwrite --out and its feature maps")
    ap.add_argument("--transfer", choices=("ce", "mse"), default="ce", help="attention-transfer loss")
    ap.add_argument("--steps", type=int, default=300, help="attention-transfer steps")
    ap.add_argument("--lr", type=float, default=1e-2, help="peak learning rate of the transfer")
    ap.add_argument("--finetune-steps", type=int, default=0)
    ap.add_argument("--finetune-lr", type=float, default=1e-3)
    ap.add_argument("--finetune-loss", choices=("lm", "kl"), default="lm")
    ap.add_argument("--lora-rank", type=int, default=0, help="0: fine-tune all weights")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per window (default: the model's seq_len)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("steps", "finetune_steps", "lora_rank"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.batch < 1:
        ap.error(f"--batch must be positive, got {args.batch}")
    options = dict(llama2c.parse_option(text, ap.error) for text in args.option)
    out = pathlib.Path(args.out)
    maps_path = attention_layers.feature_map_path(out)
    attention_layers.refuse_existing(out, args.force, ap.error)
    torch.set_num_threads(args.threads)
    try:
        model = llama2c.read_checkpoint(args.checkpoint)
        config = model.config
        length = args.seq_len or config.seq_len
        if not 1 <= length <= config.seq_len:
            raise ValueError(f"--seq-len must be in 1..{config.seq_len} (the model's seq_len), got {length}")
        tokens = llama2c.read_tokens(args.data, config.vocab_size, args.token_offset, args.tokenizer)
        llama2c.check_windows(tokens, length, args.data)
        attention = attention_layers.ModelAttention(args.method, config, options, seed=args.seed)
        with torch.no_grad():
            model(tokens.reshape(-1)[None, :min(8, length)], attention)  # bad options fail here
    except (OSError, ValueError, TypeError) as e:
        print(f"convert_model.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    rng = np.random.default_rng(args.seed)
    held = llama2c.sample_windows(tokens, length, args.batch, np.random.default_rng(args.seed + 1))
    start = time.perf_counter()

    def activations(windows):
        recorder = Recorder()
        with torch.no_grad():
            model(windows[:, :-1], recorder)
        return recorder.layers

    def layer_losses(layers):
        return [transfer_loss(args.method, attention[i], *layer, args.transfer) for i, layer in enumerate(layers)]

    held_layers = activations(held)
    with torch.no_grad():
        before = [float(x) for x in layer_losses(held_layers)]
    print(f"transfer ({args.transfer}) loss per layer on a held batch before: "
          f"{' '.join(f'{x:.4f}' for x in before)}", flush=True)
    opt = torch.optim.Adam(attention.parameters(), lr=args.lr)
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(args.lr, step, args.steps)
        losses = layer_losses(activations(llama2c.sample_windows(tokens, length, args.batch, rng)))
        opt.zero_grad(set_to_none=True)
        sum(losses).backward()
        opt.step()
        if (step + 1) % 25 == 0 or step == 0:
            print(f"transfer step {step + 1:4d}  loss per layer {' '.join(f'{float(x):.4f}' for x in losses)}  "
                  f"{time.perf_counter() - start:6.1f} s", flush=True)
    with torch.no_grad():
        after = [float(x) for x in layer_losses(held_layers)]
    print(f"transfer ({args.transfer}) loss per layer on the held batch after {args.steps} steps: "
          f"{' '.join(f'{x:.4f}' for x in after)}", flush=True)

    if args.finetune_steps:
        teacher = llama2c.read_checkpoint(args.checkpoint) if args.finetune_loss == "kl" else None
        model.train()
        weights = add_lora(model, args.lora_rank, args.seed) if args.lora_rank else list(model.parameters())
        opt = torch.optim.AdamW([{"params": [p for p in weights if p.dim() >= 2], "weight_decay": 0.1},
                                 {"params": [p for p in weights if p.dim() < 2] + list(attention.parameters()),
                                  "weight_decay": 0.0}], lr=args.finetune_lr, betas=(0.9, 0.95))
        trained = weights + list(attention.parameters())
        smoothed = None
        for step in range(args.finetune_steps):
            for group in opt.param_groups:
                group["lr"] = cosine_lr(args.finetune_lr, step, args.finetune_steps)
            batch = llama2c.sample_windows(tokens, length, args.batch, rng)
            logits = model(batch[:, :-1], attention)
            if teacher is None:
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            else:
                with torch.no_grad():
                    target = torch.log_softmax(teacher(batch[:, :-1]), -1)
                loss = torch.nn.functional.kl_div(torch.log_softmax(logits, -1).flatten(0, 1), target.flatten(0, 1),
                                                  log_target=True, reduction="batchmean")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            opt.step()
            smoothed = loss.item() if smoothed is None else 0.9 * smoothed + 0.1 * loss.item()
            if (step + 1) % 10 == 0 or step == 0:
                print(f"finetune step {step + 1:4d}  loss {loss.item():.3f} (smoothed {smoothed:.3f})  "
                      f"{time.perf_counter() - start:6.1f} s", flush=True)
        if args.lora_rank:
            remove_lora(model)
        model.eval()
    llama2c.write_checkpoint(model, out)
    attention.save(maps_path)
    print(f"converted in {time.perf_counter() - start:.0f} s; wrote {out} and {maps_path}")


if __name__ == "__main__":
    main()
