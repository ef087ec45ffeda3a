#!/usr/bin/env bash
# Tensor parallelism on one machine's GPUs (issue: split a layer over GPUs): the Llama 3 8B proxy (4 layers of
# the 8B's shape) at T = 1, 2, 4 in BF16 and FP8 current scaling, with and without --tp-comm-overlap and
# --sequence-parallel, per-GPU tokens/s against one GPU's; and the 8B at T4 and T2 x D2 beside Megatron-FSDP
# over the same four GPUs. Mock data, a few steps each; the summary's
# tokens/s/GPU, model TFLOP/s/GPU and peak memory are the rows.
#   bash scripts/benchmark_tp.sh BUILD OUT [PARTS]   PARTS: comma list of names (default: all)
# then: python3 scripts/benchmark_tp_report.py OUT [--merge-into BENCHMARKS.md]
# BENCH_GPUS (e.g. "2 3") picks the GPUs, BENCH_TIMEOUT bounds each run (seconds, default 400).
set -uo pipefail
cd "$(dirname "$0")/.."
build=$1
out=$2
parts=${3:-all}
# shellcheck source=scripts/bench_common.sh
source scripts/bench_common.sh
COMMON=(--mock-data true --micro-batch-size 1 --seq-length 8192)
proxy="--model llama3-8b-proxy --train-iters 6 --global-batch-size 8"
fp8="--recipe bf16_with_fp8_current_scaling_mixed"
nvfp4="--recipe bf16_with_nvfp4_mixed"
all4="--num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 0"  # every layer NVFP4: the gathers' bytes
big="--model llama3.1-8b --train-iters 4 --global-batch-size 8 --recompute selective"
# name | GPUs | flags
sp="--sequence-parallel --tp-comm-overlap"
configs=(
  "proxy-bf16-t1|1|$proxy"
  "proxy-bf16-t2|2|$proxy --tensor-model-parallel-size 2"
  "proxy-bf16-t2-overlap|2|$proxy --tensor-model-parallel-size 2 --tp-comm-overlap"
  "proxy-bf16-t2-sp|2|$proxy --tensor-model-parallel-size 2 $sp"
  "proxy-fp8-t1|1|$proxy $fp8"
  "proxy-fp8-t2|2|$proxy $fp8 --tensor-model-parallel-size 2"
  "proxy-fp8-t2-sp|2|$proxy $fp8 --tensor-model-parallel-size 2 $sp"
  "proxy-nvfp4-t1|1|$proxy $nvfp4"
  "proxy-nvfp4-t2-sp|2|$proxy $nvfp4 --tensor-model-parallel-size 2 $sp"
  "proxy-nvfp4all-t1|1|$proxy $nvfp4 $all4"
  "proxy-nvfp4all-t2-sp|2|$proxy $nvfp4 $all4 --tensor-model-parallel-size 2 $sp"
  "proxy-bf16-t4|4|$proxy --tensor-model-parallel-size 4 --tp-comm-overlap"
  "proxy-bf16-t4-sp|4|$proxy --tensor-model-parallel-size 4 $sp"
  "8b-bf16-t4|4|$big --tensor-model-parallel-size 4 $sp"
  "8b-bf16-t2d2|4|$big --tensor-model-parallel-size 2 $sp --use-distributed-optimizer"
  "8b-bf16-fsdp4|4|$big --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"
  "8b-nvfp4-t2d2|4|$big $nvfp4 --tensor-model-parallel-size 2 $sp --use-distributed-optimizer"
  "8b-nvfp4-fsdp4|4|$big $nvfp4 --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"
)
run_configs "${configs[@]}"
