#!/usr/bin/env bash
# --deterministic-mode on one GPU (docs/PERFORMANCE.md, "Deterministic mode"): writes logs to OUT, then
# scripts/benchmark_determinism_report.py merges its sections into BENCHMARKS.md.
#   bash scripts/benchmark_determinism.sh [build-dir] [OUT] [parts]
# parts, a comma list (default cost,repeat):
#   cost    what the mode costs in step time and peak memory: llama3-8b-proxy and llama3.2-1b (seq 4096,
#           micro-batch 2, global batch 16, as scripts/benchmark.sh), in the recipes of DET_RECIPES (default
#           bf16_mixed and FP8 current scaling, every layer quantized), without and with the mode, side by
#           side; DET_ITERS (default 6) steps per run, the first a warm-up the means leave out.
#   repeat  the 125M study configuration (scripts/convergence.sh's llama-125m, seq 1024, micro-batch 16,
#           global batch 64, its LR schedule and validation) on the study corpus in STUDY_DATA (default
#           runs/study-data, made by scripts/convergence.sh prepare), REPEAT_ITERS (default 200) steps with a
#           checkpoint at the end, twice with the mode and twice without, in the recipes of REPEAT_RECIPES
#           (default bf16_mixed and NVFP4 with the study's last 2 layers in BF16). Each pair writes to the same
#           --save path in turn (the first run's folder is then moved aside), so that trainer_state.json,
#           which records the path, can be compared whole; the report compares metrics.jsonl values and
#           checkpoint bytes.
set -uo pipefail
build=${1:-build}
out=${2:-runs/bench-determinism}
parts=${3:-cost,repeat}
iters=${DET_ITERS:-6}
read -r -a recipes <<< "${DET_RECIPES:-bf16_mixed bf16_with_fp8_current_scaling_mixed}"
read -r -a repeat_recipes <<< "${REPEAT_RECIPES:-bf16_mixed bf16_with_nvfp4_mixed}"
# shellcheck source=scripts/bench_common.sh
source "$(dirname "$0")/bench_common.sh"
quantize_all=(--num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 0)

if has cost; then
  for pair in "proxy llama3-8b-proxy" "1b llama3.2-1b"; do
    read -r tag model <<< "$pair"
    [[ " ${DET_MODELS:-proxy 1b} " == *" $tag "* ]] || continue
    for recipe in "${recipes[@]}"; do
      job=(--model "$model" --seq-length 4096 --micro-batch-size 2 --global-batch-size 16 --train-iters "$iters"
           --recipe "$recipe")
      [ "$recipe" != bf16_mixed ] && job+=("${quantize_all[@]}")
      run "cost-$tag-$recipe-default" "${job[@]}"
      run "cost-$tag-$recipe-deterministic" "${job[@]}" --deterministic-mode
    done
  done
fi

if has repeat; then
  data=${STUDY_DATA:-runs/study-data}
  riters=${REPEAT_ITERS:-200}
  study=(--model llama-125m --seq-length 1024 --micro-batch-size 16 --global-batch-size 64 --train-iters "$riters"
         --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 150 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0
         --mock-data false --data-path "$data/study_text_document" --tokenizer "$data/tokenizer.tiktoken"
         --split "969,30,1" --eval-interval 100 --eval-iters 10 --save-interval "$riters")
  for recipe in "${repeat_recipes[@]}"; do
    flags=(--recipe "$recipe")
    [ "$recipe" = bf16_with_nvfp4_mixed ] && flags+=(--num-layers-at-end-in-bf16 2)  # the study's NVFP4 setting
    for mode in deterministic default; do
      extra=()
      [ "$mode" = deterministic ] && extra=(--deterministic-mode)
      name="repeat-$recipe-$mode"
      for i in 1 2; do
        rm -rf "${out:?}/$name" "${out:?}/$name-$i"
        # Not bench_common's run: its --lr-warmup-iters 1 would clash with the study's schedule.
        "$nb" train --save "$out/$name" --log-interval 10 "${study[@]}" "${flags[@]}" "${extra[@]}" \
          > "$out/$name.log" 2>&1
        mv "$out/$name" "$out/$name-$i"
        mv "$out/$name.log" "$out/$name-$i.log"
      done
    done
  done
fi
echo "benchmark_determinism: logs in $out"
