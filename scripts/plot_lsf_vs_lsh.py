#!/usr/bin/python3
"""Error against time of LSF and LSH attention on the same unit-sphere data (bench/bench_lsf.cpp),
time as a fraction of tiled exact attention measured in the same run. Writes docs/lsf_vs_lsh.png.

    /usr/bin/python3 scripts/plot_lsf_vs_lsh.py [build-dir | results.json ...]

With a build directory it runs build/bench/bench_lsf (single thread, several minutes) and keeps
its JSON in the build directory; with .json files (Google Benchmark --benchmark_out, e.g. one per
n from --benchmark_filter) it plots those results.
"""
import json
import os
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sources = sys.argv[1:] or [os.path.join(root, "build")]
if all(s.endswith(".json") for s in sources):
    results = sources
else:
    bench = os.path.join(sources[0], "bench", "bench_lsf")
    if not os.path.exists(bench):
        sys.exit(f"{bench} not found: cmake --build {sources[0]} --target bench_lsf")
    results = [os.path.join(sources[0], "bench_lsf.json")]
    subprocess.run([bench, "--benchmark_format=console", "--benchmark_out_format=json",
                    f"--benchmark_out={results[0]}"], check=True)
runs = []
for path in results:
    with open(path) as f:
        runs += json.load(f)["benchmarks"]


def args(name):
    """'Lsf/n:16384/L:2/eta_x100:250/rotation:1/real_time' -> {'n': 16384, ...}"""
    return {k: int(v) for k, v in (p.split(":") for p in name.split("/")[1:] if ":" in p)}


sizes = sorted({args(r["name"])["n"] for r in runs})
fig, axes = plt.subplots(1, len(sizes), figsize=(6.0 * len(sizes), 4.4), squeeze=False)
for ax, n in zip(axes[0], sizes):
    series = {}
    for r in runs:
        a = args(r["name"])
        if a.get("n") != n or "rel_error" not in r:
            continue
        family = r["name"].split("/")[0]
        if family == "Lsh":
            key, label = ("lsh", a["c"]), f"LSH, exact buckets, c = {a['c']} (points: rounds r)"
            tag, order = f"r={a['r']}", a["r"]
        else:
            rotation = "Hadamard" if a["rotation"] == 1 else "dense"
            key, label = ("lsf", a["rotation"], a["L"]), f"LSF, {rotation} filters, m = n/32, L = {a['L']} (points: eta)"
            tag, order = f"{a['eta_x100'] / 100:g}", -a["eta_x100"]
        series.setdefault(key, (label, []))[1].append((order, 1.0 / r["speedup_cpu"], r["rel_error"], tag))
    styles = {("lsh", 64): ("k", "o-"), ("lsh", 256): ("0.5", "o")}
    colors = ["C0", "C1", "C2", "C3", "C4"]
    for i, (key, (label, pts)) in enumerate(sorted(series.items(), key=lambda kv: str(kv[0]))):
        color, style = styles.get(key, (colors[i % len(colors)], "s--" if key[0] == "lsf" and key[1] == 1 else "^:"))
        pts.sort()
        ax.plot([p[1] for p in pts], [p[2] for p in pts], style, color=color, label=label)
        for _, x, y, tag in pts:
            ax.annotate(tag, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("time / tiled exact attention (CPU time, same run)")
    ax.set_ylabel("relative error vs exact attention")
    ax.set_title(f"n = {n}, d = 64, unit-norm clustered q, k, scale 16, 1 thread", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
fig.tight_layout()
out = os.path.join(root, "docs", "lsf_vs_lsh.png")
fig.savefig(out, dpi=120)
print("wrote", out)
