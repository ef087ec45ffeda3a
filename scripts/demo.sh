#!/usr/bin/env bash
# Builds nibble and runs its main job: pretraining a small Llama on Megatron-style mock data.
# On a GPU: the ~115M-parameter llama-125m preset; without one, nibble's CPU backend trains the
# tiny preset (about a minute on two cores) and says so. Also prints `nibble info` and an NVFP4
# quantization report of a heavy-tailed random tensor, and ends with a sample: a small BPE tokenizer is
# trained on the repository's docs and the run prints a greedy continuation at its last step
# (--sample-interval; on mock data the model learns no language, so the text shows the mechanics only).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake --preset default >/dev/null
cmake --build --preset default -j "$(nproc)"
./build/nibble info
mkdir -p runs
./build/nibble quant --random 1024,1024 --dist outliers --format nvfp4 --rht --sr --seed 1234 --out runs/demo_nvfp4.safetensors
./build/nibble tokenizer train -i README.md docs/*.md --vocab-size 512 -o runs/demo_tokenizer.json
sample=(--tokenizer runs/demo_tokenizer.json --sample-prompt "The model" --sample-tokens 24)
if nvidia-smi -L >/dev/null 2>&1; then
  ./build/nibble train --model llama-125m --seq-length 1024 --micro-batch-size 8 --global-batch-size 32 \
    --train-iters 100 --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 10 --log-interval 10 --save runs/demo \
    --sample-interval 100 "${sample[@]}"
else
  echo "demo: no GPU found: training the tiny preset on nibble's CPU backend instead"
  ./build/nibble train --device cpu --model tiny --vocab-size 512 --seq-length 128 --micro-batch-size 8 \
    --global-batch-size 16 --train-iters 80 --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 8 --log-interval 10 \
    --save runs/demo --sample-interval 80 "${sample[@]}"
fi
grep '"sample"' runs/demo/metrics.jsonl | tail -1
