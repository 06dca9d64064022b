#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang (ASan + UBSan) and runs each for a
# bounded time (first argument, seconds; default 60), starting from the checked-in corpus
# tests/fuzz/corpus/<target>. New inputs go to a scratch copy: the checked-in corpus only
# changes when you merge into it on purpose (<target> -merge=1 tests/fuzz/corpus/<target> DIR).
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

seconds=${1:-60}
RANDATTN_PACKAGES+=(clang libclang-rt-14-dev libomp-14-dev ccache)
randattn_require_packages
randattn_use_ccache

build="$RANDATTN_ROOT/build-fuzz"
# ASan + UBSan at -O1 with line tables (RANDATTN_SANITIZE), as the sanitizer runs: a fraction
# of the compile time of -O3 with full debug information, for a modest loss of executions.
cmake -S "$RANDATTN_ROOT" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=clang++ \
    "${RANDATTN_LAUNCHER[@]}" -DRANDATTN_SANITIZE=address,undefined \
    -DRANDATTN_BUILD_FUZZERS=ON -DRANDATTN_BUILD_TESTS=OFF -DRANDATTN_BUILD_BENCHMARKS=OFF \
    -DRANDATTN_BUILD_EXAMPLES=OFF -DRANDATTN_BUILD_TOOLS=OFF -DRANDATTN_INSTALL=OFF \
    -DRANDATTN_PYTHON=OFF -DRANDATTN_MPI=OFF
cmake --build "$build" -j"$(nproc)"

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for source in "$RANDATTN_ROOT"/tests/fuzz/fuzz_*.cpp; do
    target=$(basename "$source" .cpp)
    corpus="$RANDATTN_ROOT/tests/fuzz/corpus/$target"
    mkdir -p "$scratch/$target" "$corpus"
    randattn_log "fuzzing $target for ${seconds} s"
    log="$scratch/$target.log"
    status=0
    (cd "$scratch" && OMP_NUM_THREADS=1 "$build/tests/fuzz/$target" -max_total_time="$seconds" \
        -rss_limit_mb=4096 -print_final_stats=1 "$scratch/$target" "$corpus" >"$log" 2>&1) || status=$?
    if [ "$status" -ne 0 ]; then
        tail -n 60 "$log" >&2
        randattn_log "$target failed (exit $status); the failing input is printed above (Base64)"
        exit 1
    fi
    grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb|Done)' "$log" || true
done
