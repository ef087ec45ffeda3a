#!/usr/bin/env bash
# Megatron-FSDP benchmarks (docs/DISTRIBUTED.md) on one machine with at least two GPUs; writes logs and
# metrics to OUT, then merges its sections into BENCHMARKS.md.
#   bash scripts/benchmark_fsdp.sh [build-dir] [OUT] [parts]
# parts, a comma list (default 8b,cost):
#   8b    Llama 3.1 8B, seq 4096, global batch 32, 2 ranks, --data-parallel-sharding-strategy
#         optim_grads_params, no optimizer offload, in FSDP_RECIPES (default: bf16_mixed,
#         bf16_with_fp8_current_scaling_mixed, bf16_with_nvfp4_mixed; NVFP4 with the last 4 layers BF16). The
#         micro-batch and recompute are the first of FIT_PAIRS (bench_common.sh) that run.
#   cost  llama3-8b-proxy at micro-batch 2, 8 micro-batches per GPU: 1 GPU, then 2 GPUs with optim (the
#         distributed optimizer), optim_grads and optim_grads_params, all over NVLink; the last two with
#         --fsdp-embeddings-per-step (FSDP_COST_EPS_STRATEGIES), and the FSDP_COST_BF16 list (STRATEGY or
#         STRATEGY-eps) with --grad-reduce-in-bf16.
#   lora70b  NeMo's 70B LoRA row with a BF16 base (scripts/lora_bench.sh's job: llama3.1-70b, seq 4096,
#         micro-batch 1, global batch 32, rank 32, alpha 32) on 2 GPUs with optim_grads_params: each GPU keeps
#         half of the 141 GB base (the seeded random init of the real shapes). The recompute is the first of
#         LORA70B_FIT_PAIRS (default 1/none, 1/selective, 1/full) that runs. Needs 141 GB GPUs (two H200s).
# NCCL_NVLS_ENABLE stays 0 (NVLink multicast off, as the shared machines require).
set -uo pipefail
build=${1:-build}
out=${2:-runs/bench-fsdp}
parts=${3:-8b,cost}
# shellcheck source=scripts/bench_common.sh
source "$(dirname "$0")/bench_common.sh"
fsdp=(--nproc-per-node 2 --use-megatron-fsdp --data-parallel-sharding-strategy)

if has 8b; then
  IFS=, read -r -a recipes <<< "${FSDP_RECIPES:-bf16_mixed,bf16_with_fp8_current_scaling_mixed,bf16_with_nvfp4_mixed}"
  for recipe in "${recipes[@]}"; do
    extra=()
    [ "$recipe" = bf16_with_nvfp4_mixed ] && extra=(--num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 4)
    # FSDP_8B_FLAGS: further Megatron-FSDP flags for these runs (e.g. --fsdp-embeddings-per-step), named in the report.
    # shellcheck disable=SC2086
    fit "fsdp-8b-$recipe" "${fsdp[@]}" optim_grads_params ${FSDP_8B_FLAGS:-} --model llama3.1-8b --recipe "$recipe" "${extra[@]}" \
      --seq-length 4096 --global-batch-size 32 --train-iters 4
  done
fi

if has cost; then
  proxy=(--model llama3-8b-proxy --seq-length 4096 --micro-batch-size 2 --train-iters 8)
  run fsdp-proxy-1gpu "${proxy[@]}" --global-batch-size 16
  for strategy in ${FSDP_COST_STRATEGIES:-optim optim_grads optim_grads_params}; do
    run "fsdp-proxy-2gpu-$strategy" "${proxy[@]}" --global-batch-size 32 "${fsdp[@]}" "$strategy"
  done
  # The embedding and head gathered and reduced once per step instead of every micro-batch.
  for strategy in ${FSDP_COST_EPS_STRATEGIES:-optim_grads optim_grads_params}; do
    run "fsdp-proxy-2gpu-$strategy-eps" "${proxy[@]}" --global-batch-size 32 "${fsdp[@]}" "$strategy" \
      --fsdp-embeddings-per-step
  done
  # Gradients reduced in BF16 (--grad-reduce-in-bf16, a numerics change): STRATEGY or STRATEGY-eps.
  for spec in ${FSDP_COST_BF16:-optim optim_grads_params optim_grads-eps optim_grads_params-eps}; do
    eps=()
    [[ "$spec" == *-eps ]] && eps=(--fsdp-embeddings-per-step)
    run "fsdp-proxy-2gpu-$spec-bf16" "${proxy[@]}" --global-batch-size 32 "${fsdp[@]}" "${spec%-eps}" "${eps[@]}" \
      --grad-reduce-in-bf16
  done
fi

if has lora70b; then
  FIT_PAIRS=${LORA70B_FIT_PAIRS:-1 none,1 selective,1 full} fit fsdp-lora70b-bf16 "${fsdp[@]}" optim_grads_params \
    --model llama3.1-70b --peft lora --lora-rank 32 --lora-alpha 32 --lora-base-precision bf16 --lr 1e-4 \
    --seq-length 4096 --global-batch-size 32 --train-iters 4
fi

python3 scripts/benchmark_fsdp_report.py "$out" --merge-into BENCHMARKS.md && echo "BENCHMARKS.md: sections from $out merged"
