#!/usr/bin/env bash
# The memory estimate against measured peaks (issue: size a job before it runs). Each configuration trains
# a few steps on mock data with an evaluation and (small models) a checkpoint save, and its log's last lines
# give the estimate, nibble's allocator high-water mark over the whole run, and the device memory in use at
# its peak; the same configuration's `--dry-run` must print the same total. One configuration per GPU at a
# time, the GPUs of the machine in parallel; the two-rank ones after them, two GPUs each.
#   bash scripts/benchmark_memory.sh BUILD OUT [SFT_DATA_PREFIX] [TOKENIZER (for the training-samples run)]
# then: python3 scripts/benchmark_memory_report.py OUT > table.md  (BENCHMARKS.md's memory section)
set -uo pipefail
cd "$(dirname "$0")/.."
build=$1
out=$2
sft=${3:-}
tokenizer=${4:-}
parts=all
# shellcheck source=scripts/bench_common.sh
source scripts/bench_common.sh
# MEMORY_GPUS: the GPUs to use (default all); MEMORY_ONLY: a regex of configuration names (default all);
# MEMORY_TWO_RANK=0 skips the two-rank configurations.
read -r -a lanes <<< "${MEMORY_GPUS:-$(seq -s ' ' 0 $(($(nvidia-smi -L | wc -l) - 1)))}"
gpus=${#lanes[@]}
only=${MEMORY_ONLY:-.}
gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{printf "%.0f", $1 / 1024}')

common=(--mock-data true --train-iters 3 --eval-interval 2 --eval-iters 1 --log-interval 1 --lr-warmup-iters 1)
CS=bf16_with_fp8_current_scaling_mixed
DS=bf16_with_fp8_delayed_scaling_mixed
SC=bf16_with_fp8_subchannel_scaling_mixed
MX=bf16_with_mxfp8_mixed
FP4=bf16_with_nvfp4_mixed
# name | flags (save=1: write a checkpoint at the end)
configs=(
  "1b-bf16-mbs1-none|save=1 --model llama3.2-1b --seq-length 4096 --global-batch-size 4 --micro-batch-size 1"
  "1b-bf16-mbs2-selective|--model llama3.2-1b --seq-length 4096 --global-batch-size 4 --micro-batch-size 2 --recompute selective"
  "1b-bf16-mbs2-full|--model llama3.2-1b --seq-length 4096 --global-batch-size 4 --micro-batch-size 2 --recompute full"
  "1b-fp8cs-mbs2-none|save=1 --model llama3.2-1b --seq-length 4096 --global-batch-size 4 --micro-batch-size 2 --recipe $CS"
  "1b-fp8ds-mbs1-none|--model llama3.2-1b --seq-length 4096 --global-batch-size 4 --micro-batch-size 1 --recipe $DS"
  "1b-fp8sub-mbs1-none|--model llama3.2-1b --seq-length 4096 --global-batch-size 4 --micro-batch-size 1 --recipe $SC"
  "1b-mxfp8-mbs1-none|--model llama3.2-1b --seq-length 4096 --global-batch-size 4 --micro-batch-size 1 --recipe $MX"
  "1b-nvfp4-mbs2-selective|save=1 --model llama3.2-1b --seq-length 4096 --global-batch-size 4 --micro-batch-size 2 --recipe $FP4 --recompute selective"
  "1b-nvfp4-deterministic|--model llama3.2-1b --seq-length 4096 --global-batch-size 4 --micro-batch-size 1 --recipe $FP4 --deterministic-mode"
  "1b-bf16-deterministic-mbs2|--model llama3.2-1b --seq-length 4096 --global-batch-size 4 --micro-batch-size 2 --deterministic-mode"
  "3b-bf16-deterministic-2k|--model llama3.2-3b --seq-length 2048 --global-batch-size 4 --micro-batch-size 1 --deterministic-mode --recompute selective"
  "1b-nvfp4-anneal|--model llama3.2-1b --seq-length 4096 --global-batch-size 4 --micro-batch-size 1 --recipe $FP4 --anneal-start-fraction 0.5 --anneal-recipe bf16_mixed"
  "3b-bf16-mbs1-selective|--model llama3.2-3b --seq-length 4096 --global-batch-size 4 --micro-batch-size 1 --recompute selective"
  "3b-fp8cs-mbs2-none|--model llama3.2-3b --seq-length 4096 --global-batch-size 4 --micro-batch-size 2 --recipe $CS"
  "3b-fp8ds-mbs1-full|--model llama3.2-3b --seq-length 4096 --global-batch-size 4 --micro-batch-size 1 --recipe $DS --recompute full"
  "3b-mxfp8-mbs2-selective|--model llama3.2-3b --seq-length 4096 --global-batch-size 4 --micro-batch-size 2 --recipe $MX --recompute selective"
  "3b-nvfp4-mbs1-full|--model llama3.2-3b --seq-length 4096 --global-batch-size 4 --micro-batch-size 1 --recipe $FP4 --recompute full"
  "3b-bf16-offload0.5|--model llama3.2-3b --seq-length 4096 --global-batch-size 4 --micro-batch-size 1 --optimizer-cpu-offload --optimizer-offload-fraction 0.5"
  "3b-fp8cs-offload1.0|--model llama3.2-3b --seq-length 4096 --global-batch-size 4 --micro-batch-size 2 --recipe $CS --optimizer-cpu-offload"
  "8b-bf16-offload-mbs1-selective|--model llama3.1-8b --seq-length 4096 --global-batch-size 2 --micro-batch-size 1 --recompute selective --optimizer-cpu-offload"
  "8b-fp8cs-offload-mbs2-full|--model llama3.1-8b --seq-length 4096 --global-batch-size 2 --micro-batch-size 2 --recipe $CS --recompute full --optimizer-cpu-offload"
  "8b-nvfp4-offload-mbs1-full|--model llama3.1-8b --seq-length 4096 --global-batch-size 2 --micro-batch-size 1 --recipe $FP4 --recompute full --optimizer-cpu-offload"
  "8b-lora-fp8-base|--model llama3.1-8b --peft lora --lora-base-precision fp8 --seq-length 4096 --global-batch-size 2 --micro-batch-size 1"
  "8b-lora-nvfp4-base|--model llama3.1-8b --peft lora --lora-base-precision nvfp4 --seq-length 4096 --global-batch-size 2 --micro-batch-size 1 --recompute selective"
)
if [ -n "$sft" ]; then
  configs+=(
    "1b-sft-packed-16k-bf16|sft --model llama3.2-1b --data-path $sft --seq-length 16384 --global-batch-size 2 --micro-batch-size 1"
    "3b-sft-packed-16k-fp8cs|sft --model llama3.2-3b --data-path $sft --seq-length 16384 --global-batch-size 2 --micro-batch-size 1 --recipe $CS --recompute full"
  )
fi
if [ -n "$tokenizer" ]; then
  configs+=(
    "1b-fp8cs-samples|--model llama3.2-1b --seq-length 4096 --global-batch-size 4 --micro-batch-size 1 --recipe $CS --sample-interval 2 --sample-tokens 16 --tokenizer $tokenizer"
  )
fi
two_rank=(
  "1b-bf16-distopt-2ranks|save=1 --model llama3.2-1b --seq-length 4096 --global-batch-size 4 --micro-batch-size 1 --use-distributed-optimizer"
  "3b-fp8cs-fsdp-2ranks|save=1 --model llama3.2-3b --seq-length 4096 --global-batch-size 4 --micro-batch-size 1 --recipe $CS --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"
)

# one NAME FLAGS...: the run and the same configuration's dry run, logs in OUT.
one() {
  local name=$1 spec=$2 cmd=train save=()
  read -r -a flags <<< "$spec"
  if [ "${flags[0]}" = sft ]; then cmd=finetune; flags=("${flags[@]:1}"); fi
  if [ "${flags[0]}" = save=1 ]; then flags=("${flags[@]:1}"); save=(--save "$out/$name.ckpt" --save-interval 3); fi
  local args=("${flags[@]}")
  [ "$cmd" = train ] && args+=("${common[@]}") || args+=(--train-iters 3 --eval-interval 2 --eval-iters 1 --log-interval 1)
  "$nb" "$cmd" "${args[@]}" "${save[@]}" > "$out/$name.log" 2>&1
  echo "exit=$?" >> "$out/$name.log"
  rm -rf "${out:?}/$name.ckpt"
  "$nb" "$cmd" --dry-run --gpu-memory "$gib" "${args[@]}" > "$out/$name.dry.log" 2>&1
  echo "exit=$?" >> "$out/$name.dry.log"
}

lane() {  # GPU, then the configurations of that lane
  local gpu=$1; shift
  for c in "$@"; do CUDA_VISIBLE_DEVICES=$gpu one "${c%%|*}" "${c#*|}"; done
}
chosen=()
for c in "${configs[@]}"; do [[ "${c%%|*}" =~ $only ]] && chosen+=("$c"); done
for ((g = 0; g < gpus; g++)); do
  mine=()
  for ((i = g; i < ${#chosen[@]}; i += gpus)); do mine+=("${chosen[$i]}"); done
  [ ${#mine[@]} -gt 0 ] && lane "${lanes[$g]}" "${mine[@]}" &
done
wait
if [ "$gpus" -ge 2 ] && [ "${MEMORY_TWO_RANK:-1}" = 1 ]; then
  for ((i = 0; i < ${#two_rank[@]} && 2 * i + 1 < gpus; i++)); do
    c=${two_rank[$i]}
    name=${c%%|*}
    read -r -a flags <<< "${c#*|}"
    save=()
    if [ "${flags[0]}" = save=1 ]; then flags=("${flags[@]:1}"); save=(--save "$out/$name.ckpt" --save-interval 3); fi
    (
      export CUDA_VISIBLE_DEVICES=${lanes[$((2 * i))]},${lanes[$((2 * i + 1))]}
      "$nb" train --nproc-per-node 2 "${flags[@]}" "${common[@]}" "${save[@]}" > "$out/$name.log" 2>&1
      echo "exit=$?" >> "$out/$name.log"
      rm -rf "${out:?}/$name.ckpt"
      "$nb" train --dry-run --nproc-per-node 2 --gpu-memory "$gib" "${flags[@]}" "${common[@]}" > "$out/$name.dry.log" 2>&1
      echo "exit=$?" >> "$out/$name.dry.log"
    ) &
  done
  wait
fi
echo "benchmark_memory: logs in $out"
