#!/usr/bin/env bash
# The benchmarks built at -O2 and at -O3 and run alternately, one table row per benchmark row:
#
#   | row | -O2 | -O3 | -O2 ÷ -O3 |
#
# with the best (lowest) real time of --reps runs at each level; the runs alternate between the
# two builds (-O2, -O3, -O2, ...) so that a slow spell of a shared machine hits both. Header-only
# code is compiled with its users' flags: Debian builds at -O2, and the speed there is what most
# users get.
#
# Usage: scripts/bench_opt_levels.sh [--compiler g++|clang++] [--arch native|x86-64-v3|x86-64]
#            [--filter REGEX] [--reps N] [--min-time SECONDS] [--cpu N] [BENCH ...]
# BENCH: benchmark executables (default: bench_core bench_features bench_lsh bench_lsf bench_decode).
# --cpu N runs every benchmark on logical CPU N (taskset), so that both levels are measured on
# the same CPU (on a shared virtual machine the CPUs' speeds need not agree).
# Build directories: $RANDATTN_BENCH_DIR (default build-opt-levels/ in the repository), one per
# compiler, architecture and level; rebuilt incrementally.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

compiler=g++ arch=native filter=. reps=3 min_time=0.5 cpu= benches=()
while [ $# -gt 0 ]; do
    case "$1" in
        --compiler) compiler="$2"; shift 2 ;;
        --arch) arch="$2"; shift 2 ;;
        --filter) filter="$2"; shift 2 ;;
        --reps) reps="$2"; shift 2 ;;
        --min-time) min_time="$2"; shift 2 ;;
        --cpu) cpu="$2"; shift 2 ;;
        -h|--help) sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) randattn_log "unknown option $1 (see --help)"; exit 2 ;;
        *) benches+=("$1"); shift ;;
    esac
done
[ "${#benches[@]}" -gt 0 ] || benches=(bench_core bench_features bench_lsh bench_lsf bench_decode)
if ! [[ "$reps" =~ ^[1-9][0-9]*$ ]]; then randattn_log "--reps must be a positive integer, got $reps"; exit 2; fi

RANDATTN_PACKAGES+=(libbenchmark-dev python3)
case "$compiler" in clang++*) RANDATTN_PACKAGES+=(clang libomp-14-dev) ;; esac
randattn_require_packages
command -v "$compiler" >/dev/null || { randattn_log "compiler $compiler not found"; exit 2; }

root_dir="${RANDATTN_BENCH_DIR:-$RANDATTN_ROOT/build-opt-levels}"
out_dir="$(mktemp -d)"
trap 'rm -rf "$out_dir"' EXIT
for level in O2 O3; do
    RANDATTN_BUILD_DIR="$root_dir/$(basename "$compiler")-$arch-$level"
    randattn_use_ccache
    randattn_generator "$RANDATTN_BUILD_DIR"
    cmake -S "$RANDATTN_ROOT" -B "$RANDATTN_BUILD_DIR" "${RANDATTN_GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
        "${RANDATTN_LAUNCHER[@]}" -DCMAKE_CXX_COMPILER="$compiler" -DRANDATTN_DEV_OPTIMIZATION=-$level \
        -DRANDATTN_DEV_ARCH="$arch" -DRANDATTN_BUILD_BENCHMARKS=ON -DRANDATTN_BUILD_TESTS=OFF \
        -DRANDATTN_BUILD_EXAMPLES=OFF -DRANDATTN_BUILD_TOOLS=OFF -DRANDATTN_PYTHON=OFF -DRANDATTN_MPI=OFF >/dev/null
    cmake --build "$RANDATTN_BUILD_DIR" -j"$(nproc)" --target "${benches[@]}" >&2
done

pin=()
[ -z "$cpu" ] || pin=(taskset -c "$cpu")
for rep in $(seq "$reps"); do
    for bench in "${benches[@]}"; do
        for level in O2 O3; do
            randattn_log "run $rep/$reps: $bench -$level"
            "${pin[@]}" "$root_dir/$(basename "$compiler")-$arch-$level/bench/$bench" --benchmark_filter="$filter" \
                --benchmark_min_time="$min_time" --benchmark_format=json \
                --benchmark_out="$out_dir/$bench.$level.$rep.json" >/dev/null
        done
    done
done

python3 - "$out_dir" "$compiler" "$arch" <<'PY'
import json, pathlib, sys
out, compiler, arch = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
best, order = {}, []
unit_ns = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}
for path in sorted(out.glob("*.json")):
    bench, level, _ = path.name.rsplit(".", 3)[:3]
    for row in json.loads(path.read_text())["benchmarks"]:
        if row.get("run_type") == "aggregate" or "error_message" in row:
            continue
        key = (bench, row["name"])
        if key not in order:
            order.append(key)
        ns = row["real_time"] * unit_ns[row.get("time_unit", "ns")]
        best[key, level] = min(best.get((key, level), float("inf")), ns)
def show(ns):
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if ns >= scale:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns:.3g} ns"
print(f"{compiler}, -march={arch}; best of the runs at each level")
print("| row | -O2 | -O3 | -O2 ÷ -O3 |")
print("|---|---|---|---|")
for key in order:
    o2, o3 = best.get((key, "O2")), best.get((key, "O3"))
    if o2 is None or o3 is None:
        continue
    print(f"| `{key[0]}` {key[1]} | {show(o2)} | {show(o3)} | {o2 / o3:.2f} |")
PY
