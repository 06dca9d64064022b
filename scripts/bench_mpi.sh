#!/usr/bin/env bash
# Distributed attention at P = 1 and 2 ranks: wall time and bytes sent per rank of randattn-mpi
# (its --report line) for n = 16384 and 65536 tokens, d = dv = 32, float32, bidirectional and
# causal. Prints one table row per run. Needs a build with -DRANDATTN_MPI=ON (randattn-mpi).
#   scripts/bench_mpi.sh [build-dir]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
exe="$build/examples/randattn-mpi"
[ -x "$exe" ] || { echo "bench_mpi: $exe not found (configure with -DRANDATTN_MPI=ON)" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1

# Gaussian float32 inputs without NumPy.
make_input() {  # <path> <rows> <cols> <seed>
  python3 - "$@" <<'PY'
import random, struct, sys
path, rows, cols, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
header = "{'descr': '<f4', 'fortran_order': False, 'shape': (%d, %d), }" % (rows, cols)
header += " " * ((64 - (10 + len(header) + 1) % 64) % 64) + "\n"
with open(path, "wb") as f:
    f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
    for _ in range(rows):
        f.write(struct.pack("<%df" % cols, *[rng.gauss(0, 0.5) for _ in range(cols)]))
PY
}

printf '%-8s %-7s %6s %2s %9s  %s\n' method mask n P seconds "bytes sent per rank"
for n in 16384 65536; do
  make_input "$work/q.npy" "$n" 32 1
  make_input "$work/k.npy" "$n" 32 2
  make_input "$work/v.npy" "$n" 32 3
  for p in 1 2; do
    for causal in "" --causal; do
      for method in exact favor lsh; do
        args=(--method "$method" --q "$work/q.npy" --v "$work/v.npy")
        [ "$method" = lsh ] || args+=(--k "$work/k.npy")
        [ "$method" = favor ] && args+=(--features 256)
        [ "$method" = exact ] && [ -n "$causal" ] && args+=(--layout zigzag)
        line="$(mpiexec -n "$p" --oversubscribe "$exe" attention "${args[@]}" $causal --out "$work/o.npy" --report)"
        python3 - "$line" "$method" "${causal:-none}" "$n" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
mask = "causal" if sys.argv[3] == "--causal" else "bidir"
print("%-8s %-7s %6s %2d %9.3f  %s" % (sys.argv[2], mask, sys.argv[4], r["ranks"], r["seconds"],
                                       " ".join(str(b) for b in r["bytes_sent"])))
PY
      done
    done
  done
done
