#!/usr/bin/env bash
# Builds randattn and runs the whole test suite. Extra arguments are passed to ctest.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

# MPI is required here so that CI always tests the distributed layer (label "mpi").
RANDATTN_PACKAGES+=(catch2 libbenchmark-dev openmpi-bin libopenmpi-dev python3)
randattn_require_packages
randattn_configure_and_build -DRANDATTN_BUILD_TESTS=ON -DRANDATTN_BUILD_BENCHMARKS=ON -DRANDATTN_BUILD_EXAMPLES=ON \
    -DRANDATTN_MPI=ON
ctest --test-dir "$RANDATTN_BUILD_DIR" --output-on-failure "$@"
