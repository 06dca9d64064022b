#!/usr/bin/env bash
# Builds the test suite with clang under AddressSanitizer + UndefinedBehaviorSanitizer and runs
# it (halting on the first report; the [statistical] cases, which repeat the same calls to average
# an estimate, run only in the plain build, and the templated cases in float only: see
# tests/CMakeLists.txt and tests/scalars.hpp; finite differences compare a sample of entries:
# tests/gradient_check.hpp), then under ThreadSanitizer and runs the tests tagged [threads] (that
# build runs at low priority beside the first one). The AddressSanitizer build also builds the libFuzzer
# targets beside the suite's one long translation unit, where a core would otherwise idle for
# minutes (run them with RANDATTN_FUZZ_BUILD_DIR=build-asan scripts/fuzz.sh), and checks that the
# benchmarks and examples compile (scripts/syntax_check.py: parsed and instantiated, no code
# generated; they are not run here).
# OpenMP comes from LLVM's libomp with its Archer tool, which tells ThreadSanitizer
# about OpenMP's own synchronisation.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

RANDATTN_PACKAGES+=(catch2 libbenchmark-dev clang libclang-rt-14-dev libomp-14-dev ccache)
randattn_require_packages
randattn_use_ccache

archer=/usr/lib/llvm-14/lib/libarcher.so
sanitized_configure() {  # <dir> <sanitizers> [cmake arguments...]
    local dir=$1 sanitizers=$2
    shift 2
    randattn_generator "$dir"
    cmake -S "$RANDATTN_ROOT" -B "$dir" "${RANDATTN_GENERATOR[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo "${RANDATTN_LAUNCHER[@]}" \
        -DCMAKE_CXX_COMPILER=clang++ -DRANDATTN_SANITIZE="$sanitizers" \
        -DRANDATTN_INSTALL=OFF -DRANDATTN_MPI=OFF -DRANDATTN_TESTS_UNITY=ON "$@"
}

asan="$RANDATTN_ROOT/build-asan"
tsan="$RANDATTN_ROOT/build-tsan"
randattn_log "AddressSanitizer + UndefinedBehaviorSanitizer: whole test suite, fuzz targets, compile check of the benchmarks and examples"
sanitized_configure "$asan" address,undefined -DRANDATTN_BUILD_FUZZERS=ON \
    -DRANDATTN_BUILD_BENCHMARKS=ON -DRANDATTN_BUILD_EXAMPLES=ON -DCMAKE_EXPORT_COMPILE_COMMANDS=ON

# The [threads] cases that run code with synchronisation of its own or objects shared between
# threads live in test_threads.cpp (the linear core's split scan, shared maps and hashes, LSH's
# per-thread tables, the batched feature paths, concurrent KvCache::attend, the layouts' parallel
# sub-calls, which share their jobs). The other families' [threads] cases check thread-count
# independence of the same parallel_for over disjoint rows, which the plain build's run already
# covers; compiling their files once more under TSan would cost minutes of CI for no new code.
# For the same reason the build links only the registered methods that the [threads] cases call
# (tests/method_subset.cpp), not the whole method table.
threaded="threads"
randattn_log "ThreadSanitizer: multi-threaded tests (test files: $threaded), built beside the first build"
sanitized_configure "$tsan" thread \
    -DRANDATTN_BUILD_BENCHMARKS=OFF -DRANDATTN_BUILD_TOOLS=OFF -DRANDATTN_BUILD_EXAMPLES=OFF -DRANDATTN_TEST_FILES="$threaded" \
    -DRANDATTN_TESTS_SUBSET_TABLE=ON

# The ThreadSanitizer build and the compile check of the benchmarks and examples run at the
# lowest priority beside the AddressSanitizer build and its tests: they take the cores those leave
# idle (the end of the build waits on one long translation unit, and the last tests run alone).
background_log="$tsan/background.log"
(
    nice -n 19 cmake --build "$tsan" -j"$(nproc)" --target randattn_tests
    nice -n 19 python3 "$RANDATTN_ROOT/scripts/syntax_check.py" "$asan" "$RANDATTN_ROOT/bench" "$RANDATTN_ROOT/examples"
) >"$background_log" 2>&1 &
background=$!
trap 'kill "$background" 2>/dev/null || true' EXIT

cmake --build "$asan" -j"$(nproc)" --target randattn_test_programs randattn_fuzzers
ASAN_OPTIONS=halt_on_error=1:detect_leaks=1:abort_on_error=1 \
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    ctest --test-dir "$asan" --output-on-failure --label-exclude 'packaging|mpi' -j"$(nproc)"

randattn_log "ThreadSanitizer build and compile check (run beside the above)"
if ! wait "$background"; then
    cat "$background_log"
    randattn_log "the ThreadSanitizer build or the compile check failed"
    exit 1
fi
trap - EXIT
grep '^syntax_check:' "$background_log"
TSAN_OPTIONS="halt_on_error=1 suppressions=$RANDATTN_ROOT/tests/tsan.supp" \
OMP_TOOL_LIBRARIES="$archer" OMP_NUM_THREADS=2 \
    "$tsan/tests/randattn_tests" "[threads]"
