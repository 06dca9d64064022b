#!/usr/bin/env python3
"""Relative spectral error against budget for Algorithm 1 and the three baselines.

Runs `tensor_sketch --curve` (built in the build directory) to produce
docs/sketch_spectral_error.csv, then draws docs/sketch_spectral_error.png from it.

    /usr/bin/python3 scripts/plot_sketch.py [--build BUILD_DIR] [--csv EXISTING.csv]

With --csv the example is not run and the given file is plotted.
"""
import argparse
import csv
import os
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STYLE = {  # scheme: (label, colour, marker)
    "spa": ("Algorithm 1 (spa)", "tab:blue", "o"),
    "ndt": ("NDT-style (zeroes small)", "tab:orange", "s"),
    "l2": ("pure $a^2$-sampling", "tab:green", "^"),
    "uniform": ("uniform", "tab:red", "v"),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"), help="CMake build directory")
    parser.add_argument("--csv", help="plot this CSV instead of running the example")
    args = parser.parse_args()

    csv_path = args.csv or os.path.join(ROOT, "docs", "sketch_spectral_error.csv")
    if not args.csv:
        exe = os.path.join(args.build, "examples", "tensor_sketch")
        if not os.path.exists(exe):
            sys.exit(f"{exe} not found: build the tensor_sketch target first")
        os.makedirs(os.path.dirname(csv_path), exist_ok=True)
        subprocess.run([exe, "--curve", csv_path], check=True)

    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))

    fig, axes = plt.subplots(2, 2, figsize=(10, 8), sharex=True, sharey=True)
    for i, factors in enumerate(["sign", "gaussian"]):
        for j, spikes in enumerate(["0", "30"]):
            ax = axes[i][j]
            for scheme, (label, colour, marker) in STYLE.items():
                pts = sorted(
                    (float(r["budget_fraction"]), float(r["rel_spectral"]))
                    for r in rows
                    if r["factors"] == factors and r["spikes"] == spikes and r["scheme"] == scheme
                )
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=colour, label=label)
            ax.axhline(1.0, color="grey", lw=0.8, ls=":")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            title = f"{factors} factors" + (f", {spikes} spikes of 0.3" if spikes != "0" else ", no spikes")
            ax.set_title(title, fontsize=10)
            if i == 1:
                ax.set_xlabel("budget n / D  (baselines at the same expected nnz)")
            if j == 0:
                ax.set_ylabel("relative spectral error")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(
        "Order-3 tensors, d = 64, Tucker rank 3 + noise 0.3: ||A - Â|| / ||A||\n"
        "(mean of 3 draws; spectral norms by the higher-order power method)",
        fontsize=11,
    )
    fig.tight_layout()
    out = os.path.join(ROOT, "docs", "sketch_spectral_error.png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
