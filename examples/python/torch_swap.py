#!/usr/bin/env python3
"""Swap the attention of a small torch encoder block for randattn's FAVOR+ at inference.

The block (pre-norm self-attention and MLP, 2 heads of dimension 64) runs once with a
hand-written softmax attention (exact; query blocks keep the n x n scores out of memory) and once
with randattn.torch.Attention(method="favor"); the script prints the relative difference of the
block outputs and both times, on the CPU, at n = 4096 and 16384.

    PYTHONPATH=build/python /usr/bin/python3 examples/python/torch_swap.py [--n 4096 16384]
"""

import argparse
import time

import torch

import randattn.torch


class SoftmaxAttention(torch.nn.Module):
    """softmax(q kᵀ / sqrt(d)) v for (batch, heads, n, d) tensors, one block of queries at a time."""

    def __init__(self, block=1024):
        super().__init__()
        self.block = block

    def forward(self, q, k, v):
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
        scale = q.shape[-1] ** -0.5
        for i in range(0, q.shape[-2], self.block):
            scores = (q[..., i:i + self.block, :] @ k.transpose(-2, -1)) * scale
            out[..., i:i + self.block, :] = torch.softmax(scores, dim=-1) @ v
        return out


class EncoderBlock(torch.nn.Module):
    def __init__(self, width=128, heads=2):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.norm2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))
        self.attention = SoftmaxAttention()

    def forward(self, x):
        b, n, w = x.shape
        # (batch, n, 3, heads, d) -> three (batch, heads, n, d) views (not contiguous: randattn
        # copies each once).
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        a = self.attention(q, k, v).transpose(1, 2).reshape(b, n, w)
        x = x + self.proj(a)
        return x + self.mlp(self.norm2(x))


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--features", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)
    block = EncoderBlock().eval()
    softmax = block.attention
    favor = randattn.torch.Attention(method="favor", features=args.features, seed=0)
    print(f"encoder block: width 128, 2 heads of 64, float32, CPU, {torch.get_num_threads()} threads; "
          f"favor with {args.features} features")
    print(f"{'n':>6} {'softmax s':>10} {'favor s':>9} {'speedup':>8} {'rel. diff':>10}")
    for n in args.n:
        x = torch.randn(1, n, 128)
        with torch.inference_mode():
            block.attention = softmax
            exact, t_exact = timed(lambda: block(x))
            block.attention = favor
            approx, t_favor = timed(lambda: block(x))
        diff = float(torch.linalg.norm(approx - exact) / torch.linalg.norm(exact))
        print(f"{n:>6} {t_exact:10.3f} {t_favor:9.3f} {t_exact / t_favor:8.2f} {diff:10.2e}")


if __name__ == "__main__":
    main()
