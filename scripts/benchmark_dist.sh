#!/usr/bin/env bash
# Multi-GPU benchmarks of data parallelism (docs/DISTRIBUTED.md), in one job on one machine with at least
# two GPUs; writes logs and metrics to OUT, then merges its sections into BENCHMARKS.md.
#   bash scripts/benchmark_dist.sh [build-dir] [OUT] [parts]
# parts, a comma list (default 8b,scaling,overlap1):
#   8b       Llama 3.1 8B, seq 4096, global batch 64, 2 ranks, distributed optimizer, in bf16_mixed, FP8
#            current scaling and NVFP4 (last 4 layers BF16, the playbook's setting). The micro-batch and
#            recompute are the first of "2 none", "1 none", "1 selective", "1 full" that run.
#   scaling  llama3-8b-proxy at the same per-GPU batch (micro-batch 2 x 8) on 1 and 2 GPUs over NVLink, then
#            2 GPUs forced onto NCCL's socket transport (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1) without and
#            with --overlap-grad-reduce and --overlap-param-gather.
#   overlap1 the same proxy with one micro-batch per step (the overlaps then have the whole step to hide
#            behind), over NVLink and sockets, without and with both overlaps.
# NCCL_NVLS_ENABLE stays 0 (NVLink multicast off, as the shared machines require).
set -uo pipefail
build=${1:-build}
out=${2:-runs/bench-dist}
parts=${3:-8b,scaling,overlap1}
# shellcheck source=scripts/bench_common.sh
source "$(dirname "$0")/bench_common.sh"

if has 8b; then
  for recipe in bf16_mixed bf16_with_fp8_current_scaling_mixed bf16_with_nvfp4_mixed; do
    extra=()
    [ "$recipe" = bf16_with_nvfp4_mixed ] && extra=(--num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 4)
    for fit in "2 none" "1 none" "1 selective" "1 full"; do
      read -r mbs recompute <<< "$fit"
      if run "8b-$recipe" --nproc-per-node 2 --use-distributed-optimizer --model llama3.1-8b --recipe "$recipe" \
           "${extra[@]}" --seq-length 4096 --global-batch-size 64 --micro-batch-size "$mbs" --recompute "$recompute" \
           --train-iters 4; then
        echo "$mbs $recompute" > "$out/8b-$recipe.fit"
        break
      fi
      cp "$out/8b-$recipe.log" "$out/8b-$recipe-mbs$mbs-$recompute.failed.log"
    done
  done
fi

if has scaling; then
  proxy=(--model llama3-8b-proxy --seq-length 4096 --micro-batch-size 2 --train-iters 8)
  run proxy-1gpu "${proxy[@]}" --global-batch-size 16
  run proxy-2gpu-nvlink "${proxy[@]}" --global-batch-size 32 --nproc-per-node 2 --use-distributed-optimizer
  run proxy-2gpu-nvlink-overlap "${proxy[@]}" --global-batch-size 32 --nproc-per-node 2 --use-distributed-optimizer \
    --overlap-grad-reduce --overlap-param-gather
  for overlap in none grad both; do
    flags=()
    [ "$overlap" != none ] && flags+=(--overlap-grad-reduce)
    [ "$overlap" = both ] && flags+=(--overlap-param-gather)
    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 run "proxy-2gpu-socket-$overlap" "${proxy[@]}" --global-batch-size 32 \
      --nproc-per-node 2 --use-distributed-optimizer "${flags[@]}"
  done
fi

if has overlap1; then
  proxy1=(--model llama3-8b-proxy --seq-length 4096 --micro-batch-size 2 --train-iters 12)
  run proxy1-1gpu "${proxy1[@]}" --global-batch-size 2
  for link in nvlink socket; do
    for overlap in none both; do
      flags=()
      [ "$overlap" = both ] && flags=(--overlap-grad-reduce --overlap-param-gather)
      (  # a subshell, so the socket transport's settings end with its run
        [ "$link" = socket ] && export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
        run "proxy1-2gpu-$link-$overlap" "${proxy1[@]}" --global-batch-size 4 --nproc-per-node 2 \
          --use-distributed-optimizer "${flags[@]}"
      )
    done
  done
fi

python3 scripts/benchmark_dist_report.py "$out" --merge-into BENCHMARKS.md && echo "BENCHMARKS.md: sections from $out merged"
