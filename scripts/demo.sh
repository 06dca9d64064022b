#!/usr/bin/env bash
# Builds randattn and runs the quickstart example on its built-in data.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

randattn_require_packages
randattn_configure_and_build
"$RANDATTN_BUILD_DIR/examples/quickstart"
