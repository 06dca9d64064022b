#!/usr/bin/env python3
"""Output fingerprints of every attention method of randattn-cli, float32 and float64.

A migration check: the SHA-256 of each method's output bytes on fixed inputs and explicit
options, so that a restructuring of the front ends or of the library can show that it changed
no output bit. Record with --write, compare with --check (exit 1 and the differing cases listed).
The fingerprints hold for one compiler, CPU (-march=native) and optimisation level
(scripts/test.sh's build: GCC, -O2), so tests/fingerprints/ keeps one file per compiler version
and CPU (tests/CMakeLists.txt names it); --check of a file that does not exist reports that none
were recorded there and exits with 77 (skipped). Re-record them, with the reason in the commit
message, when an intended numerical change lands (on every CPU you can; a file that cannot be
re-recorded is deleted rather than left stale).

    fingerprints.py --cli build/tools/cli/randattn-cli --write tests/fingerprints/<name>.txt
    fingerprints.py --cli build/tools/cli/randattn-cli --check tests/fingerprints/<name>.txt
"""

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile

import numpy as np

# (case name, method, extra flags, keys: "separate" or "shared"). Every option that sets the
# result is given explicitly, so a change of a default does not show here.
FEATURES = ["--features", "16", "--seed", "3"]
CASES = [
    ("exact", "exact", [], "separate"),
    ("exact-causal", "exact", ["--causal"], "separate"),
    ("exact-scale", "exact", ["--scale", "0.7"], "separate"),
    ("favor", "favor", FEATURES, "separate"),
    ("favor-causal", "favor", FEATURES + ["--causal"], "separate"),
    ("favor-iid", "favor", FEATURES + ["--projection", "iid"], "separate"),
    ("favor-hadamard", "favor", FEATURES + ["--projection", "hadamard"], "separate"),
    ("favor-hyp", "favor-hyp", FEATURES, "separate"),
    ("trig", "trig", FEATURES, "separate"),
    ("trig-causal", "trig", FEATURES + ["--causal"], "separate"),
    ("oprf", "oprf", FEATURES, "separate"),
    ("oprf-rho-causal", "oprf", FEATURES + ["--fit", "given", "--rho", "2.5", "--causal"],
     "separate"),
    ("sderf", "sderf", FEATURES, "separate"),
    ("sderf-rho", "sderf", FEATURES + ["--fit", "given", "--rho", "2.5"], "separate"),
    ("hybrid", "hybrid", FEATURES + ["--lambda-features", "4"], "separate"),
    ("hybrid-gaussian", "hybrid-gaussian",
     FEATURES + ["--lambda-features", "4", "--bandwidth", "0.8"], "separate"),
    ("lsh-shared", "lsh", ["--chunk", "8", "--rounds", "3", "--seed", "5", "--scale", "1"],
     "shared"),
    ("lsh-shared-causal", "lsh",
     ["--chunk", "8", "--rounds", "3", "--seed", "5", "--scale", "1", "--causal"], "shared"),
    ("lsh-shared-buckets", "lsh",
     ["--chunk", "8", "--rounds", "2", "--seed", "5", "--scale", "1", "--exact-buckets"],
     "shared"),
    ("lsh-shared-hadamard-nodedupe", "lsh",
     ["--chunk", "8", "--rounds", "3", "--seed", "5", "--scale", "1", "--rotation", "hadamard",
      "--no-dedupe"], "shared"),
    ("lsh-separate-buckets", "lsh",
     ["--buckets", "4", "--rounds", "3", "--seed", "5", "--scale", "1", "--exact-buckets"],
     "separate"),
    ("lsh-separate-buckets-causal", "lsh",
     ["--buckets", "4", "--rounds", "3", "--seed", "5", "--scale", "1", "--exact-buckets",
      "--causal"], "separate"),
    ("lsf", "lsf", ["--filters", "16", "--tables", "3", "--eta", "0.5", "--seed", "7"],
     "separate"),
    ("lsf-alpha-causal", "lsf",
     ["--filters", "16", "--tables", "3", "--alpha", "0.6", "--seed", "7", "--causal"],
     "separate"),
    ("sparse-lowrank-lsh-oprf", "sparse-lowrank",
     ["--support", "lsh", "--chunk", "8", "--rounds", "3", "--remainder", "oprf"] + FEATURES,
     "separate"),
    ("sparse-lowrank-window-blocks-sample-causal", "sparse-lowrank",
     ["--support", "window,blocks", "--window", "4", "--sinks", "1", "--block-size", "8",
      "--top-blocks", "1", "--remainder", "sample", "--samples", "4", "--seed", "3", "--causal"],
     "separate"),
]


def inputs(dtype):
    rng = np.random.default_rng(20261201)
    shape = (2, 2, 37, 8)
    q = rng.standard_normal(shape)
    k = rng.standard_normal(shape)
    v = rng.standard_normal(shape[:3] + (5,))
    return [a.astype(dtype) for a in (q, k, v)]


def shared_qk_flag(cli):
    """The flag that asks for shared queries and keys, where the CLI has one."""
    text = subprocess.run([cli, "attention", "--help"], capture_output=True, text=True).stdout
    return ["--shared-qk"] if "--shared-qk" in text else []


def fingerprints(cli, work):
    shared = shared_qk_flag(cli)
    result = {}
    for dtype in (np.float32, np.float64):
        q, k, v = inputs(dtype)
        tag = np.dtype(dtype).name
        paths = {}
        for name, a in (("q", q), ("k", k), ("v", v)):
            paths[name] = os.path.join(work, f"{name}-{tag}.npy")
            np.save(paths[name], a)
        for case, method, flags, keys in CASES:
            out = os.path.join(work, f"out-{case}-{tag}.npy")
            cmd = [cli, "attention", "--method", method, "--q", paths["q"], "--v", paths["v"],
                   "--out", out] + flags
            cmd += shared if keys == "shared" else ["--k", paths["k"]]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode != 0:
                sys.exit(f"{case} ({tag}) failed: {' '.join(cmd)}\n{run.stderr}")
            data = np.load(out)
            digest = hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()
            result[f"{case} {tag}"] = digest
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cli", required=True)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write")
    mode.add_argument("--check")
    args = parser.parse_args()
    if args.check and not os.path.exists(args.check):
        print(f"no fingerprints recorded for this compiler and CPU ({args.check}); "
              f"record them with --write {args.check}")
        return 77
    with tempfile.TemporaryDirectory() as work:
        got = fingerprints(args.cli, work)
    if args.write:
        os.makedirs(os.path.dirname(os.path.abspath(args.write)), exist_ok=True)
        with open(args.write, "w") as f:
            for key, digest in got.items():
                f.write(f"{key} {digest}\n")
        return 0
    expected = {}
    with open(args.check) as f:
        for line in f:
            case, tag, digest = line.split()
            expected[f"{case} {tag}"] = digest
    differ = sorted(k for k in expected if got.get(k) != expected[k])
    missing = sorted(set(expected) - set(got))
    for k in differ:
        print(f"changed: {k}")
    for k in missing:
        print(f"missing: {k}")
    print(f"{len(expected) - len(differ)} of {len(expected)} fingerprints unchanged")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
