#!/usr/bin/env bash
# NeMo's Llama3-8B pretraining configuration on every GPU of one machine (docs/DISTRIBUTED.md, "NeMo's
# configuration"), and data-parallel scaling from 1 GPU up at NeMo's per-GPU batch; writes logs to OUT, then
# merges its sections into BENCHMARKS.md (scripts/benchmark_nemo_report.py).
#   bash scripts/benchmark_nemo.sh [build-dir] [OUT] [parts]
# parts, a comma list (default 8b,scaling):
#   8b       llama3.1-8b (the shapes of NeMo's LLAMA3_8B), seq 8192, global batch 128, micro-batch 2, TP = PP =
#            CP = 1, --use-distributed-optimizer, on all N GPUs (gradient accumulation 128 / 2N: 8 on 8 GPUs), in
#            the five recipes of NEMO_RECIPES (default: bf16_mixed, FP8 current and delayed scaling, MXFP8 and
#            NVFP4); then BF16 on 2 GPUs with the same per-GPU batch (micro-batch 2 x 8), the full model's
#            2 -> N scaling. Micro-batch and recompute are the first of "2 none", "2 selective", "1 none",
#            "1 selective", "1 full" that run. Needs at least 2 GPUs.
#   scaling  llama3-8b-proxy at seq 8192 with NeMo's per-GPU batch (micro-batch 2 x 8) on 1, 2, 4 and 8 GPUs
#            (as many as the machine has), distributed optimizer from 2 GPUs on, every layer in the recipes of
#            NEMO_SCALING_RECIPES (default: bf16_mixed).
# Each call can take a subset (NEMO_RECIPES="bf16_mixed" ...) to stay within a time limit; the report reads
# whatever runs OUT holds. NCCL_NVLS_ENABLE stays 0 (scripts/bench_common.sh).
set -uo pipefail
build=${1:-build}
out=${2:-runs/bench-nemo}
parts=${3:-8b,scaling}
read -r -a recipes <<< "${NEMO_RECIPES:-bf16_mixed bf16_with_fp8_current_scaling_mixed \
bf16_with_fp8_delayed_scaling_mixed bf16_with_mxfp8_mixed bf16_with_nvfp4_mixed}"
read -r -a scaling_recipes <<< "${NEMO_SCALING_RECIPES:-bf16_mixed}"
# shellcheck source=scripts/bench_common.sh
source "$(dirname "$0")/bench_common.sh"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
echo "$gpus" > "$out/gpus.txt"

# BF16 layers of the 8B: the recipe's own, but NVFP4 keeps the last 4 (the NVFP4 playbook's setting).
layer_flags_8b() {
  [ "$1" = bf16_with_nvfp4_mixed ] && echo "--num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 4"
}
# The 4-layer proxy quantizes every layer (as scripts/benchmark.sh does): 4 BF16 layers would leave no NVFP4.
every_layer=(--num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 0)

if has 8b; then
  if [ "$gpus" -lt 2 ]; then
    echo "8b: needs at least 2 GPUs, this machine has $gpus" > "$out/8b.skipped"
  else
    nemo=(--model llama3.1-8b --seq-length 8192 --use-distributed-optimizer --train-iters 4)
    for recipe in "${recipes[@]}"; do
      # shellcheck disable=SC2046  # layer_flags_8b prints separate words on purpose
      fit "nemo-8b-$recipe-${gpus}gpu" "${nemo[@]}" --recipe "$recipe" $(layer_flags_8b "$recipe") \
        --global-batch-size 128 --nproc-per-node "$gpus"
    done
    # The 2-GPU row of the full model's scaling: micro-batch 2 x 8 per GPU, as on N GPUs.
    [ "$gpus" -gt 2 ] && fit nemo-8b-bf16_mixed-2gpu "${nemo[@]}" --recipe bf16_mixed --global-batch-size 32 \
      --nproc-per-node 2
  fi
fi

if has scaling; then
  proxy=(--model llama3-8b-proxy --seq-length 8192 --micro-batch-size 2 --train-iters 8)
  for recipe in "${scaling_recipes[@]}"; do
    for n in 1 2 4 8; do
      [ "$n" -gt "$gpus" ] && break
      dist=()
      [ "$n" -gt 1 ] && dist=(--nproc-per-node "$n" --use-distributed-optimizer)
      run "nemo-proxy-$recipe-${n}gpu" "${proxy[@]}" --recipe "$recipe" "${every_layer[@]}" \
        --global-batch-size $((16 * n)) "${dist[@]}"
    done
  done
fi

python3 scripts/benchmark_nemo_report.py "$out" --merge-into BENCHMARKS.md &&
  echo "BENCHMARKS.md: sections from $out merged"
