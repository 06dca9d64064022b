#!/usr/bin/env python3
"""Approximate attention inside a real model: a llama2.c-format checkpoint runs on evaluation
sequences with every attention layer replaced by a randattn method or a baseline, against the same
model with exact attention.

    PYTHONPATH=build/python:examples/python /usr/bin/python3 examples/python/model_eval.py \\
        model.bin text.txt --seqs 8 --method favor --option features=256 --method lsh --option rounds=8 \\
        --method oracle-topk --option k=16

Sequences: --seqs consecutive, non-overlapping windows of --len + 1 tokens of the text file from byte
--start; each window's first --len tokens are the input, and its last --len tokens the targets.
Tokenizer: the file's raw bytes, byte b being token b + --token-offset. 0 fits byte-level models (a
vocabulary of 256, as train_tiny_lm.py makes); llama2.c's sentencepiece models hold the 256 bytes as
byte-fallback tokens 3..258 (--token-offset 3), which any text maps to, though such a model saw them
rarely in training and its NLL is then high; the comparison with the exact model stays meaningful.
--tokenizer FILE (a BPE of bpe.py, e.g. train_tiny_lm.py --vocab bpe:N's) encodes the text from --start
instead, and the windows are then of tokens.

Methods (--method, repeatable; the --option key=value that follow it are its options):
  any method of randattn.methods() (exact, favor, oprf, sderf, lsh, lsf, ...), always causal, its
      options as randattn.attention's keywords (values parsed as int, float, true/false, else text).
      oprf and sderf (also as sparse-lowrank's remainder) without a fit option are fitted, per layer
      and head, to the exact model's queries and keys on a calibration sequence: the window after the
      evaluated ones (the text must then hold --seqs + 1 windows), never an evaluated sequence;
  oracle-topk (option k=16): exact softmax over each query's k highest-logit past keys;
  window (options window=64, sinks=0): exact softmax over the last `window` keys (i - window < j <= i)
      and the first `sinks` keys;
  uniform: the average of the values of keys 0..i (attention at infinite temperature).
--feature-maps FILE gives the method it was learned for (hedgehog, favor, favor-hyp) its learned maps
per layer, and its recorded options. --reference CHECKPOINT takes the reference distributions (and the
calibration rows) from that checkpoint with exact attention, e.g. the model that convert_model.py
converted; by default the evaluated checkpoint with exact attention is the reference.
Printed per method (a Markdown table): mean over evaluated positions of the KL divergence of the
next-token distribution from the exact model's (nats), top-1 agreement with the exact model, NLL of
the targets (nats per token), the share of causal query-key pairs (j <= i) scored exactly (randattn's
report field pairs_scored, rescaled from all n^2 pairs to the n(n+1)/2 causal ones, plus the keys a
sampled remainder drew ("+ ... drawn", from the report's samples per query); '-' where no pair is
scored individually), the KL of the oracle at that share, support and drawn keys together ("oracle KL":
oracle-topk with the smallest k whose share of causal pairs is at least the method's, k in brackets),
the ratio of the two ("KL/oracle"; below 1 when a method beats the oracle at its budget, as a sampled
remainder can, since the oracle drops the tail), and the seconds spent in attention
over all layers. --stats adds the exact model's attention statistics per layer.
"""

import argparse
import sys
import time

import torch

import llama2c

CALIBRATED = ("oprf", "sderf")
BASELINES = {"oracle-topk": {"k": 16}, "window": {"window": 64, "sinks": 0}, "uniform": {}}
DEFAULT_METHODS = [("exact", {}), ("favor", {}), ("lsh", {}), ("lsf", {"eta": 0.5}),
                   ("oracle-topk", {}), ("window", {}), ("uniform", {})]


def causal_pairs(n):
    return n * (n + 1) / 2


def topk_share(k_top, n):
    """Share of the n(n+1)/2 causal pairs that oracle-topk with k_top scores: Σ_i min(k, i + 1)
    = k(k + 1)/2 + k(n − k) for k = min(k_top, n)."""
    k = min(k_top, n)
    return (k * (k + 1) / 2 + k * (n - k)) / causal_pairs(n)


def oracle_k(share, n):
    """The smallest k whose oracle-topk scores at least `share` of the causal pairs (n when none does)."""
    return next((k for k in range(1, n + 1) if topk_share(k, n) >= share - 1e-12), n)


def oracle_topk_attention(k_top):
    """Exact softmax over each query's k_top highest-logit keys among j <= i."""
    def attend(q, k, v):
        k, v = llama2c.repeat_kv(k, q.shape[1]), llama2c.repeat_kv(v, q.shape[1])
        n = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        top, index = scores.topk(min(k_top, n), dim=-1)  # rows with fewer than k_top keys keep -inf extras
        kept = torch.full_like(scores, float("-inf")).scatter_(-1, index, top)
        return torch.softmax(kept, dim=-1) @ v
    attend.pairs_scored = lambda n: topk_share(k_top, n)
    return attend


def window_attention(window, sinks):
    """Exact softmax over keys i - window < j <= i and j < sinks."""
    def allowed(n):
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        return (j <= i) & ((i - j < window) | (j < sinks))

    def attend(q, k, v):
        k, v = llama2c.repeat_kv(k, q.shape[1]), llama2c.repeat_kv(v, q.shape[1])
        scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        return torch.softmax(scores.masked_fill(~allowed(q.shape[-2]), float("-inf")), dim=-1) @ v
    attend.pairs_scored = lambda n: float(allowed(n).sum()) / causal_pairs(n)
    return attend


def uniform_attention(q, k, v):
    """Σ_{j<=i} v_j / (i + 1)."""
    v = llama2c.repeat_kv(v, q.shape[1])
    return v.cumsum(dim=-2) / torch.arange(1, v.shape[-2] + 1, dtype=v.dtype)[:, None]


class Timed:
    """Wraps an attention callable, adding up its seconds."""

    def __init__(self, attend):
        self.attend, self.seconds = attend, 0.0

    def __call__(self, q, k, v):
        start = time.perf_counter()
        out = self.attend(q, k, v)
        self.seconds += time.perf_counter() - start
        return out


class QKRecorder:
    """Exact attention keeping each call's (layer's) queries and keys of the first sequence."""

    def __init__(self):
        self.rows = []

    def __call__(self, q, k, v):
        self.rows.append((q[0].contiguous().numpy(),
                          llama2c.repeat_kv(k, q.shape[1])[0].contiguous().numpy()))
        return llama2c.exact_attention(q, k, v)


class ExactWithStats(Timed):
    """Exact attention recording, per call (= per layer), the mean of scale·‖q‖² and of scale·‖k‖²
    and the mean entropy (nats) of the attention rows."""

    def __init__(self):
        super().__init__(llama2c.exact_attention)
        self.stats = []

    def __call__(self, q, k, v):
        out = super().__call__(q, k, v)
        scale = q.shape[-1] ** -0.5
        kk = llama2c.repeat_kv(k, q.shape[1])
        n = q.shape[-2]
        scores = (q @ kk.transpose(-2, -1)) * scale
        p = torch.softmax(scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")), dim=-1)
        entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
        self.stats.append({"q_norm": float((scale * q.pow(2).sum(-1)).mean()),
                           "k_norm": float((scale * k.pow(2).sum(-1)).mean()),
                           "entropy": float(entropy.mean())})
        return out


def make_attention(name, options, config, threads, calibration, feature_maps=None):
    """(attention callable, pairs_scored(n) -> float or None) for a method or baseline; calibration()
    gives the per-layer (queries, keys) that fit oprf and sderf when their options leave fit out;
    feature_maps (method, options, one dict of arrays per layer) gives that method its learned maps."""
    if name in BASELINES:
        unknown = set(options) - set(BASELINES[name])
        if unknown:
            raise TypeError(f"{name}: unknown option(s) {', '.join(sorted(unknown))} "
                            f"(it takes: {', '.join(BASELINES[name]) or 'none'})")
        o = {**BASELINES[name], **options}
        if name == "uniform":
            return Timed(uniform_attention), None
        if name == "oracle-topk":
            if not isinstance(o["k"], int) or o["k"] < 1:
                raise ValueError(f"oracle-topk: k must be a positive integer, got {o['k']!r}")
            attend = oracle_topk_attention(o["k"])
        else:
            if not all(isinstance(o[key], int) and o[key] >= 0 for key in ("window", "sinks")) or o["window"] < 1:
                raise ValueError(f"window: window must be a positive and sinks a non-negative integer, got {o}")
            attend = window_attention(o["window"], o["sinks"])
        return Timed(attend), attend.pairs_scored
    import randattn
    if name not in randattn.methods():
        raise ValueError(f"unknown method {name!r} (randattn's: {', '.join(randattn.methods())}; "
                         f"baselines: {', '.join(BASELINES)})")
    layer_options = None
    calibrated = name in CALIBRATED or (name == "sparse-lowrank" and options.get("remainder") in CALIBRATED)
    if calibrated and "fit" not in options:
        layer_options = [{"fit": "given", "calibration_q": q, "calibration_k": k} for q, k in calibration()]
    if feature_maps and feature_maps[0] == name:
        options = {**feature_maps[1], **options}
        layer_options = feature_maps[2]
    attend = llama2c.RandattnAttention(name, layer_options, threads=threads, **options)
    # A dry run on a short random sequence: bad options fail here, before any output.
    g = torch.Generator().manual_seed(0)
    probe_q = torch.randn(1, config.n_heads, 8, config.head_size, generator=g)
    probe_kv = torch.randn(1, config.n_kv_heads, 8, config.head_size, generator=g)
    if layer_options and calibrated and "fit" not in options:
        attend.layer_options = [{"fit": "given", "calibration_q": probe_q[0].numpy(),
                                 "calibration_k": llama2c.repeat_kv(probe_kv, config.n_heads)[0].numpy()}]
    attend(probe_q, probe_kv, probe_kv)
    attend.layer_options, attend.calls, attend.seconds, attend.reports = layer_options, 0, 0.0, []

    def pairs_scored(n):
        if name == "exact":
            return 1.0
        shares = [r["pairs_scored"] for r in attend.reports if "pairs_scored" in r]
        if not shares:
            return None
        support = sum(shares) / len(shares) * n * n / causal_pairs(n)
        drawn = [r["samples"] for r in attend.reports if "samples" in r]  # keys drawn per query
        return (support, sum(drawn) / len(drawn) * n / causal_pairs(n)) if drawn else support
    return attend, pairs_scored


def compare(reference_logits, logits, targets):
    """(KL(p_ref || p), top-1 agreement, NLL of targets), means over all positions."""
    ref = torch.log_softmax(reference_logits.double(), dim=-1)
    log_p = torch.log_softmax(logits.double(), dim=-1)
    kl = (ref.exp() * (ref - log_p)).sum(-1).mean()
    top1 = (ref.argmax(-1) == log_p.argmax(-1)).double().mean()
    nll = -log_p.gather(-1, targets[..., None]).mean()
    return float(kl), float(top1), float(nll)


def load_sequences(path, n_seqs, length, start, encode):
    """(inputs, targets) of n_seqs consecutive windows of length + 1 tokens of the text from byte
    `start`, encoded by `encode` (llama2c.text_codec)."""
    tokens = encode(open(path, "rb").read()[start:])
    need = n_seqs * (length + 1)
    if tokens.numel() < need:
        raise ValueError(f"{path}: {tokens.numel()} tokens from byte {start}, {n_seqs} sequences of {length} + 1 "
                         f"tokens need {need}")
    tokens = tokens[:need].view(n_seqs, length + 1)
    return tokens[:, :-1], tokens[:, 1:]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="llama2.c-format model file")
    ap.add_argument("text", help="evaluation text file (read as bytes)")
    ap.add_argument("--seqs", type=int, default=8, help="number of sequences")
    ap.add_argument("--len", type=int, default=None, help="tokens per sequence (default: the model's seq_len)")
    ap.add_argument("--start", type=int, default=0, help="byte of the text where the first sequence starts")
    ap.add_argument("--token-offset", type=int, default=0, help="token id of byte 0 (see above)")
    ap.add_argument("--tokenizer", default=None, help="the model's BPE tokenizer file (see above)")
    llama2c.add_method_arguments(ap, "--method")
    ap.add_argument("--threads", type=int, default=None, help="threads of torch and randattn")
    ap.add_argument("--stats", action="store_true", help="print the exact model's attention statistics")
    ap.add_argument("--feature-maps", default=None,
                    help="learned feature maps (convert_model.py's or train_tiny_lm.py's .feature_maps.npz) for "
                         "the method they were learned for")
    ap.add_argument("--reference", default=None,
                    help="the checkpoint whose exact attention is the reference (default: the evaluated one)")
    args = ap.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads must be positive, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.seqs < 1:
        ap.error(f"--seqs must be positive, got {args.seqs}")

    try:
        model = llama2c.read_checkpoint(args.checkpoint)
        reference_model = model
        if args.reference:
            reference_model = llama2c.read_checkpoint(args.reference)
            if reference_model.config != model.config:
                raise ValueError(f"--reference {args.reference} is {reference_model.config}, the evaluated "
                                 f"model {model.config}")
        feature_maps = None
        if args.feature_maps:
            import attention_layers
            feature_maps = attention_layers.read_feature_maps(args.feature_maps, model.config)
        length = args.len if args.len is not None else model.config.seq_len
        if not 1 <= length <= model.config.seq_len:
            raise ValueError(f"--len must be in 1..{model.config.seq_len} (the model's seq_len), got {length}")
        encode, _ = llama2c.text_codec(model.config.vocab_size, args.token_offset, args.tokenizer)
        inputs, targets = load_sequences(args.text, args.seqs, length, args.start, encode)
        methods = args.methods or DEFAULT_METHODS

        def calibration():
            """Per layer, the exact model's queries and keys ((n_heads, len, hs) each; key/value heads
            repeated) on the calibration sequence, the window after the evaluated ones."""
            if not hasattr(calibration, "rows"):
                tokens, _ = load_sequences(args.text, args.seqs + 1, length, args.start, encode)
                recorder = QKRecorder()
                with torch.inference_mode():
                    reference_model(tokens[-1:], recorder)
                calibration.rows = recorder.rows
            return calibration.rows
        attentions = [(llama2c.method_label(name, options),
                       *make_attention(name, options, model.config, args.threads, calibration, feature_maps))
                      for name, options in methods]
    except (OSError, ValueError, TypeError) as e:
        ap.error(str(e))

    c = model.config
    print(f"# {args.checkpoint}: {c.n_layers} layers, {c.n_heads} query heads of {c.head_size} over "
          f"{c.n_kv_heads} key/value heads, vocabulary {c.vocab_size}; {args.seqs} sequences of {length} tokens "
          f"from {args.text} (byte {args.start}); torch threads {torch.get_num_threads()}")
    with torch.inference_mode():
        reference_attention = ExactWithStats()
        reference = reference_model(inputs, reference_attention)
        if args.stats:
            print("| layer | mean scale·‖q‖² | mean scale·‖k‖² | attention entropy (nats) |")
            print("|---|---|---|---|")
            for layer, s in enumerate(reference_attention.stats):
                print(f"| {layer} | {s['q_norm']:.2f} | {s['k_norm']:.2f} | {s['entropy']:.2f} |")
            print(f"uniform attention's mean entropy over these positions: "
                  f"{float(torch.log(torch.arange(1, length + 1, dtype=torch.float64)).mean()):.2f} nats")
        oracle_kls = {length: 0.0}  # k -> KL of oracle-topk with k (k = n: exact attention)

        def oracle_kl(k):
            if k not in oracle_kls:
                oracle_kls[k] = compare(reference, model(inputs, oracle_topk_attention(k)), targets)[0]
            return oracle_kls[k]

        print("| method | KL (nats) | top-1 | NLL (nats/token) | causal pairs scored | oracle KL [k] | KL/oracle "
              "| attention s |")
        print("|---|---|---|---|---|---|---|---|")
        for name, attend, pairs_scored in attentions:
            try:
                logits = model(inputs, attend)
            except (ValueError, TypeError) as e:
                print(f"model_eval.py: {name}: {e}", file=sys.stderr)
                sys.exit(2)
            kl, top1, nll = compare(reference, logits, targets)
            share = pairs_scored(length) if pairs_scored else None
            support, drawn = share if isinstance(share, tuple) else (share, 0.0)
            oracle, ratio = "-", "-"
            if share is not None:
                k = oracle_k(support + drawn, length)
                ok = oracle_kl(k)
                oracle = f"{ok:.3g} [{k}]"
                ratio = f"{kl / ok:.2f}" if ok > 0 else "-"
            share = "-" if share is None else f"{support:.3f}" + (f" + {drawn:.3f} drawn" if drawn else "")
            print(f"| {name} | {kl:.3g} | {top1:.4f} | {nll:.4f} | {share} | {oracle} | {ratio} | "
                  f"{attend.seconds:.3f} |", flush=True)


if __name__ == "__main__":
    main()
