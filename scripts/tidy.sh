#!/usr/bin/env bash
# clang-tidy-14 (.clang-tidy) over every C++ source of src/ as the CPU backend compiles it; exits non-zero
# on any warning. CUDA sources (*.cu) and CUDA-only branches are not covered: clang-tidy would need
# clang's CUDA front end, which Debian's clang-14 does not pair with CUDA 13.
# Usage: bash scripts/tidy.sh [jobs]
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${1:-$(nproc)}
command -v run-clang-tidy-14 >/dev/null || { echo "tidy: clang-tidy-14 is missing; run: bash scripts/setup.sh --lint"; exit 1; }
# The compile database, one entry per source file (a unity build would name only its batches); only the generated
# protobuf sources are built.
cmake --preset cpu -DNIBBLE_UNITY_BUILD=OFF >/dev/null
cmake --build --preset cpu --target nibble_proto >/dev/null
log=build-cpu/tidy.log
run-clang-tidy-14 -p build-cpu -quiet -j "$jobs" "$PWD/src/" 2>&1 | sed 's/\x1b\[[0-9;]*m//g' > "$log" || true
n=$(grep -c "warning:" "$log" || true)
grep -E "(warning|error):" "$log" | sed "s|$PWD/||" | sort -u || true
files=$(grep -c "^clang-tidy" "$log" || true)
echo "tidy: $files files checked, $n warnings"
[ "$n" -eq 0 ] && ! grep -q "error:" "$log"
