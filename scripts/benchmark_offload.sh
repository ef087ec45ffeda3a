#!/usr/bin/env bash
# The optimizer state in host memory (--optimizer-cpu-offload) on one GPU (docs/OFFLOAD.md): writes logs
# to OUT, then scripts/benchmark_offload_report.py merges its sections into BENCHMARKS.md.
#   bash scripts/benchmark_offload.sh [build-dir] [OUT] [parts]
# parts, a comma list (default 8b,cost):
#   8b    llama3.1-8b, seq 4096, global batch 64 (the NVFP4 playbook's), offload fraction 1.0, in the recipes
#         of OFFLOAD_RECIPES (default: bf16_mixed, FP8 current scaling, NVFP4 with the last 4 layers in BF16);
#         micro-batch and recompute are the first of "2 none", "2 selective", "1 none", "1 selective",
#         "1 full" that runs (the failed tries' logs are kept); recipes in OFFLOAD_LEAST_RECIPES (default
#         bf16_mixed) run again at the least fraction that fits the GPU, as the memory estimate prints it.
#   cost  what offload costs on models that fit both ways: llama3.2-3b (seq 4096, global batch 64) and the
#         proxy (llama3-8b-proxy, seq 4096, micro-batch 2, global batch 16), BF16, without and with offload
#         at the same micro-batch and recompute (the 3B also without the per-layer gates, at fraction 0.5 and
#         at the least fraction that fits).
#   sft   NeMo's SFT workload: llama3.1-8b, seq 16384, micro-batch 1, global batch 8, packed rows of the
#         preprocess --sft dataset SFT_DATA (a prefix), offload on, in OFFLOAD_RECIPES; recompute is the
#         lightest of none, selective, full that runs.
# OFFLOAD_ITERS (default 3) steps per run; the first is a warm-up that the figures leave out.
set -uo pipefail
build=${1:-build}
out=${2:-runs/bench-offload}
parts=${3:-8b,cost}
iters=${OFFLOAD_ITERS:-3}
read -r -a recipes <<< "${OFFLOAD_RECIPES:-bf16_mixed bf16_with_fp8_current_scaling_mixed bf16_with_nvfp4_mixed}"
# shellcheck source=scripts/bench_common.sh
source "$(dirname "$0")/bench_common.sh"
offload=(--optimizer-cpu-offload --optimizer-offload-fraction 1.0)
free -g > "$out/host_memory.txt" 2>&1

# least NAME: the least offload fraction that fits, as the run's memory estimate printed it (empty if none).
least() {
  grep -oE "least --optimizer-offload-fraction that fits: [0-9.]+" "$out/$1.log" | head -1 | awk '{print $NF}'
}
layer_flags() {  # the NVFP4 playbook keeps the last 4 layers in BF16
  [ "$1" = bf16_with_nvfp4_mixed ] && echo "--num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 4"
}

if has 8b; then
  for recipe in "${recipes[@]}"; do
    job=(--model llama3.1-8b --seq-length 4096 --global-batch-size 64 --train-iters "$iters" --recipe "$recipe")
    # shellcheck disable=SC2046  # layer_flags prints separate words on purpose
    fit "offload-8b-$recipe" "${job[@]}" $(layer_flags "$recipe") "${offload[@]}" || continue
    # Then at the least fraction that fits the GPU at the same micro-batch (OFFLOAD_LEAST_RECIPES).
    f=$(least "offload-8b-$recipe")
    read -r mbs recompute < "$out/offload-8b-$recipe.fit"
    [[ " ${OFFLOAD_LEAST_RECIPES-bf16_mixed} " == *" $recipe "* ]] && [ -n "$f" ] && [ "$f" != 1.00 ] &&
      run "offload-8b-$recipe-least" "${job[@]}" $(layer_flags "$recipe") --optimizer-cpu-offload \
        --optimizer-offload-fraction "$f" --micro-batch-size "$mbs" --recompute "$recompute"
  done
fi

if has cost; then
  fit cost-3b-device --model llama3.2-3b --seq-length 4096 --global-batch-size 64 --train-iters "$iters"
  if [ -f "$out/cost-3b-device.fit" ]; then
    read -r mbs recompute < "$out/cost-3b-device.fit"
    run cost-3b-offload --model llama3.2-3b --seq-length 4096 --global-batch-size 64 --train-iters "$iters" \
      --micro-batch-size "$mbs" --recompute "$recompute" "${offload[@]}"
    # The same with the next forward waiting for the whole update (no per-layer gates): what the gates hide.
    NIBBLE_OFFLOAD_GATES=0 run cost-3b-offload-ungated --model llama3.2-3b --seq-length 4096 --global-batch-size 64 \
      --train-iters "$iters" --micro-batch-size "$mbs" --recompute "$recompute" "${offload[@]}"
    run cost-3b-offload-half --model llama3.2-3b --seq-length 4096 --global-batch-size 64 --train-iters "$iters" \
      --micro-batch-size "$mbs" --recompute "$recompute" --optimizer-cpu-offload --optimizer-offload-fraction 0.5
    f=$(least cost-3b-offload)
    [ -n "$f" ] && [ "$f" != 1.00 ] && [ "$f" != 0.00 ] && run cost-3b-offload-least --model llama3.2-3b --seq-length 4096 \
      --global-batch-size 64 --train-iters "$iters" --micro-batch-size "$mbs" --recompute "$recompute" \
      --optimizer-cpu-offload --optimizer-offload-fraction "$f"
  fi
  proxy=(--model llama3-8b-proxy --seq-length 4096 --micro-batch-size 2 --global-batch-size 16
         --train-iters $((iters + 2)))
  run cost-proxy-device "${proxy[@]}"
  run cost-proxy-offload "${proxy[@]}" "${offload[@]}"
fi

if has sft; then
  for recipe in "${recipes[@]}"; do
    # shellcheck disable=SC2046
    FIT_PAIRS="1 none,1 selective,1 full" fit "offload-sft-8b-$recipe" --model llama3.1-8b --sft \
      --data-path "${SFT_DATA:?set SFT_DATA}" --seq-length 16384 --global-batch-size 8 --packed-sequence true \
      --train-iters "$iters" --lr 1e-5 --min-lr 1e-6 --recipe "$recipe" $(layer_flags "$recipe") "${offload[@]}"
  done
fi
echo "benchmark_offload: logs in $out"
