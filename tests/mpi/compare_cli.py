#!/usr/bin/env python3
"""randattn-mpi at 1, 2 and 3 ranks gives randattn-cli's results on the same .npy inputs.

Attention (every method, causal and bidirectional, float32; n = 37 is divisible by neither 2
nor 3): max |mpi - cli| <= 1e-5 max |cli| (the results differ only in the order in which partial
sums are merged). Under a layout (key lengths, a key padding mask, packed sequences, grouped
heads, self-exclusion; exact, favor, oprf and lsh) each rank runs whole batch items and sequences:
the outputs are identical bit for bit. sparsify: the output files are identical byte for byte. hosvd: every factor
within ||(I - U U^T) V||_F <= 1e-5 of randattn-cli's (an upper bound of sin-Theta). A NaN in the
last rank's rows: every rank exits 2, one error line, no output file, no hang. One rank that
fails before the first exchange (its input file missing, a flag it rejects, an option file it
cannot read; run as two programs, each rank with its own command line): every rank exits 2 within
seconds with that rank's message, no output file.
Pure Python (no NumPy): .npy files are read and written here directly.
"""
import argparse
import ast
import os
import random
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

TIMEOUT = 120


def write_npy(path, shape, values, dtype="<f4"):
    header = "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }" % (
        dtype, "".join("%d, " % s for s in shape))
    pad = (64 - (10 + len(header) + 1) % 64) % 64
    header += " " * pad + "\n"
    code = {"<f2": "e", "<f4": "f", "<f8": "d", "<i8": "q", "|b1": "?"}[dtype]
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
        f.write(struct.pack("<%d%s" % (len(values), code), *values))


def read_npy(path, with_dtype=False):
    with open(path, "rb") as f:
        data = f.read()
    major = data[6]
    hlen = struct.unpack("<H", data[8:10])[0] if major == 1 else struct.unpack("<I", data[8:12])[0]
    start = (10 if major == 1 else 12) + hlen
    header = ast.literal_eval(data[(10 if major == 1 else 12):start].decode())
    code = {"<f2": "e", "<f4": "f", "<f8": "d"}[header["descr"]]
    count = 1
    for s in header["shape"]:
        count *= s
    values = struct.unpack("<%d%s" % (count, code), data[start:start + count * struct.calcsize(code)])
    return (header["shape"], values, header["descr"]) if with_dtype else (header["shape"], values)


def run(cmd, env):
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mpiexec", required=True)
    ap.add_argument("--mpi", required=True)
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--ranks", default="1,2,3")
    ap.add_argument("--jobs", type=int, default=3, help="comparisons run at a time")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    rng = random.Random(7)
    w = lambda name: os.path.join(a.work, name)
    n, d, dv = 37, 8, 5
    gauss = lambda count, sd=1.0: [rng.gauss(0.0, sd) for _ in range(count)]
    write_npy(w("q.npy"), (n, d), gauss(n * d, 0.5))
    write_npy(w("k.npy"), (n, d), gauss(n * d, 0.5))
    write_npy(w("v.npy"), (n, dv), gauss(n * dv))
    for name, shape in (("q", (n, d)), ("k", (n, d)), ("v", (n, dv))):  # float16 copies (rounded)
        write_npy(w(name + "16.npy"), shape, read_npy(w(name + ".npy"))[1], "<f2")
    write_npy(w("q4.npy"), (2, 3, n, d), gauss(6 * n * d, 0.5))
    write_npy(w("k4.npy"), (2, 3, 29, d), gauss(6 * 29 * d, 0.5))
    write_npy(w("v4.npy"), (2, 3, 29, dv), gauss(6 * 29 * dv))
    # Rank 3 plus weak noise: a clear spectral gap, so the factors are well determined.
    dims = (40, 53, 50)
    factors = [[gauss(dj) for _ in range(3)] for dj in dims]
    tensor = [0.05 * x for x in gauss(dims[0] * dims[1] * dims[2], 0.1)]
    for t in range(3):
        a0, a1, a2 = factors[0][t], factors[1][t], factors[2][t]
        weight = 1.0 / (t + 1)
        at = 0
        for i in range(dims[0]):
            for j in range(dims[1]):
                x = weight * a0[i] * a1[j]
                for k in range(dims[2]):
                    tensor[at] += x * a2[k]
                    at += 1
    write_npy(w("A.npy"), dims, tensor)
    # Layouts: 3 batch items (one per rank at np = 3), 4 query heads over 2 key heads.
    write_npy(w("q5.npy"), (3, 4, n, d), gauss(12 * n * d, 0.5))
    write_npy(w("k5.npy"), (3, 2, n, d), gauss(6 * n * d, 0.5))
    write_npy(w("v5.npy"), (3, 2, n, dv), gauss(6 * n * dv))
    for name in ("q5", "k5", "v5"):
        shape, values = read_npy(w(name + ".npy"))
        write_npy(w(name + "_16.npy"), shape, values, "<f2")
    write_npy(w("k5_mha.npy"), (3, 4, n, d), gauss(12 * n * d, 0.5))
    write_npy(w("v5_mha.npy"), (3, 4, n, dv), gauss(12 * n * dv))
    write_npy(w("lengths4.npy"), (2,), [29, 11], "<i8")
    write_npy(w("mask5.npy"), (3, n), [int(j % 5 == 2 or (b == 1 and j > 20) or b == 2) for b in range(3)
                                       for j in range(n)], "|b1")
    write_npy(w("cu5.npy"), (5,), [0, 5, 6, 20, n], "<i8")
    bad = gauss(n * d, 0.5)
    bad[-1] = float("nan")  # the last row: held by the last rank
    write_npy(w("bad.npy"), (n, d), bad)

    # Every comparison below is a job with its own files, and the jobs run a few at a time: most
    # of a job's time is mpiexec starting and stopping ranks, not computing.
    jobs = []
    failures = []

    def report(ok, what):
        print(("ok   " if ok else "FAIL ") + what, flush=True)
        if not ok:
            failures.append(what)

    def error_lines(r):
        return [l for l in r.stderr.splitlines() if l.startswith("randattn-mpi: error:")]

    def job(fn):
        jobs.append(fn)
        return fn

    def mpi(p, args):
        return run([a.mpiexec, "-n", str(p), "--oversubscribe", a.mpi] + args, env)

    qkv4 = ["--q", w("q4.npy"), "--k", w("k4.npy"), "--v", w("v4.npy")]
    gqa = ["--q", w("q5.npy"), "--k", w("k5.npy"), "--v", w("v5.npy")]
    mha = ["--q", w("q5.npy"), "--k", w("k5_mha.npy"), "--v", w("v5_mha.npy")]

    def attention_cases():
        qkv = ["--q", w("q.npy"), "--k", w("k.npy"), "--v", w("v.npy")]
        methods = ["exact", "favor", "favor-hyp", "trig", "hybrid", "hybrid-gaussian"]
        for m in methods:
            for causal in ([], ["--causal"]):
                yield "%s%s" % (m, " causal" if causal else ""), ["--method", m, "--seed", "3"] + qkv + causal, []
        for causal in ([], ["--causal"]):
            yield "lsh%s" % (" causal" if causal else ""), ["--method", "lsh", "--shared-qk", "--chunk", "4", "--seed", "3", "--q",
                                                            w("q.npy"), "--v", w("v.npy")] + causal, []
            yield "exact zigzag%s" % (" causal" if causal else ""), ["--method", "exact"] + qkv + causal, \
                ["--layout", "zigzag"]
        yield "exact 4-D n_q != n_k", ["--method", "exact"] + qkv4, []
        yield "favor 4-D n_q != n_k", ["--method", "favor"] + qkv4, []
        qkv16 = ["--q", w("q16.npy"), "--k", w("k16.npy"), "--v", w("v16.npy")]
        yield "exact causal float16", ["--method", "exact", "--causal"] + qkv16, []
        yield "favor float16", ["--method", "favor", "--seed", "3"] + qkv16, []

    # Layouts run whole batch items and sequences per rank: randattn-cli's output bit for bit.
    def layout_cases():
        for m in ["exact", "favor", "oprf", "lsh"]:
            extra = ["--method", m, "--seed", "3"] + (["--chunk", "4"] if m == "lsh" else [])
            yield m + " key lengths", extra + qkv4 + ["--key-lengths", w("lengths4.npy")]
            for causal in ([], ["--causal"]):
                c = " causal" if causal else ""
                if m != "oprf" or not causal:  # a fit on the sequence is not causal
                    yield m + " grouped heads, key mask" + c, extra + gqa + causal + [
                        "--key-padding-mask", w("mask5.npy")]
                    yield m + " grouped heads, packed sequences" + c, extra + gqa + causal + [
                        "--cu-seqlens", w("cu5.npy")]
                    yield m + " exclude self" + c, extra + mha + causal + ["--exclude-self"]
        yield "exact grouped heads, key mask float16", ["--method", "exact", "--q", w("q5_16.npy"), "--k",
                                                        w("k5_16.npy"), "--v", w("v5_16.npy"),
                                                        "--key-padding-mask", w("mask5.npy")]

    def compare_attention(check, tag, name, args, mpi_only=(), bitwise=False):
        ref_path = w("ref_%s.npy" % tag)
        r = run([a.cli, "attention"] + args + ["--out", ref_path], env)
        check(r.returncode == 0, "randattn-cli attention %s (%s)" % (name, r.stderr.strip()))
        if r.returncode != 0:
            return
        _, ref, ref_dtype = read_npy(ref_path, with_dtype=True)
        scale = max(abs(x) for x in ref)
        # float16 outputs are each program's float32 result rounded once: entries may differ by
        # one float16 spacing (2^-10 |x|, or 2^-24 below 2^-14) beside the float32 difference.
        half = ref_dtype == "<f2"
        for p in map(int, a.ranks.split(",")):
            out = w("out_%s_%d.npy" % (tag, p))
            r = mpi(p, ["attention"] + args + list(mpi_only) + ["--out", out])
            if r.returncode != 0:
                check(False, "np %d attention %s: exit %d: %s" % (p, name, r.returncode, r.stderr.strip()))
                continue
            _, got, got_dtype = read_npy(out, with_dtype=True)
            if got_dtype != ref_dtype:
                check(False, "np %d attention %s: dtype %s, randattn-cli's %s" % (p, name, got_dtype, ref_dtype))
            elif bitwise:
                check(got == ref, "np %d attention %s: bit for bit" % (p, name))
            else:
                spacing = (lambda y: max(2.0 ** -10 * abs(y), 2.0 ** -24)) if half else (lambda y: 0.0)
                ok = len(got) == len(ref) and all(abs(x - y) <= 1e-5 * scale + spacing(y) for x, y in zip(got, ref))
                err = max(abs(x - y) for x, y in zip(got, ref)) / scale
                check(ok, "np %d attention %s: rel error %.2e" % (p, name, err))

    for i, (name, args, mpi_only) in enumerate(attention_cases()):
        job(lambda check, i=i, name=name, args=args, mpi_only=mpi_only:
            compare_attention(check, "a%d" % i, name, args, mpi_only))
    for i, (name, args) in enumerate(layout_cases()):
        job(lambda check, i=i, name=name, args=args: compare_attention(check, "l%d" % i, name, args, bitwise=True))

    write_npy(w("lengths_bad.npy"), (2,), [29, 30], "<i8")  # 30 > n_k = 29
    write_npy(w("cu_bad.npy"), (3,), [0, 20, 36], "<i8")  # does not end at n = 37
    for flag, path, phrase in (("--key-lengths", "lengths_bad.npy", "must be in [0, 29]"),
                               ("--cu-seqlens", "cu_bad.npy", "must start at 0 and end at n = 37")):
        for p in (1, 3):
            @job
            def bad_layout(check, flag=flag, path=path, phrase=phrase, p=p):
                never = w("never_%s_%d.npy" % (flag[2:], p))
                r = mpi(p, ["attention", "--method", "exact", "--out", never, flag, w(path)] +
                        (gqa if flag == "--cu-seqlens" else qkv4))
                lines = error_lines(r)
                check(r.returncode == 2 and len(lines) == 1 and phrase in lines[0] and not os.path.exists(never),
                      "np %d bad %s: exit %d, %s" % (p, flag, r.returncode, lines))

    @job
    def report_under_layout(check):
        r = mpi(2, ["attention", "--method", "favor", "--report", "--out", w("out_report.npy"), "--key-lengths",
                    w("lengths4.npy")] + qkv4)
        lines = r.stdout.strip().splitlines()
        check(r.returncode == 0 and len(lines) == 1 and '"layout":"pieces"' in lines[0] and '"ranks":2' in lines[0],
              "np 2 --report under a layout: one line from rank 0 (%s)" % r.stdout.strip())

    @job
    def zigzag_with_lengths(check):
        never = w("never_zigzag.npy")
        r = mpi(2, ["attention", "--method", "exact", "--layout", "zigzag", "--out", never,
                    "--key-lengths", w("lengths4.npy")] + qkv4)
        check(r.returncode == 2 and "zigzag" in r.stderr and not os.path.exists(never),
              "np 2 --layout zigzag with key lengths: one clear error")

    ranks3 = ["--ranks", "3,3,3", "--budget", "60000", "--seed", "5"]

    # randattn-cli's sketches, made before the jobs that compare with them.
    r = run([a.cli, "sparsify", "--in", w("A.npy"), "--budget", "5000", "--seed", "2", "--out", w("ref_sk.npy")], env)
    report(r.returncode == 0, "randattn-cli sparsify")
    r = run([a.cli, "hosvd", "--in", w("A.npy")] + ranks3 + ["--out-prefix", w("ref_u")], env)
    report(r.returncode == 0, "randattn-cli hosvd")

    for p in map(int, a.ranks.split(",")):
        @job
        def sketches(check, p=p):
            r = mpi(p, ["sparsify", "--in", w("A.npy"), "--budget", "5000", "--seed", "2", "--out", w("sk_%d.npy" % p)])
            check(r.returncode == 0 and open(w("sk_%d.npy" % p), "rb").read() == open(w("ref_sk.npy"), "rb").read(),
                  "np %d sparsify: output identical byte for byte" % p)
            r = mpi(p, ["hosvd", "--in", w("A.npy")] + ranks3 + ["--out-prefix", w("u%d_" % p)])
            check(r.returncode == 0, "np %d hosvd (%s)" % (p, r.stderr.strip()))
            for j in range(3):
                (dj, rj), u = read_npy(w("ref_u%d.npy" % j))
                _, v = read_npy(w("u%d_%d.npy" % (p, j)))
                # R = V - U (U^T V), ||R||_F >= sin-Theta.
                utv = [[sum(u[i * rj + s] * v[i * rj + t] for i in range(dj)) for t in range(rj)] for s in range(rj)]
                res = sum((v[i * rj + t] - sum(u[i * rj + s] * utv[s][t] for s in range(rj))) ** 2
                          for i in range(dj) for t in range(rj)) ** 0.5
                check(res <= 1e-5, "np %d hosvd factor %d: ||(I - UU^T)V||_F = %.2e" % (p, j, res))

        @job
        def nan_on_last_rank(check, p=p):
            out = w("never_nan_%d.npy" % p)
            r = mpi(p, ["attention", "--method", "favor", "--q", w("bad.npy"), "--k", w("k.npy"), "--v", w("v.npy"),
                        "--out", out])
            lines = error_lines(r)
            check(r.returncode == 2 and len(lines) == 1 and "non-finite" in lines[0] and not os.path.exists(out),
                  "np %d NaN on the last rank: exit %d, %d error line(s), no output" % (p, r.returncode, len(lines)))

    # One rank fails before the first exchange: its own command line (MPMD) names a missing input,
    # a bad flag value, an unknown flag or a missing option file. Every rank exits 2 with that
    # rank's message; nobody waits for the others.
    base = ["attention", "--method", "lsh", "--shared-qk", "--v", w("v.npy")]
    q = ["--q", w("q.npy")]
    failing_rank = [
        (["--q", w("missing_on_this_node.npy")], "missing_on_this_node.npy"),
        (["--threads", "0"], "--threads must be in [1, 1024]"),
        (["--no-such-flag"], "no-such-flag"),
        (["--rotations", w("missing_rotations.npy")], "missing_rotations.npy"),
    ]
    for p in (2, 3):
        for case, (extra, phrase) in enumerate(failing_rank):
            for bad_rank in sorted({0, p - 1}):
                @job
                def failing(check, p=p, extra=extra, phrase=phrase, bad_rank=bad_rank, case=case):
                    never = w("never_fail_%d_%d_%d.npy" % (p, case, bad_rank))
                    good = base + q + ["--out", never]
                    cmd = [a.mpiexec, "--oversubscribe"]
                    for rank in range(p):
                        # The failing rank's --q replaces the good one (given once).
                        own_q = [] if "--q" in extra else q
                        cmd += ["-n", "1", a.mpi] + (base + own_q + ["--out", never] + extra
                                                     if rank == bad_rank else good)
                        if rank < p - 1:
                            cmd.append(":")
                    start = time.monotonic()
                    try:
                        r = run(cmd, env)
                        seconds = time.monotonic() - start
                    except subprocess.TimeoutExpired:
                        check(False, "np %d, rank %d fails (%s): hang" % (p, bad_rank, phrase))
                        return
                    lines = error_lines(r)
                    check(r.returncode == 2 and len(lines) == 1 and phrase in lines[0] and seconds < 60 and
                          not os.path.exists(never),
                          "np %d, rank %d fails before the first exchange (%s): exit %d in %.1f s, %s" %
                          (p, bad_rank, phrase, r.returncode, seconds, lines))

    def run_job(fn):
        results = []
        fn(lambda ok, what: results.append((ok, what)))
        return results

    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        for results in pool.map(run_job, jobs):  # reported in order, as they finish
            for ok, what in results:
                report(ok, what)
    if failures:
        print("%d failure(s)" % len(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
