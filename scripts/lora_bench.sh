#!/usr/bin/env bash
# LoRA throughput and memory of NeMo's LoRA workload (Llama 3.1 70B, seq 4096, micro-batch 1, global batch
# 32) on one GPU, with a frozen base stored in NVFP4 or FP8. No 70B weights can be fetched, so the base is
# the seeded random init of the real shapes (speed and memory only; correctness: tests and parity script).
#   bash scripts/lora_bench.sh BUILD PRECISION [OUT] [MODEL] [ITERS]
# PRECISION: nvfp4 | fp8 | bf16. Writes OUT/lora_<model>_<precision>.log; the summary table at its end
# has tokens/s/GPU (mean of the steps after the first) and peak memory.
set -euo pipefail
build=${1:?usage: lora_bench.sh BUILD PRECISION [OUT] [MODEL] [ITERS]}
precision=${2:?precision: nvfp4, fp8 or bf16}
out=${3:-runs/lora_bench}
model=${4:-llama3.1-70b}
iters=${5:-2}
mkdir -p "$out"
log="$out/lora_${model}_${precision}.log"
"$build/nibble" train --model "$model" --peft lora --lora-rank 32 --lora-alpha 32 \
  --lora-base-precision "$precision" --seq-length 4096 --micro-batch-size 1 --global-batch-size 32 \
  --train-iters "$iters" --recompute full --lr 1e-4 --log-interval 1 --device cuda 2>&1 | tee "$log"
grep -E "tokens/s/GPU|peak memory|memory estimate|quantized copies" "$log" | tail -4
