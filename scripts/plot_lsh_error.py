#!/usr/bin/python3
"""Attention error of LSH attention against exact shared-QK attention versus the number of hash
rounds, on a clustered sequence (examples/lsh_long_sequence.cpp). Writes docs/lsh_error_vs_rounds.png.

    /usr/bin/python3 scripts/plot_lsh_error.py [build-dir] [n]
"""
import csv
import os
import subprocess
import sys
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
build = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "build")
n = sys.argv[2] if len(sys.argv) > 2 else "4096"
example = os.path.join(build, "examples", "lsh_long_sequence")
if not os.path.exists(example):
    sys.exit(f"{example} not found: cmake --build {build} --target lsh_long_sequence")

with tempfile.TemporaryDirectory() as tmp:
    table = os.path.join(tmp, "lsh.csv")
    subprocess.run([example, "--n", n, "--rounds", "1,2,3,4,5,6,7,8", "--csv", table], check=True)
    with open(table) as f:
        rows = list(csv.DictReader(f))

series = {
    ("chunks", "dense", "1"): ("sort-and-chunk, dense rotation", "C0", "o-"),
    ("chunks", "hadamard", "1"): ("sort-and-chunk, Hadamard rotation", "C1", "s--"),
    ("chunks", "dense", "0"): ("sort-and-chunk, no union correction (trax/HF)", "C2", "^:"),
    ("buckets", "dense", "1"): ("exact buckets, dense rotation", "C3", "d-."),
}
fig, ax = plt.subplots(figsize=(6.4, 4.2))
for key, (label, color, style) in series.items():
    pts = [(int(r["rounds"]), float(r["rel_error"])) for r in rows if (r["mode"], r["rotation"], r["dedupe"]) == key]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, label=label)
ax.set_yscale("log")
ax.set_xlabel("hash rounds r")
ax.set_ylabel("relative error vs exact shared-QK attention")
ax.set_title(f"LSH attention on a clustered sequence\n(n = {n}, d = 64, c = 64, b = 2n/c, float)", fontsize=10)
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize=8)
fig.tight_layout()
out = os.path.join(root, "docs", "lsh_error_vs_rounds.png")
fig.savefig(out, dpi=120)
print("wrote", out)
