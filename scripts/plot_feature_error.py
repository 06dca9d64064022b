#!/usr/bin/python3
"""Attention error of random features against exact attention versus m (docs/feature_error.png).

Usage: scripts/plot_feature_error.py [BUILD_DIR]   (default: build)
Runs BUILD_DIR/examples/feature_error, which prints the CSV, and plots it.
"""
import csv
import io
import os
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
build = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "build")
text = subprocess.run([os.path.join(build, "examples", "feature_error")], check=True,
                      capture_output=True, text=True).stdout
rows = list(csv.DictReader(io.StringIO(text)))


def series(map_name, projection, x_key):
    sel = [r for r in rows if r["map"] == map_name and r["projection"] == projection]
    return ([int(r[x_key]) for r in sel], [float(r["mean_rel_error"]) for r in sel],
            [float(r["stderr"]) for r in sel])


fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
for projection, style in [("iid", "o-"), ("orthogonal", "s-"), ("hadamard", "^-")]:
    x, y, e = series("positive", projection, "m")
    left.errorbar(x, y, yerr=e, fmt=style, capsize=2, label=projection)
left.set_title("positive (FAVOR+) features: projections")
left.set_xlabel("projections m")
left.set_ylabel("relative error vs exact attention")
for map_name, style in [("positive", "s-"), ("hyperbolic", "d-"), ("trig", "v-")]:
    x, y, e = series(map_name, "orthogonal", "feature_dim")
    right.errorbar(x, y, yerr=e, fmt=style, capsize=2, label=map_name)
right.set_title("maps (orthogonal projections)")
right.set_xlabel("feature dimension M (m for positive, 2m otherwise)")
for ax in (left, right):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
fig.suptitle("n = 1024, d = 64, scale = 1/8, tokens around 8 topics (examples/feature_error.cpp); mean of 8 seeds")
fig.tight_layout()
out = os.path.join(root, "docs", "feature_error.png")
fig.savefig(out, dpi=110)
print(out)
