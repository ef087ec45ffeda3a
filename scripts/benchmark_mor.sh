#!/usr/bin/env bash
# Mixture of Representations' speed on one GPU (issue: each tensor picks its own precision): the Llama 3 8B proxy
# (4 layers of the 8B's shape) and Llama 3.2 3B in bf16_with_mor_fp8_mixed at the default threshold against
# bf16_with_fp8_current_scaling_mixed (its preset, first and last layers BF16, and with every layer FP8 as MoR's
# preset has it) and bf16_mixed. What deciding costs: MoR at threshold 0.999 keeps every operand FP8, so its GEMMs are
# the every-layer FP8 run's; the difference in step time is the statistic, the board's read-back and the host's
# decisions (metrics.jsonl has the decisions' host time). The NVFP4 ladder (bf16_with_mor_nvfp4_mixed) likewise against
# bf16_with_nvfp4_mixed (its preset keeps the last 4 layers BF16, which is every layer of the proxy: the proxy is
# compared with every layer NVFP4 only); at NVFP4 threshold 0.999 every operand stays NVFP4 (what deciding costs).
# Mock data, a few steps each.
#   bash scripts/benchmark_mor.sh BUILD OUT [PARTS]   PARTS: comma list of names (default: all)
# then: python3 scripts/benchmark_mor_report.py OUT [--merge-into BENCHMARKS.md]
# BENCH_GPUS picks the GPU, BENCH_TIMEOUT bounds each run (seconds, default 400).
set -uo pipefail
cd "$(dirname "$0")/.."
build=$1
out=$2
parts=${3:-all}
# shellcheck source=scripts/bench_common.sh
source scripts/bench_common.sh
COMMON=(--mock-data true --micro-batch-size 1 --seq-length 8192)
proxy="--model llama3-8b-proxy --train-iters 8 --global-batch-size 8"
small="--model llama3.2-3b --train-iters 6 --global-batch-size 4 --recompute selective"
# --mor-interval 4 decides after steps 1, 5 and 9: of 9 steps, 2 of the 8 timed ones (after step 1) measure.
proxy9="--model llama3-8b-proxy --train-iters 9 --global-batch-size 8"
small9="--model llama3.2-3b --train-iters 9 --global-batch-size 4 --recompute selective"
fp8="--recipe bf16_with_fp8_current_scaling_mixed"
all="--num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 0"
mor="--recipe bf16_with_mor_fp8_mixed"
nvfp4="--recipe bf16_with_nvfp4_mixed"
ladder="--recipe bf16_with_mor_nvfp4_mixed"
# name | GPUs | flags
configs=(
  "proxy-bf16|1|$proxy"
  "proxy-fp8|1|$proxy $fp8"
  "proxy-fp8-all|1|$proxy $fp8 $all"
  "proxy-mor|1|$proxy $mor"
  "proxy-mor-allfp8|1|$proxy $mor --mor-threshold 0.999"
  "3b-bf16|1|$small"
  "3b-fp8|1|$small $fp8"
  "3b-fp8-all|1|$small $fp8 $all"
  "3b-mor|1|$small $mor"
  "3b-mor-allfp8|1|$small $mor --mor-threshold 0.999"
  "proxy-mor-i4|1|$proxy9 $mor --mor-interval 4"
  "proxy-mor-allfp8-i4|1|$proxy9 $mor --mor-threshold 0.999 --mor-interval 4"
  "3b-mor-i4|1|$small9 $mor --mor-interval 4"
  "3b-mor-allfp8-i4|1|$small9 $mor --mor-threshold 0.999 --mor-interval 4"
  "proxy-nvfp4-all|1|$proxy $nvfp4 $all"
  "proxy-ladder|1|$proxy $ladder"
  "proxy-ladder-allnvfp4|1|$proxy $ladder --mor-nvfp4-threshold 0.999"
  "proxy-ladder-i4|1|$proxy9 $ladder --mor-interval 4"
  "3b-nvfp4|1|$small $nvfp4"
  "3b-nvfp4-all|1|$small $nvfp4 $all"
  "3b-ladder|1|$small $ladder"
  "3b-ladder-allnvfp4|1|$small $ladder --mor-nvfp4-threshold 0.999"
  "3b-ladder-i4|1|$small9 $ladder --mor-interval 4"
  "proxy-mor-block|1|$proxy $mor --mor-granularity block"
  "3b-mor-block|1|$small $mor --mor-granularity block"
  "proxy-ladder-block|1|$proxy $ladder --mor-granularity block"
  "proxy-ladder-block-rows|1|$proxy $ladder --mor-granularity block --mor-nvfp4-rows"
  "3b-ladder-block|1|$small $ladder --mor-granularity block"
  "3b-ladder-block-rows|1|$small $ladder --mor-granularity block --mor-nvfp4-rows"
)
run_configs "${configs[@]}"
