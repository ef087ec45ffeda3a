#!/usr/bin/env bash
# Formats every C++/CUDA source of the project with .clang-format (clang-format-14, pinned: another
# version may lay the same code out differently). Usage: bash scripts/format.sh [--check]
# --check changes nothing and exits non-zero, naming the files, if any file differs from the format.
set -euo pipefail
cd "$(dirname "$0")/.."
cf=$(command -v clang-format-14 || true)
[ -n "$cf" ] || { echo "format: clang-format-14 is missing; run: bash scripts/setup.sh --lint"; exit 1; }
mapfile -t files < <(git ls-files 'src/*.cpp' 'src/*.h' 'src/*.cu' 'src/*.cuh' 'tests/*.cpp' 'tests/*.h' 'tests/*.cu')
if [ "${1:-}" = "--check" ]; then
  # --dry-run names each place that would change ("FILE:LINE:COL: warning: code should be clang-formatted")
  # and fails only when clang-format itself does. 50 files per process, nproc processes at a time: one
  # process per file made this check take over a minute of CI, mostly in process start-up.
  out=$(printf '%s\0' "${files[@]}" | xargs -0 -n 50 -P "$(nproc)" "$cf" --style=file --dry-run 2>&1) ||
    { printf '%s\n' "$out"; echo "format: clang-format failed"; exit 1; }
  mapfile -t bad < <(sed -n 's/:[0-9]*:[0-9]*: warning: code should be clang-formatted.*//p' <<< "$out" | sort -u)
  if [ ${#bad[@]} -gt 0 ]; then
    printf 'format: %s differs from .clang-format\n' "${bad[@]}"
    echo "format: ${#bad[@]} of ${#files[@]} files need formatting; run: bash scripts/format.sh"
    exit 1
  fi
  echo "format: ${#files[@]} files match .clang-format"
else
  "$cf" --style=file -i "${files[@]}"
  echo "format: ${#files[@]} files formatted"
fi
