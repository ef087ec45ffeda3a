#!/usr/bin/env bash
# Builds nibble and runs every test (CPU tests; GPU tests run too and skip visibly without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake --preset default >/dev/null
cmake --build --preset default -j "$(nproc)"
ctest --preset default -j "$(nproc)" "$@"
