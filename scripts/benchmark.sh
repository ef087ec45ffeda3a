#!/usr/bin/env bash
# Usage: bash scripts/benchmark.sh [build-dir] [results-dir] [parts] [workloads]
# Runs nibble and the PyTorch peer on the standard workloads in one GPU job and regenerates
# BENCHMARKS.md. Usage (on a GPU machine, from the repository root, with a built nibble):
#   bash scripts/benchmark.sh [build-dir] [results-dir] [parts] [workloads]
# parts: a comma list of quant,gemm,train,recipes,peer,data,ckpt (default all); workloads: a comma list of
# proxy,deep,real1b,real3b (default all four): the protocol's two Llama-3.1-8B proxies and the real Llama 3.2
# 1B and 3B models (tied embeddings), all at seq 4096 with 8 micro-batches per step.
# ckpt writes llama3-8b-proxy checkpoints (about 23 GB each) under NIBBLE_BENCH_CKPT (default /tmp) and deletes them.
# NIBBLE_BENCH_MERGE=1 replaces only the sections this run measured in the existing BENCHMARKS.md.
# The data part needs NIBBLE_BENCH_DATA=<folder> holding shuf_gpt2_text_document.{bin,idx}, gpt2.tiktoken,
# llama3small_text_document.{bin,idx} and llama3.tiktoken (made by scripts/benchmark_data.sh on any machine). Results (logs, JSON) go to results-dir;
# BENCHMARKS.md is rewritten from whatever results-dir holds.
set -uo pipefail
build=${1:-build}
out=${2:-runs/bench}
parts=${3:-quant,gemm,train,recipes,peer,data,ckpt}
only=${4:-proxy,deep,real1b,real3b}
# name model micro-batch (global batch = 8 micro-batches)
workloads=("proxy llama3-8b-proxy 2" "deep llama3-8b-proxy-deep 1" "real1b llama3.2-1b 2" "real3b llama3.2-3b 1")
# A misspelt workload would otherwise run nothing and say nothing; checked before any GPU work.
IFS=, read -r -a wanted <<< "$only"
for t in "${wanted[@]}"; do
  [[ " ${workloads[*]%% *} " == *" $t "* ]] ||
    { echo "unknown workload '$t' (choose from proxy,deep,real1b,real3b)" >&2; exit 2; }
done
mkdir -p "$out"
nb="$build/nibble"
has() { [[ ",$parts," == *",$1,"* ]]; }
"$nb" info > "$out/info.txt" 2>&1
git rev-parse --short HEAD > "$out/commit.txt" 2>/dev/null || echo unknown > "$out/commit.txt"
if has quant; then "$nb" bench quant --markdown > "$out/quant.md" 2> "$out/quant.err"; fi
# The GEMM ceiling doubles as a check of the GPU: below its floor (600 TFLOP/s on Hopper) the run stops,
# because every later figure would be read against a broken ceiling.
if has gemm; then
  "$nb" bench gemm --in-loop --markdown > "$out/gemm.md" 2> "$out/gemm.err" || { cat "$out/gemm.err"; exit 1; }
fi
for w in "${workloads[@]}"; do
  read -r tag model mbs <<< "$w"
  [[ ",$only," == *",$tag,"* ]] || continue
  gbs=$((mbs * 8))
  if has train; then
    "$nb" train --model "$model" --micro-batch-size "$mbs" --global-batch-size "$gbs" --seq-length 4096 \
      --train-iters 6 --lr-warmup-iters 1 --log-interval 1 --save "$out/nibble-$tag-bf16" > "$out/nibble-$tag-bf16.log" 2>&1
  fi
  if has recipes; then
    # Every layer in the recipe's format (the presets' BF16 layer counts would leave few or none of the
    # proxies' 4-8 layers quantized), so the table shows what each format costs per layer.
    for recipe in bf16_with_fp8_current_scaling_mixed bf16_with_fp8_delayed_scaling_mixed \
                  bf16_with_fp8_subchannel_scaling_mixed bf16_with_mxfp8_mixed bf16_with_nvfp4_mixed; do
      "$nb" train --model "$model" --recipe "$recipe" --num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 0 \
        --micro-batch-size "$mbs" --global-batch-size "$gbs" --seq-length 4096 --train-iters 6 --lr-warmup-iters 1 \
        --log-interval 1 --save "$out/nibble-$tag-$recipe" > "$out/nibble-$tag-$recipe.log" 2>&1
    done
    # The emulated formats again with each weight dequantized once per step (speed for 2-4 bytes per weight).
    for recipe in bf16_with_mxfp8_mixed bf16_with_nvfp4_mixed; do
      "$nb" train --model "$model" --recipe "$recipe" --num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 0 \
        --emulated-weight-cache --micro-batch-size "$mbs" --global-batch-size "$gbs" --seq-length 4096 --train-iters 6 \
        --lr-warmup-iters 1 --log-interval 1 --save "$out/nibble-$tag-$recipe-cache" > "$out/nibble-$tag-$recipe-cache.log" 2>&1
    done
  fi
  if has peer; then
    for numerics in autocast bf16; do
      PYTHONUNBUFFERED=1 python3 bench/peer/torch_llama.py --model "$model" --micro-batch-size "$mbs" --micro-batches 8 \
        --numerics "$numerics" --steps 5 --warmup 2 > "$out/peer-$tag-$numerics.json" 2> "$out/peer-$tag-$numerics.err"
    done
  fi
done
if has data && [ -n "${NIBBLE_BENCH_DATA:-}" ]; then
  D=$NIBBLE_BENCH_DATA
  # Data-loader cost on the proxy with real Megatron data (Llama 3 tokens).
  "$nb" train --model llama3-8b-proxy --mock-data false --data-path "$D/llama3small_text_document" \
    --tokenizer "$D/llama3.tiktoken" --micro-batch-size 2 --global-batch-size 16 --seq-length 4096 --train-iters 4 \
    --log-interval 1 --save "$out/data-proxy" > "$out/data-proxy.log" 2>&1
  # Convergence on real text: llama-125m, GPT-2 tokens, under one epoch, validation every 50 steps.
  "$nb" train --model llama-125m --mock-data false --data-path "$D/shuf_gpt2_text_document" --tokenizer "$D/gpt2.tiktoken" \
    --seq-length 1024 --micro-batch-size 16 --global-batch-size 32 --train-iters 250 --lr 1e-3 --min-lr 1e-4 \
    --lr-warmup-iters 25 --eval-interval 50 --eval-iters 20 --log-interval 50 --save "$out/data-125m" > "$out/data-125m.log" 2>&1
fi
if has ckpt; then
  # Async checkpoints of llama3-8b-proxy (masters + AdamW, FP32): saves at iterations 4 and 8, the newest
  # kept; then a resume from the last one. The step stalls only for the device-to-host copy.
  ck="${NIBBLE_BENCH_CKPT:-/tmp}/nibble-ckpt-proxy"
  rm -rf "$ck"
  "$nb" train --model llama3-8b-proxy --micro-batch-size 2 --global-batch-size 16 --seq-length 4096 --train-iters 8 \
    --lr-warmup-iters 1 --log-interval 1 --save "$ck" --save-interval 4 --save-keep 1 > "$out/ckpt-proxy.log" 2>&1
  "$nb" train --model llama3-8b-proxy --micro-batch-size 2 --global-batch-size 16 --seq-length 4096 --train-iters 9 \
    --lr-warmup-iters 1 --log-interval 1 --load "$ck" > "$out/ckpt-proxy-resume.log" 2>&1
  du -sb "$ck"/iter_* > "$out/ckpt-proxy-du.txt" 2>&1
  rm -rf "$ck"
fi
if [ "${NIBBLE_BENCH_MERGE:-0}" = 1 ]; then
  python3 scripts/benchmark_report.py "$out" --merge-into BENCHMARKS.md && echo "BENCHMARKS.md: sections from $out merged"
else
  python3 scripts/benchmark_report.py "$out" > BENCHMARKS.md && echo "BENCHMARKS.md regenerated from $out"
fi
