#!/usr/bin/env bash
# NeMo's Llama 3.1 70B LoRA configuration under pipeline parallelism on four GPUs (issue: pipeline parallelism):
# TP1 PP4 VP20, global batch 32, micro-batch 1, sequence 4096, LoRA rank 32 on a frozen base of seeded random
# values of the real shapes (no 70B weights can be fetched: speed and memory only). BF16, FP8 and NVFP4 bases, each
# with full and selective recompute (a frozen base's Linears keep nothing of a micro-batch for its backward, so
# quantized bases need no full recompute under pipeline parallelism); a profiled BF16 pair with the messages
# overlapped with compute (the default) and without (--no-overlap-p2p-communication) measures what overlap buys.
# Compare with BENCHMARKS.md's Megatron-FSDP row (1,721 tokens/s/GPU on two H200s).
#   bash scripts/benchmark_pp_lora.sh BUILD OUT [PARTS]; then python3 scripts/benchmark_pp_report.py OUT
set -uo pipefail
cd "$(dirname "$0")/.."
build=$1
out=$2
parts=${3:-all}
# shellcheck source=scripts/bench_common.sh
source scripts/bench_common.sh
COMMON=(--mock-data true --micro-batch-size 1 --seq-length 4096)
lora="--model llama3.1-70b --peft lora --lora-rank 32 --lora-alpha 32 --lr 1e-4 --train-iters 3 --global-batch-size 32"
pp="--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 20"
configs=(
  "70b-lora-bf16-pp4vp20-full|4|$lora --lora-base-precision bf16 $pp --recompute full"
  "70b-lora-bf16-pp4vp20-selective|4|$lora --lora-base-precision bf16 $pp --recompute selective"
  "70b-lora-fp8-pp4vp20-full|4|$lora --lora-base-precision fp8 $pp --recompute full"
  "70b-lora-fp8-pp4vp20-selective|4|$lora --lora-base-precision fp8 $pp --recompute selective"
  "70b-lora-nvfp4-pp4vp20-full|4|$lora --lora-base-precision nvfp4 $pp --recompute full"
  "70b-lora-nvfp4-pp4vp20-selective|4|$lora --lora-base-precision nvfp4 $pp --recompute selective"
  "70b-lora-bf16-pp4vp20-selective-profile|4|$lora --lora-base-precision bf16 $pp --recompute selective --profile"
  "70b-lora-bf16-pp4vp20-selective-no-overlap-profile|4|$lora --lora-base-precision bf16 $pp --recompute selective --profile --no-overlap-p2p-communication"
)
# On two GPUs, beside nibble's Megatron-FSDP row on two H200s: PP2 (1F1B), a BF16 base with full recompute, an
# NVFP4 base with selective.
configs+=(
  "70b-lora-bf16-pp2-full|2|$lora --lora-base-precision bf16 --pipeline-model-parallel-size 2 --recompute full"
  "70b-lora-nvfp4-pp2-selective|2|$lora --lora-base-precision nvfp4 --pipeline-model-parallel-size 2 --recompute selective"
)
# What overlapping the messages buys, on two GPUs: PP2 VP20 runs as many passes per rank and step as PP4 VP20 (1,280,
# each followed by its sends and receives), of two layers rather than one; a BF16 base with selective recompute
# (132.4 GiB on the first stage by the memory estimate, for an H200).
pp2vp="--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 20"
configs+=(
  "70b-lora-bf16-pp2vp20-selective-profile|2|$lora --lora-base-precision bf16 $pp2vp --recompute selective --profile"
  "70b-lora-bf16-pp2vp20-selective-no-overlap-profile|2|$lora --lora-base-precision bf16 $pp2vp --recompute selective --profile --no-overlap-p2p-communication"
)
run_configs "${configs[@]}"
