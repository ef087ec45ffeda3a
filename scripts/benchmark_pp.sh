#!/usr/bin/env bash
# Pipeline parallelism on one machine's four GPUs (issue: pipeline parallelism): Llama 3.1 8B pretraining at PP4
# and PP2 x D2 beside Megatron-FSDP over the same GPUs, in BF16 and NVFP4 (which needs full recompute under
# pipeline parallelism), same run. Mock data, a global batch of 32 rows of 8192 tokens (32 micro-batches per
# step at PP4: a bubble of 3 / 32 by formula); the summary's tokens/s/GPU, model TFLOP/s/GPU and peak memory
# (rank 0's: the first stage, which holds the most activations in flight) are the rows. PP2 x T2 (sequence
# parallel) beside them; a profiled PP4 run measures the first stage's bubble (its phase "pipeline: messages +
# waits (bubble)" in roofline.json) against the formula.
#   bash scripts/benchmark_pp.sh BUILD OUT [PARTS]   PARTS: comma list of names (default: all)
# then: python3 scripts/benchmark_pp_report.py OUT [--merge-into BENCHMARKS.md]
# BENCH_GPUS (e.g. "0 1 2 3") picks the GPUs, BENCH_TIMEOUT bounds each run (seconds, default 400).
set -uo pipefail
cd "$(dirname "$0")/.."
build=$1
out=$2
parts=${3:-all}
# shellcheck source=scripts/bench_common.sh
source scripts/bench_common.sh
COMMON=(--mock-data true --micro-batch-size 1 --seq-length 8192)
big="--model llama3.1-8b --train-iters 4 --global-batch-size 32"
nvfp4="--recipe bf16_with_nvfp4_mixed"
fsdp="--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"
# name | GPUs | flags
configs=(
  "8b-bf16-pp4|4|$big --recompute selective --pipeline-model-parallel-size 4"
  "8b-bf16-pp2d2|4|$big --recompute selective --pipeline-model-parallel-size 2 --use-distributed-optimizer"
  "8b-bf16-pp2t2|4|$big --recompute selective --pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel"
  "8b-bf16-pp4-profile|4|$big --recompute selective --pipeline-model-parallel-size 4 --profile"
  "8b-bf16-fsdp4|4|$big --recompute selective $fsdp"
  "8b-bf16-pp2-profile|2|$big --recompute selective --pipeline-model-parallel-size 2 --profile"
  "8b-bf16-pp2-first17-profile|2|$big --recompute selective --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 17 --profile"
  "8b-bf16-pp2-first17-no-overlap-profile|2|$big --recompute selective --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 17 --profile --no-overlap-p2p-communication"
  "8b-nvfp4-pp4|4|$big $nvfp4 --recompute full --pipeline-model-parallel-size 4"
  "8b-nvfp4-pp4-selective|4|$big $nvfp4 --recompute selective --pipeline-model-parallel-size 4"
  "8b-nvfp4-fsdp4|4|$big $nvfp4 --recompute selective $fsdp"
)
# The interleaved schedule's imbalance and what a layout does about it, on two GPUs: PP2 VP4 (8 stages of 4 layers)
# leaves the LM head and loss (about two layers' GEMM work at the 8B's shape) on the last stage; the layout moves one
# layer from it to the first (rank 0 then holds 17 layers, rank 1 15 and the head). Every slot of a rank's
# activations is sized for its largest chunk, so the 5-layer chunk costs memory (the estimate says how much).
pp2vp4="--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 4"
layout="--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Ettttt|tttt|tttt|tttt|tttt|tttt|tttt|tttL"
configs+=(
  "8b-bf16-pp2vp4-profile|2|$big --recompute selective $pp2vp4 --profile"
  "8b-bf16-pp2vp4-layout-profile|2|$big --recompute selective $layout --profile"
)
run_configs "${configs[@]}"
