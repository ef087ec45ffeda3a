#!/usr/bin/env bash
# Builds nibble and runs every test (CPU tests; GPU tests run too and skip visibly without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Real tokenizer files and corpus for the data tests; they skip visibly if this cannot fetch them.
bash scripts/setup_data.sh || echo "test.sh: warning: scripts/setup_data.sh failed; tokenizer-data tests will skip"
cmake --preset default >/dev/null
cmake --build --preset default -j "$(nproc)"
ctest --preset default -j "$(nproc)" "$@"
