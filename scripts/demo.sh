#!/usr/bin/env bash
# Builds only the quickstart example (no tests, benchmarks or other examples) and runs it on its
# built-in data.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

randattn_require_packages
randattn_generator "$RANDATTN_BUILD_DIR"
cmake -S "$RANDATTN_ROOT" -B "$RANDATTN_BUILD_DIR" "${RANDATTN_GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DRANDATTN_DEV_OPTIMIZATION=-O3 -DRANDATTN_BUILD_TESTS=OFF -DRANDATTN_BUILD_BENCHMARKS=OFF -DRANDATTN_BUILD_EXAMPLES=ON
cmake --build "$RANDATTN_BUILD_DIR" -j"$(nproc)" --target quickstart
"$RANDATTN_BUILD_DIR/examples/quickstart"
