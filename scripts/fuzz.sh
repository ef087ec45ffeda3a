#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan + UBSan: the `asan` preset's build, which CI's sanitized tests
# share; the `fuzz` build preset builds only these) and runs each for a fixed time on a copy of its seed
# corpus (tests/fuzz/corpus/<name>), one summary line per target.
# Usage: bash scripts/fuzz.sh [seconds per target, default 60] [jobs in parallel, default nproc]
# NIBBLE_FUZZ_RUNS=N runs N inputs per target instead, and NIBBLE_FUZZ_SEED=S fixes libFuzzer's seed:
# together they make a run repeatable (CI uses both).
# Findings (crash-*, leak-*, timeout-* inputs) are kept in build-asan/fuzz/findings/<name>/ and fail the run.
set -uo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
jobs=${2:-$(nproc)}
bash scripts/setup.sh --fuzz
cmake --preset asan >/dev/null && cmake --build --preset fuzz -j "$(nproc)" >/dev/null || { echo "fuzz: build failed"; exit 1; }
run_one() {
  local t=$1 secs=$2 name=${1#fuzz_}
  local work=build-asan/fuzz/corpus/$name findings=build-asan/fuzz/findings/$name log=build-asan/fuzz/logs/$name.log
  rm -rf "$findings"  # this run's findings only (an earlier run's were reported then)
  mkdir -p "$work" "$findings" build-asan/fuzz/logs
  cp -n tests/fuzz/corpus/"$name"/* "$work"/ 2>/dev/null
  local limit="-max_total_time=$secs"
  [ -n "${NIBBLE_FUZZ_RUNS:-}" ] && limit="-runs=$NIBBLE_FUZZ_RUNS"
  ASAN_OPTIONS=detect_leaks=1 build-asan/tests/"$t" "$work" $limit ${NIBBLE_FUZZ_SEED:+-seed=$NIBBLE_FUZZ_SEED} \
    -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$findings"/ > "$log" 2>&1
  local rc=$?
  local execs; execs=$(grep -oE "stat::number_of_executed_units: *[0-9]+" "$log" | grep -oE "[0-9]+$")
  local found; found=$(ls "$findings" | wc -l)
  local budget="$secs s"; [ -n "${NIBBLE_FUZZ_RUNS:-}" ] && budget="at most $NIBBLE_FUZZ_RUNS runs"
  echo "fuzz $name: ${execs:-0} executions ($budget), corpus $(ls "$work" | wc -l) inputs, findings $found, rc $rc"
}
export -f run_one
mkdir -p build-asan/fuzz
targets=$(ls build-asan/tests/ | grep -E "^fuzz_[a-z_]+$" | sort)
[ -n "$targets" ] || { echo "fuzz: no targets were built"; exit 1; }
printf '%s\n' $targets | xargs -P "$jobs" -I{} bash -c "run_one {} $secs" | sort | tee build-asan/fuzz/summary.txt
total=$(grep -oE "[0-9]+ executions" build-asan/fuzz/summary.txt | awk '{s += $1} END {print s + 0}')
echo "fuzz summary: $(wc -l < build-asan/fuzz/summary.txt) targets, $total executions, $(grep -vc "findings 0, rc 0" build-asan/fuzz/summary.txt) with findings"
! grep -qv "findings 0, rc 0" build-asan/fuzz/summary.txt
