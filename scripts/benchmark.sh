#!/usr/bin/env bash
# Usage: bash scripts/benchmark.sh [build-dir] [results-dir] [parts] [workloads]
# Runs nibble and the PyTorch peer on the standard workloads in one GPU job and regenerates
# BENCHMARKS.md. Usage (on a GPU machine, from the repository root, with a built nibble):
#   bash scripts/benchmark.sh [build-dir] [results-dir] [parts]
# parts: a comma list of quant,gemm,train,peer (default all); workloads: proxy,deep (default both). Results (logs, JSON) go to results-dir;
# BENCHMARKS.md is rewritten from whatever results-dir holds.
set -uo pipefail
build=${1:-build}
out=${2:-runs/bench}
parts=${3:-quant,gemm,train,peer}
only=${4:-proxy,deep}
mkdir -p "$out"
nb="$build/nibble"
has() { [[ ",$parts," == *",$1,"* ]]; }
"$nb" info > "$out/info.txt" 2>&1
git rev-parse --short HEAD > "$out/commit.txt" 2>/dev/null || echo unknown > "$out/commit.txt"
if has quant; then "$nb" bench quant --markdown > "$out/quant.md" 2> "$out/quant.err"; fi
if has gemm; then "$nb" bench gemm --markdown > "$out/gemm.md" 2> "$out/gemm.err"; fi
# name model micro-batch
workloads=("proxy llama3-8b-proxy 2" "deep llama3-8b-proxy-deep 1")
for w in "${workloads[@]}"; do
  read -r tag model mbs <<< "$w"
  [[ ",$only," == *",$tag,"* ]] || continue
  gbs=$((mbs * 8))
  if has train; then
    "$nb" train --model "$model" --micro-batch-size "$mbs" --global-batch-size "$gbs" --seq-length 4096 \
      --train-iters 6 --lr-warmup-iters 1 --log-interval 1 --save "$out/nibble-$tag-bf16" > "$out/nibble-$tag-bf16.log" 2>&1
  fi
  if has peer; then
    for numerics in autocast bf16; do
      PYTHONUNBUFFERED=1 python3 bench/peer/torch_llama.py --model "$model" --micro-batch-size "$mbs" --micro-batches 8 \
        --numerics "$numerics" --steps 5 --warmup 2 > "$out/peer-$tag-$numerics.json" 2> "$out/peer-$tag-$numerics.err"
    done
  fi
done
python3 scripts/benchmark_report.py "$out" > BENCHMARKS.md && echo "BENCHMARKS.md regenerated from $out"
