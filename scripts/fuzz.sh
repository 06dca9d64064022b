#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang (ASan + UBSan) and runs each (one per core
# bounded time (first argument, seconds; default 60), starting from the checked-in corpus
# tests/fuzz/corpus/<target>. New inputs go to a scratch copy: the checked-in corpus only
# changes when you merge into it on purpose (<target> -merge=1 tests/fuzz/corpus/<target> DIR).
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

seconds=${1:-60}
RANDATTN_PACKAGES+=(clang libclang-rt-14-dev libomp-14-dev ccache)
randattn_require_packages
randattn_use_ccache

# ASan + UBSan at -O1 with line tables (RANDATTN_SANITIZE), as the sanitizer runs: a fraction
# of the compile time of -O3 with full debug information, for a modest loss of executions.
# RANDATTN_FUZZ_BUILD_DIR names a build that already has the targets (scripts/sanitize.sh's
# build-asan, with the same build type and sanitizers); otherwise build-fuzz holds them alone.
if [ -n "${RANDATTN_FUZZ_BUILD_DIR:-}" ]; then
    build=$RANDATTN_FUZZ_BUILD_DIR
    if ! grep -qs '^RANDATTN_BUILD_FUZZERS:BOOL=ON$' "$build/CMakeCache.txt"; then
        randattn_log "RANDATTN_FUZZ_BUILD_DIR=$build is not a build configured with RANDATTN_BUILD_FUZZERS=ON"
        exit 1
    fi
    build=$(cd "$build" && pwd)  # the targets run from a scratch directory
else
    build="$RANDATTN_ROOT/build-fuzz"
    randattn_generator "$build"
    cmake -S "$RANDATTN_ROOT" -B "$build" "${RANDATTN_GENERATOR[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
        "${RANDATTN_LAUNCHER[@]}" -DRANDATTN_SANITIZE=address,undefined \
        -DRANDATTN_BUILD_FUZZERS=ON -DRANDATTN_BUILD_TESTS=OFF -DRANDATTN_BUILD_BENCHMARKS=OFF \
        -DRANDATTN_BUILD_EXAMPLES=OFF -DRANDATTN_BUILD_TOOLS=OFF -DRANDATTN_INSTALL=OFF \
        -DRANDATTN_PYTHON=OFF -DRANDATTN_MPI=OFF
fi
cmake --build "$build" -j"$(nproc)" --target randattn_fuzzers

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

# Runs one target (single-threaded) and prints its statistics; on a failure, the end of its log.
fuzz_one() {  # <target>
    local target=$1 corpus="$RANDATTN_ROOT/tests/fuzz/corpus/$1" log="$scratch/$1.log" status=0
    mkdir -p "$scratch/$target" "$corpus"
    (cd "$scratch" && OMP_NUM_THREADS=1 "$build/tests/fuzz/$target" -max_total_time="$seconds" \
        -rss_limit_mb=4096 -print_final_stats=1 "$scratch/$target" "$corpus" >"$log" 2>&1) || status=$?
    if [ "$status" -ne 0 ]; then
        tail -n 60 "$log" >&2
        randattn_log "$target failed (exit $status); the failing input is printed above (Base64)"
        return 1
    fi
    randattn_log "$target: $(grep -E '^stat::(number_of_executed_units|peak_rss_mb)' "$log" | tr '\n' ' ')"
}

# One target per core at a time, in batches.
targets=()
for source in "$RANDATTN_ROOT"/tests/fuzz/fuzz_*.cpp; do targets+=("$(basename "$source" .cpp)"); done
per_batch=$(nproc)
failed=0
for ((first = 0; first < ${#targets[@]}; first += per_batch)); do
    batch=("${targets[@]:first:per_batch}")
    randattn_log "fuzzing ${batch[*]} for ${seconds} s"
    pids=()
    for target in "${batch[@]}"; do
        fuzz_one "$target" &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    [ "$failed" -eq 0 ] || exit 1
done
