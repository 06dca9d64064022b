#!/usr/bin/env bash
# Builds randattn and runs the whole test suite, the Python tests included. Extra arguments are
# passed to ctest.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

RANDATTN_PACKAGES+=(catch2 libbenchmark-dev ccache)
# MPI is required here so that CI always tests the distributed layer (label "mpi").
RANDATTN_PACKAGES+=(openmpi-bin libopenmpi-dev)
# The Python module and its tests: Debian's interpreter and packages (no PyPI).
RANDATTN_PACKAGES+=(python3-dev python3-numpy python3-pytest pybind11-dev python3-pybind11 python3-setuptools
                    python3-wheel python3-torch python3-venv python3-pip python3-scipy)
randattn_require_packages
# The suite compiles as one unity batch (RANDATTN_TESTS_UNITY), cheaper from scratch than one
# translation unit per test file. The benchmarks and examples are not tests: scripts/sanitize.sh
# checks that they compile. The programs compile at -O2 (see RANDATTN_DEV_OPTIMIZATION in
# CMakeLists.txt), the level Debian builds its packages at.
randattn_configure_and_build -DRANDATTN_DEV_OPTIMIZATION=-O2 -DRANDATTN_BUILD_TESTS=ON -DRANDATTN_TESTS_UNITY=ON -DRANDATTN_BUILD_BENCHMARKS=OFF -DRANDATTN_BUILD_EXAMPLES=OFF \
    -DRANDATTN_PYTHON=ON -DPython_EXECUTABLE="${RANDATTN_PYTHON_EXECUTABLE:-/usr/bin/python3}" -DRANDATTN_MPI=ON
ctest --test-dir "$RANDATTN_BUILD_DIR" --output-on-failure -j"$(nproc)" "$@"
