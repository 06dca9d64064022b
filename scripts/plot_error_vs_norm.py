#!/usr/bin/python3
"""Attention error of random features, and of sparse + low-rank attention with an OPRF
remainder, against exact attention versus the norm of q and k (docs/error_vs_norm.png), at an
equal budget of about 256 features.

Usage: scripts/plot_error_vs_norm.py [BUILD_DIR | --csv FILE]   (default: build)
Runs BUILD_DIR/examples/error_vs_norm, which prints the CSV (or reads a CSV it printed before),
plots it and prints the README table (the rows scale*|q|^2 = 0.98, 2.0, 3.9, 8.0).
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
if len(sys.argv) > 2 and sys.argv[1] == "--csv":
    with open(sys.argv[2]) as f:
        text = f.read()
else:
    build = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "build")
    text = subprocess.run([os.path.join(build, "examples", "error_vs_norm")], check=True,
                          capture_output=True, text=True).stdout
rows = list(csv.DictReader(io.StringIO(text)))
maps = [("positive", "positive (FAVOR+)", "o-"), ("hyperbolic", "hyperbolic", "d-"),
        ("oprf", "OPRF", "s-"), ("sderf", "SDERF", "^-"), ("trig", "trig", "v-"),
        ("hybrid", "angular hybrid", "x-"), ("sparse-lowrank", "sparse-lowrank: LSH support + OPRF", "*-")]

fig, ax = plt.subplots(figsize=(7, 4.5))
for key, label, style in maps:
    sel = [r for r in rows if r["map"] == key]
    ax.errorbar([float(r["scaled_sq_norm"]) for r in sel], [float(r["mean_rel_error"]) for r in sel],
                yerr=[float(r["stderr"]) for r in sel], fmt=style, capsize=2,
                label=f"{label} ({sel[0]['feature_dim']} features)")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("scale * |q|^2")
ax.set_ylabel("relative error vs exact attention")
ax.set_title("Q, K ~ s N(0, I), n = 4096, d = 64, scale = 1/8; mean of 3 seeds")
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize=8)
fig.tight_layout()
out = os.path.join(root, "docs", "error_vs_norm.png")
fig.savefig(out, dpi=120)
print("wrote", out)

print("| s | scale·‖q‖² | " + " | ".join(label for _, label, _ in maps) + " | predicted rel. MSE FAVOR+ / OPRF / SDERF |")
print("|---" * (len(maps) + 3) + "|")
for s in ("0.35", "0.5", "0.7", "1"):
    sel = {r["map"]: r for r in rows if r["s"] == s}
    cells = [f"{float(sel[k]['mean_rel_error']):.3f} ± {float(sel[k]['stderr']):.3f}" for k, _, _ in maps]
    pred = " / ".join(f"{float(sel[k]['predicted_rel_mse']):.3g}" for k in ("positive", "oprf", "sderf"))
    print(f"| {s} | {float(sel['positive']['scaled_sq_norm']):.2f} | " + " | ".join(cells) + f" | {pred} |")
