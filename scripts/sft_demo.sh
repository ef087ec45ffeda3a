#!/usr/bin/env bash
# A small real supervised fine-tuning run, from raw text to a loss plot:
#   1. scripts/sft_pairs.py turns the project's English corpus (the Linux kernel documentation, fetched by
#      scripts/setup_data.sh) into "Continue this passage:" prompt/answer pairs (NeMo JSONL);
#   2. nibble preprocess --sft tokenizes them with the Llama 3 tokenizer and Instruct template into token
#      and answer-mask datasets;
#   3. nibble finetune trains llama-125m on them for 150 steps (answer-token loss, packed rows),
#      validating on the last 5% of the pairs, which come from documents the training split never sees;
#   4. scripts/plot_losses.py draws the train and validation answer-loss to OUT/sft_loss.svg.
# The model starts from random weights: no pretrained Llama can be fetched here, so this is not a useful
# assistant. The point is that the answer loss falls on the training data and on held-out data alike.
#
#   bash scripts/sft_demo.sh [build-dir (default build)] [out-dir (default runs/sft)]
#
# Steps 1-2 are skipped when OUT already holds their datasets (delete OUT/pairs_* to rebuild them), so
# the data half can run on one machine and steps 3-4 on a GPU machine with OUT carried there. Without a
# GPU (or with a nibble built without CUDA) the script stops after the data half, says so, and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD="${1:-build}"
OUT="${2:-runs/sft}"
DATA="${NIBBLE_DATA_DIR:-$HOME/.cache/nibble}"
NIBBLE="$BUILD/nibble"
TOKENIZER="$DATA/llama3-tokenizer.json"
[ -x "$NIBBLE" ] || { echo "sft_demo: no $NIBBLE: build nibble first (cmake --preset default && cmake --build --preset default)" >&2; exit 1; }
mkdir -p "$OUT"

if [ -s "$OUT/pairs_tokens_document.idx" ] && [ -s "$OUT/pairs_mask_document.idx" ]; then
  echo "sft_demo: reusing $OUT/pairs_{tokens,mask}_document (delete $OUT/pairs_* to rebuild them from the corpus)"
else
  if [ ! -s "$DATA/corpus.jsonl" ] || [ ! -s "$TOKENIZER" ]; then bash scripts/setup_data.sh; fi
  # 1. Pairs: 128-word prompts, answers of at most 64 words (ended at a sentence end), at most 32 per document.
  python3 scripts/sft_pairs.py -i "$DATA/corpus.jsonl" -o "$OUT/pairs.jsonl" \
    --prompt-words 128 --answer-words 64 --max-pairs 12000 --max-per-doc 32 --seed 1234
  # 2. Token and answer-mask datasets: OUT/pairs_{tokens,mask}_document.{bin,idx} and OUT/pairs_sft_stats.json.
  "$NIBBLE" preprocess --sft -i "$OUT/pairs.jsonl" -o "$OUT/pairs" -t "$TOKENIZER" --seq-length 1024
fi

if ! nvidia-smi -L >/dev/null 2>&1 || "$NIBBLE" info | grep -q "built without CUDA"; then
  echo "sft_demo: no GPU (or $NIBBLE has no CUDA backend): the data half is done ($OUT/pairs_*)."
  echo "sft_demo: Fine-tuning llama-125m with the Llama 3 vocabulary (128,256 tokens) needs a GPU, so the"
  echo "sft_demo: training run and the plot are skipped; run this script again on a GPU machine."
  exit 0
fi

# 3. Fine-tune from random weights (no --load / --load-hf). --tokenizer only checks the vocabulary, so it is
# left out where the tokenizer file is absent (OUT carried to a GPU machine without the data cache).
# metrics.jsonl is appended to: start it afresh.
TOKENIZER_FLAG=()
if [ -s "$TOKENIZER" ]; then TOKENIZER_FLAG=(--tokenizer "$TOKENIZER"); fi
rm -f "$OUT/run/metrics.jsonl"
"$NIBBLE" finetune --model llama-125m --vocab-size 128256 "${TOKENIZER_FLAG[@]}" --data-path "$OUT/pairs" \
  --split 95,5,0 --seq-length 1024 --micro-batch-size 8 --global-batch-size 32 --train-iters 150 \
  --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 10 --eval-interval 25 --eval-iters 4 --log-interval 5 \
  --save "$OUT/run"

# 4. The plot.
python3 scripts/plot_losses.py "$OUT/run" -o "$OUT/sft_loss.svg" \
  --title "nibble finetune: llama-125m from random weights, continue-this-passage SFT" \
  --ylabel "answer-token loss (nats/token)"
