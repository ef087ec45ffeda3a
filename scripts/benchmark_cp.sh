#!/usr/bin/env bash
# Context parallelism on one machine's GPUs (issue: split a sequence over GPUs): Llama 3.1 8B BF16 at long
# sequences with C = 2 and 4, Megatron-FSDP optim_grads_params over the data x context ranks (every rank of
# the job), a few steps of mock data each; the summary's tokens/s/GPU, model TFLOP/s/GPU and peak memory
# are the rows. Runs one configuration at a time on the GPUs it names.
#   bash scripts/benchmark_cp.sh BUILD OUT [PARTS]   PARTS: comma list of names (default: all)
# then: python3 scripts/benchmark_cp_report.py OUT > table.md   (BENCHMARKS.md's context-parallel section)
set -uo pipefail
cd "$(dirname "$0")/.."
build=$1
out=$2
parts=${3:-all}
# shellcheck source=scripts/bench_common.sh
source scripts/bench_common.sh
common=(--model llama3.1-8b --mock-data true --train-iters 4 --micro-batch-size 1 --use-megatron-fsdp
        --data-parallel-sharding-strategy optim_grads_params)
# name | GPUs | flags
configs=(
  "8b-64k-cp4-full|4|--seq-length 65536 --global-batch-size 2 --context-parallel-size 4 --recompute full"
  "8b-64k-cp4-selective-offload|4|--seq-length 65536 --global-batch-size 2 --context-parallel-size 4 --recompute selective --optimizer-cpu-offload"
  "8b-64k-cp4-selective-offload-gbs8|4|--seq-length 65536 --global-batch-size 8 --context-parallel-size 4 --recompute selective --optimizer-cpu-offload"
  "8b-32k-cp4-selective|4|--seq-length 32768 --global-batch-size 4 --context-parallel-size 4 --recompute selective"
  "8b-128k-cp4-full|4|--seq-length 131072 --global-batch-size 1 --context-parallel-size 4 --recompute full"
  "8b-32k-cp2d2-full|4|--seq-length 32768 --global-batch-size 4 --context-parallel-size 2 --recompute full"
  "8b-32k-cp2-full-offload|2|--seq-length 32768 --global-batch-size 2 --context-parallel-size 2 --recompute full --optimizer-cpu-offload"
)
# CP_GPUS and CP_TIMEOUT are this script's names for run_configs' BENCH_GPUS and BENCH_TIMEOUT.
BENCH_GPUS=${CP_GPUS:-${BENCH_GPUS:-}} BENCH_TIMEOUT=${CP_TIMEOUT:-400}
[ -n "$BENCH_GPUS" ] || unset BENCH_GPUS
COMMON=("${common[@]}")
run_configs "${configs[@]}"
