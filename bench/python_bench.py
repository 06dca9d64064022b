#!/usr/bin/env python3
"""Cost of the Python binding, measured in one run (the machine may be shared and noisy):

1. call overhead at n = 16: microseconds per randattn.attention call, NumPy and torch inputs,
   one thread (the computation itself is a few microseconds for exact attention; favor also
   draws its 256 x d projections on every call);
2. throughput at n = 16384: the same method and shape timed from Python and by randattn-cli
   (its --report "seconds" covers the computation only, no file I/O); ratio = C++ time / Python
   time, so 1.0 means the binding costs nothing.

Each timing is the minimum over interleaved repeats. Usage (from a build with the module and
randattn-cli, e.g. scripts/test.sh's):
    PYTHONPATH=build/python /usr/bin/python3 bench/python_bench.py --cli build/tools/cli/randattn-cli
"""

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

import randattn


def cli_seconds(cli, workdir, method, arrays, threads, extra):
    cmd = [cli, "attention", "--method", method, "--report", "--threads", str(threads), "--out",
           str(workdir / "out.npy")] + extra
    for name, path in arrays.items():
        cmd += [f"--{name}", str(path)]
    report = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(report.strip().splitlines()[-1])["seconds"]


def python_seconds(fn, repeat=1):
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def inputs(n, d, shared, dtype, workdir):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, n, d)).astype(dtype) for _ in range(3))
    arrays = {"q": q, "v": v} if shared else {"q": q, "k": k, "v": v}
    paths = {}
    for name, a in arrays.items():
        paths[name] = workdir / f"{name}_{n}.npy"
        np.save(paths[name], a)
    return q, (None if shared else k), v, paths


CASES = [  # method, options, CLI flags
    ("exact", {}, []),
    ("favor", {"features": 256}, ["--features", "256"]),
    ("lsh", {"chunk": 64, "rounds": 4, "shared_qk": True}, ["--chunk", "64", "--rounds", "4", "--shared-qk"]),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cli", required=True, help="path of randattn-cli")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--d", type=int, default=64)
    args = parser.parse_args()
    dtype = np.float32
    try:
        import torch
    except ImportError:
        torch = None

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print(f"randattn {randattn.__version__}, float32, batch 1 x heads 4, d = {args.d}, threads = {args.threads}")
        print()
        print("call overhead, n = 16 (us per call)")
        print(f"{'method':<8} {'numpy':>9} {'torch':>9}")
        for method, options, flags in CASES:
            q, k, v, _ = inputs(16, args.d, method == "lsh", dtype, work)
            call = lambda a, b, c: randattn.attention(a, b, c, method=method, threads=1, **options)  # noqa: E731
            call(q, k, v)
            t_np = min(python_seconds(lambda: call(q, k, v), 2000) for _ in range(args.repeats))
            t_torch = float("nan")
            if torch is not None:
                tq, tv = torch.from_numpy(q), torch.from_numpy(v)
                tk = None if k is None else torch.from_numpy(k)
                t_torch = min(python_seconds(lambda: call(tq, tk, tv), 2000) for _ in range(args.repeats))
            print(f"{method:<8} {1e6 * t_np:9.1f} {1e6 * t_torch:9.1f}")

        print()
        print(f"throughput, n = {args.n} (seconds per call; ratio = C++ / Python, 1 = no binding cost)")
        print(f"{'method':<8} {'Python':>9} {'C++':>9} {'ratio':>7}")
        for method, options, flags in CASES:
            q, k, v, paths = inputs(args.n, args.d, method == "lsh", dtype, work)
            py_times, cpp_times = [], []
            for _ in range(args.repeats):  # interleaved, so both sides see the same machine load
                py_times.append(python_seconds(
                    lambda: randattn.attention(q, k, v, method=method, threads=args.threads, **options)))
                cpp_times.append(cli_seconds(args.cli, work, method, paths, args.threads, flags))
            t_py, t_cpp = min(py_times), min(cpp_times)
            print(f"{method:<8} {t_py:9.4f} {t_cpp:9.4f} {t_cpp / t_py:7.3f}")


if __name__ == "__main__":
    main()
