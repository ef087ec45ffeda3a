#!/usr/bin/env bash
# SFT throughput and memory per precision recipe, one GPU: `nibble finetune` on packed rows of a
# preprocess --sft dataset (random initial weights of the model's real shapes), plus the same BF16 job
# with one sample per row to show what packing buys. Prints a markdown table (figures from each run's
# summary) and keeps every log in OUT.
#   bash scripts/sft_bench.sh BUILD DATA_PREFIX [MODEL (llama3.2-1b)] [SEQ (16384)] [OUT (runs/sft_bench)]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD="$1"
DATA="$2"
MODEL="${3:-llama3.2-1b}"
SEQ="${4:-16384}"
OUT="${5:-runs/sft_bench}"
ITERS="${SFT_BENCH_ITERS:-8}"
mkdir -p "$OUT"
field() { grep -E "^\| $2 " "$1" | awk -F'|' '{gsub(/ /, "", $3); print $3}'; }
efficiency() { grep -oE "packing efficiency [0-9.]+%" "$1" | head -1 | awk '{print $3}'; }
echo "| model | recipe | rows | packing efficiency | step ms | tokens/s/GPU (row positions) | real tokens/s/GPU | peak GiB |"
echo "|---|---|---|---|---|---|---|---|"
run() {  # name recipe packed
  local log="$OUT/$1.log"
  "$BUILD/nibble" finetune --model "$MODEL" --data-path "$DATA" --seq-length "$SEQ" --micro-batch-size 1 \
    --global-batch-size 8 --train-iters "$ITERS" --lr 1e-5 --min-lr 1e-6 --log-interval 1 --recipe "$2" \
    --packed-sequence "$3" >"$log" 2>&1 || { echo "| $MODEL | $2 | failed: see $log | | | | | |"; return; }
  local eff tps ms
  eff=$(efficiency "$log")
  tps=$(field "$log" "tokens/s/GPU")
  ms=$(field "$log" "step time \(ms, mean after step 1\)")
  echo "| $MODEL | $2 | $([ "$3" = true ] && echo packed || echo "one per row") | $eff | $ms | $tps |" \
    "$(awk -v t="$tps" -v e="${eff%\%}" 'BEGIN {printf "%.0f", t * e / 100}') | $(field "$log" "peak memory \(GiB\)") |"
}
run bf16_packed bf16_mixed true
run fp8_packed bf16_with_fp8_current_scaling_mixed true
run nvfp4_packed bf16_with_nvfp4_mixed true
run bf16_unpacked bf16_mixed false
