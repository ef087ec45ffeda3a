#!/usr/bin/env bash
# compute-sanitizer over nibble's CUDA code, on a GPU machine (docs/HARDENING.md):
#   memcheck  on every GPU test executable (test_*_gpu) and on short training runs of every recipe,
#             with recompute none and full (mock data, the `tiny` model, an evaluation included);
#   racecheck on the test executables whose kernels use shared memory (ops, formats, nvfp4).
# Usage: bash scripts/gpu_sanitize.sh [build-dir] [log-dir] [parts: tests,train,race] [jobs]
# One summary line per run ("sanitize <tool> <name>: N errors" or the reason it did not finish), then a
# total; the exit status is non-zero if any run reported an error, failed or timed out.
# NIBBLE_SANITIZE_TIMEOUT (seconds per run, default 540) bounds each run.
set -uo pipefail
build=$(cd "${1:-build}" && pwd)
logs=${2:-runs/sanitize}
parts=${3:-tests,train,race}
jobs=${4:-4}
mkdir -p "$logs"
logs=$(cd "$logs" && pwd)
export NIBBLE_BIN="$build/nibble" NIBBLE_SANITIZE_TIMEOUT=${NIBBLE_SANITIZE_TIMEOUT:-540}
command -v compute-sanitizer >/dev/null || { echo "gpu_sanitize: compute-sanitizer is not on PATH (it ships with the CUDA toolkit)"; exit 1; }

# One run: tool, name, then the command. Its log is $logs/<tool>-<name>.log; prints one summary line.
sanitize_one() {
  local tool=$1 name=$2; shift 2
  local log="$logs/$tool-$name.log" work; work=$(mktemp -d)
  (cd "$work" && timeout "$NIBBLE_SANITIZE_TIMEOUT" compute-sanitizer --tool "$tool" --error-exitcode 99 \
     --target-processes all --print-limit 50 "$@" > "$log" 2>&1)
  local rc=$? summary
  rm -rf "$work"
  summary=$(grep -oE "ERROR SUMMARY: [0-9]+ error[s]?|RACECHECK SUMMARY: [0-9]+ hazard[s]? displayed \([0-9]+ error[s]?, [0-9]+ warning[s]?\)" "$log" | tail -1)
  case $rc in
    0) echo "sanitize $tool $name: ${summary:-no summary}" ;;
    99) echo "sanitize $tool $name: ERRORS FOUND: ${summary:-see log} (rc 99)" ;;
    124) echo "sanitize $tool $name: TIMED OUT after ${NIBBLE_SANITIZE_TIMEOUT} s (${summary:-no summary})" ;;
    *) echo "sanitize $tool $name: FAILED rc $rc (${summary:-no summary}); see $log" ;;
  esac
}
export -f sanitize_one
export logs

has() { [[ ",$parts," == *",$1,"* ]]; }
runs=()  # each entry: "tool name command..."
if has tests; then
  for t in "$build"/tests/test_*_gpu; do
    [ -x "$t" ] && runs+=("memcheck $(basename "$t") $t --gtest_brief=1")
  done
fi
if has train; then
  for recipe in $("$NIBBLE_BIN" train --help 2>/dev/null | grep -oE "bf16(_with_[a-z0-9_]+)?_mixed" | sort -u); do
    for recompute in none full; do
      runs+=("memcheck train-$recipe-$recompute $NIBBLE_BIN train --model tiny --mock-data --recipe $recipe \
--device cuda --recompute $recompute --train-iters 3 --micro-batch-size 2 --global-batch-size 4 --seq-length 128 \
--eval-interval 3 --eval-iters 1 --log-interval 1 --num-layers-at-end-in-bf16 0 --num-layers-at-start-in-bf16 0")
    done
  done
fi
if has race; then
  for t in ops formats nvfp4; do
    # Small and edge-tile shapes only: racecheck serializes every shared-memory access, so the
    # 8192x8192 cases (timing reports and realistic shapes) would take hours and add no new code path.
    [ -x "$build/tests/test_${t}_gpu" ] &&
      runs+=("racecheck test_${t}_gpu $build/tests/test_${t}_gpu --gtest_brief=1 --gtest_filter=-*Bench*:*Realistic*")
  done
fi
[ ${#runs[@]} -gt 0 ] || { echo "gpu_sanitize: nothing to run (parts '$parts', build $build)"; exit 1; }
printf '%s\n' "${runs[@]}" | xargs -P "$jobs" -L 1 bash -c 'sanitize_one "$@"' _ | sort | tee "$logs/summary.txt"
bad=$(grep -vcE ": (ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards displayed \(0 errors, 0 warnings\))$" "$logs/summary.txt")
echo "gpu_sanitize summary: $(wc -l < "$logs/summary.txt") runs, $bad with errors, failures or time-outs"
[ "$bad" -eq 0 ]
