#!/usr/bin/env bash
# Builds the test suite with clang under AddressSanitizer + UndefinedBehaviorSanitizer and runs
# it (halting on the first report; the [statistical] cases, which repeat the same calls to average
# an estimate, run only in the plain build: see tests/CMakeLists.txt), then under ThreadSanitizer
# and runs the tests tagged [threads]. The AddressSanitizer build also checks that the benchmarks and examples compile
# (scripts/syntax_check.py: parsed and instantiated, no code generated; they are not run here).
# OpenMP comes from LLVM's libomp with its Archer tool, which tells ThreadSanitizer
# about OpenMP's own synchronisation.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

RANDATTN_PACKAGES+=(catch2 libbenchmark-dev clang libclang-rt-14-dev libomp-14-dev ccache)
randattn_require_packages
randattn_use_ccache

archer=/usr/lib/llvm-14/lib/libarcher.so
sanitized_build() {  # <dir> <sanitizers> <targets> [cmake arguments...]
    local dir=$1 sanitizers=$2 targets=$3
    shift 3
    randattn_generator "$dir"
    cmake -S "$RANDATTN_ROOT" -B "$dir" "${RANDATTN_GENERATOR[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo "${RANDATTN_LAUNCHER[@]}" \
        -DCMAKE_CXX_COMPILER=clang++ -DRANDATTN_SANITIZE="$sanitizers" \
        -DRANDATTN_INSTALL=OFF -DRANDATTN_MPI=OFF -DRANDATTN_TESTS_UNITY=ON "$@"
    # shellcheck disable=SC2086  # several targets
    cmake --build "$dir" -j"$(nproc)" --target $targets
}

randattn_log "AddressSanitizer + UndefinedBehaviorSanitizer: whole test suite"
sanitized_build "$RANDATTN_ROOT/build-asan" address,undefined randattn_test_programs -DRANDATTN_TESTS_UNITY_BATCHES=1 \
    -DRANDATTN_BUILD_BENCHMARKS=ON -DRANDATTN_BUILD_EXAMPLES=ON -DCMAKE_EXPORT_COMPILE_COMMANDS=ON
randattn_log "compile check of the benchmarks and examples"
python3 "$RANDATTN_ROOT/scripts/syntax_check.py" "$RANDATTN_ROOT/build-asan" "$RANDATTN_ROOT/bench" "$RANDATTN_ROOT/examples"
ASAN_OPTIONS=halt_on_error=1:detect_leaks=1:abort_on_error=1 \
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    ctest --test-dir "$RANDATTN_ROOT/build-asan" --output-on-failure --label-exclude 'packaging|mpi' -j"$(nproc)"

# The test files whose [threads] cases run code with synchronisation of its own or objects shared
# between threads: test_threads.cpp (the linear core's split scan, shared maps and hashes, LSH's
# per-thread tables, the batched feature paths), concurrent KvCache::attend and the layouts'
# parallel slices, which share their jobs. The other families' [threads] cases check thread-count
# independence of the same parallel_for over disjoint rows, which the plain build's run already
# covers; compiling them once more under TSan would cost minutes of CI for no new code.
threaded="threads;kv_cache;layout"
randattn_log "ThreadSanitizer: multi-threaded tests (test files: $threaded)"
sanitized_build "$RANDATTN_ROOT/build-tsan" thread randattn_tests \
    -DRANDATTN_BUILD_BENCHMARKS=OFF -DRANDATTN_BUILD_TOOLS=OFF -DRANDATTN_BUILD_EXAMPLES=OFF -DRANDATTN_TEST_FILES="$threaded"
TSAN_OPTIONS="halt_on_error=1 suppressions=$RANDATTN_ROOT/tests/tsan.supp" \
OMP_TOOL_LIBRARIES="$archer" OMP_NUM_THREADS=2 \
    "$RANDATTN_ROOT/build-tsan/tests/randattn_tests" "[threads]"
