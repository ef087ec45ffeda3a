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
read -r -a lanes <<< "${CP_GPUS:-$(seq -s ' ' 0 $(($(nvidia-smi -L | wc -l) - 1)))}"
for c in "${configs[@]}"; do
  IFS='|' read -r name gpus flags <<< "$c"
  [ "$parts" = all ] || has "$name" || continue
  read -r -a extra <<< "$flags"
  devices=$(IFS=,; echo "${lanes[*]:0:$gpus}")
  start=$(date +%s)
  rm -rf "${out:?}/$name"
  # A bounded run (CP_TIMEOUT seconds, default 400): a hung rank must not eat the machine's time; its
  # launched ranks are killed with it.
  CUDA_VISIBLE_DEVICES=$devices timeout "${CP_TIMEOUT:-400}" "$nb" train --save "$out/$name" --log-interval 1 \
    --lr-warmup-iters 1 "${common[@]}" --nproc-per-node "$gpus" "${extra[@]}" > "$out/$name.log" 2>&1
  code=$?
  [ $code -eq 124 ] && pkill -9 -f "$nb train" || true
  echo "$name: exit $code after $(($(date +%s) - start)) s" | tee -a "$out/runs.txt"
done
