#!/usr/bin/env bash
# Decode speed of `nibble generate` on one GPU beside transformers' generate (docs/GENERATE.md): a random
# llama3.2-1b in BF16 (the shape is what matters), prompts of GEN_PROMPT_LEN (default 128) random tokens,
# GEN_NEW_TOKENS (default 256) greedy tokens each, end tokens ignored, at batch 1 and 32, timed after one
# untimed warm-up run of the same batch (--warmup: plans, kernels and decode graphs made, as the peer's
# warm-up generate call does for transformers). Also a short training run of the same model and sequence
# length, for the prefill-vs-forward comparison. Writes logs to OUT; scripts/benchmark_generate_report.py merges a section into BENCHMARKS.md.
#   bash scripts/benchmark_generate.sh [build-dir] [OUT]
# Needs torch and transformers for the peer (scripts/benchmark_generate_peer.py).
set -uo pipefail
build=${1:-build}
out=${2:-runs/bench-generate}
parts=all
prompt_len=${GEN_PROMPT_LEN:-128}
new_tokens=${GEN_NEW_TOKENS:-256}
# shellcheck source=scripts/bench_common.sh
source "$(dirname "$0")/bench_common.sh"
here=$(dirname "$0")
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$out/gpu.txt" 2>&1 || true
python3 "$here/benchmark_generate_peer.py" make-model "$out/model" > "$out/make_model.log" 2>&1 || {
  echo "could not write the model (see $out/make_model.log)"; exit 1; }
for b in 1 32; do
  python3 "$here/benchmark_generate_peer.py" prompts "$out/prompts_b$b.jsonl" "$b" "$prompt_len"
  "$nb" generate --load-hf "$out/model" --prompts "$out/prompts_b$b.jsonl" --max-new-tokens "$new_tokens" \
    --ignore-eos --warmup --device cuda > "$out/nibble_b$b.log" 2>&1
  python3 "$here/benchmark_generate_peer.py" run "$out/model" "$out/prompts_b$b.jsonl" "$new_tokens" \
    > "$out/hf_b$b.log" 2>&1
done
# The training forward at the prefill's shape (batch 32 x prompt_len tokens): tokens/s of whole steps.
run train-1b --load-hf "$out/model" --seq-length "$prompt_len" --micro-batch-size 32 --global-batch-size 32 \
  --train-iters 6 --mock-data true
python3 "$here/benchmark_generate_report.py" "$out" --merge-into BENCHMARKS.md
