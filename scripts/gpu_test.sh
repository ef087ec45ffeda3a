#!/usr/bin/env bash
# Runs every test executable of a build folder directly (CTest files hold the absolute paths of the
# machine that configured them, so a build carried to a GPU machine is run through this script).
# Usage: scripts/gpu_test.sh [build-dir] ; prints one summary line at the end.
# NIBBLE_GPU_ONLY=1 runs only the test_*_gpu executables (the CPU ones are what CI runs).
set -uo pipefail
build=${1:-build}
# The CLI tests look next to themselves and one folder up as well; naming the binary makes it explicit.
NIBBLE_BIN="$(cd "$build" && pwd)/nibble"
export NIBBLE_BIN
pass=0; fail=0; failed=()
for t in "$build"/tests/test_*; do
  [ -x "$t" ] || continue
  [ "${NIBBLE_GPU_ONLY:-0}" = 1 ] && [[ "$t" != *_gpu ]] && continue
  echo "=== $(basename "$t")"
  if "$t" --gtest_brief=1; then pass=$((pass + 1)); else fail=$((fail + 1)); failed+=("$(basename "$t")"); fi
done
echo "gpu_test summary: $pass test executables passed, $fail failed ${failed[*]:-}"
[ "$fail" -eq 0 ]
