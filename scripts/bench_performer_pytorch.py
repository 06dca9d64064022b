#!/usr/bin/env python3
"""Causal FAVOR+ training step (forward + backward) side by side: randattn against performer-pytorch.

One head of queries, keys and values (n, d = dv = 64, float32, m = 256 features, one thread); a step
is the attention's forward, a scalar loss and the backward to q, k and v. Prints one row per
implementation and length, with the step time and its ratio to randattn's in the same run.

performer-pytorch (lucidrains/performer-pytorch) is not a Debian package: pass a checkout of it with
--performer-source DIR. Its FastAttention module is loaded from DIR/performer_pytorch/
performer_pytorch.py with stand-ins for the modules it imports but this step does not use
(einops' repeat, local_attention, axial_positional_embedding). Without fast-transformers' CUDA
kernel, its causal path is its own plain-torch version (autograd through cumsum over chunks, which
keeps an n·m·dv tensor for the backward). Without --performer-source, a plain-torch transcription of
that algorithm (written here from its description) stands in, and the row says so.
"""

import argparse
import importlib.util
import math
import sys
import time
import types

import torch

import randattn


def einops_stand_in():
    """einops.repeat for the one pattern softmax_kernel uses ('j d -> b h j d'), and rearrange as
    a name the module imports."""
    module = types.ModuleType("einops")

    def repeat(t, pattern, **sizes):
        if pattern.replace(" ", "") != "jd->bhjd":
            raise NotImplementedError(pattern)
        return t.expand(sizes["b"], sizes["h"], *t.shape)

    def rearrange(*args, **kwargs):
        raise NotImplementedError("rearrange is not used by FastAttention")

    module.repeat, module.rearrange = repeat, rearrange
    return module


def load_performer(source):
    """FastAttention from a performer-pytorch checkout."""
    stubs = {"einops": einops_stand_in()}
    for name, attr in (("local_attention", "LocalAttention"), ("axial_positional_embedding",
                                                              "AxialPositionalEmbedding")):
        stubs[name] = types.ModuleType(name)
        setattr(stubs[name], attr, object)
    package = types.ModuleType("performer_pytorch")
    package.__path__ = [f"{source}/performer_pytorch"]
    stubs["performer_pytorch"] = package
    sys.modules.update(stubs)
    spec = importlib.util.spec_from_file_location("performer_pytorch.performer_pytorch",
                                                  f"{source}/performer_pytorch/performer_pytorch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FastAttention


def plain_torch_causal_favor(q, k, v, omega, chunks=128, eps=1e-6):
    """Causal FAVOR+ by autograd through cumulative sums (the algorithm of performer-pytorch's
    non-CUDA path): positive features with a per-row stabiliser for queries and one over all keys,
    then per chunk the running sums of φ(k) and φ(k) vᵀ."""
    d = q.shape[-1]
    c = d ** -0.25
    ratio = omega.shape[0] ** -0.5

    def features(x, over_all):
        u = (c * x) @ omega.t()
        top = u.amax(dim=(-1, -2) if over_all else -1, keepdim=True).detach()
        return ratio * (torch.exp(u - (c * c / 2) * (x * x).sum(-1, keepdim=True) - top) + 1e-4)

    fq, fk = features(q, False), features(k, True)
    outs, last_k, last_ctx = [], 0, 0
    for qc, kc, vc in zip(fq.chunk(chunks, dim=-2), fk.chunk(chunks, dim=-2), v.chunk(chunks, dim=-2)):
        k_cum = last_k + kc.cumsum(dim=-2)
        ctx = last_ctx + torch.einsum("nd,ne->nde", kc, vc).cumsum(dim=-3)
        out = torch.einsum("nde,nd->ne", ctx, qc) / (qc * (k_cum + eps)).sum(-1, keepdim=True)
        last_k, last_ctx = k_cum[-1:], ctx[-1:]
        outs.append(out)
    return torch.cat(outs, dim=-2)


def step_seconds(fn, q, k, v, repeats):
    """The fastest of `repeats` training steps (forward, loss, backward)."""
    best = math.inf
    for _ in range(repeats):
        for t in (q, k, v):
            t.grad = None
        start = time.perf_counter()
        out = fn(q, k, v)
        out.square().mean().backward()
        best = min(best, time.perf_counter() - start)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--performer-source", help="a checkout of lucidrains/performer-pytorch")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    d = 64
    omega = torch.from_numpy(randattn.FeatureMap("positive", d, seed=0, features=args.features).omega).float()
    if args.performer_source:
        FastAttention = load_performer(args.performer_source)
        performer = FastAttention(dim_heads=d, nb_features=args.features, causal=True)
        performer.projection_matrix.copy_(omega)
        other_name = "performer-pytorch FastAttention(causal=True)"

        def other(q, k, v):
            return performer(q[None, None], k[None, None], v[None, None])[0, 0]
    else:
        other_name = "plain-torch causal FAVOR+ (autograd through cumsum)"

        def other(q, k, v):
            return plain_torch_causal_favor(q, k, v, omega)

    def ours(q, k, v):
        return randattn.attention(q, k, v, method="favor", features=args.features, causal=True, threads=1)

    print(f"{'implementation':<52} {'n':>6} {'step (s)':>10} {'÷ randattn':>11}")
    for n in args.lengths:
        g = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(n, d, generator=g).requires_grad_() for _ in range(3))
        mine = step_seconds(ours, q, k, v, args.repeats)
        theirs = step_seconds(other, q, k, v, args.repeats)
        print(f"{'randattn favor (causal)':<52} {n:>6} {mine:>10.4f} {1.0:>11.2f}")
        print(f"{other_name:<52} {n:>6} {theirs:>10.4f} {theirs / mine:>11.2f}")


if __name__ == "__main__":
    main()
