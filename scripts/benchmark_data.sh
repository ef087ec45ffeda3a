#!/usr/bin/env bash
# Prepares the real-data inputs of scripts/benchmark.sh and measures `nibble preprocess` throughput on
# this machine (written to RESULTS/preprocess.md for BENCHMARKS.md). Usage:
#   bash scripts/benchmark_data.sh [build-dir] [data-dir] [results-dir]
# Needs the corpus and tokenizers of scripts/setup_data.sh. The corpus documents are shuffled with a
# fixed seed first: the Debian corpus is ordered by folder, so a contiguous validation split would be
# a different domain (translations) from the training split.
set -euo pipefail
build=${1:-build}
data=${2:-runs/bench-data}
out=${3:-runs/bench}
cache=${NIBBLE_DATA_DIR:-$HOME/.cache/nibble}
mkdir -p "$data" "$out"
python3 - "$cache/corpus.jsonl" "$data" <<'PY'
import random, sys
lines = open(sys.argv[1], encoding="utf-8").read().splitlines()
random.Random(0).shuffle(lines)
def take(limit):
    out, size = [], 0
    for l in lines:
        if size > limit: break
        out.append(l); size += len(l.encode()) + 1
    return "\n".join(out) + "\n"
open(sys.argv[2] + "/shuf24m.jsonl", "w", encoding="utf-8").write(take(24_000_000))
open(sys.argv[2] + "/shuf6m.jsonl", "w", encoding="utf-8").write(take(6_000_000))
PY
cp "$cache/gpt2.tiktoken" "$cache/llama3.tiktoken" "$data/"
nproc_=$(nproc)
{
  echo "\`nibble preprocess\` on this machine ($nproc_ cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)), 24 MB of English prose (Linux kernel documentation from Debian's linux-doc), \`--workers $nproc_ --append-eod\`:"
  echo
  echo "| tokenizer | documents | tokens | MB/s of text |"
  echo "|---|---:|---:|---:|"
  for tok in gpt2 llama3; do
    line=$("$build/nibble" preprocess -i "$data/shuf24m.jsonl" -o "$data/shuf_$tok" -t "$data/$tok.tiktoken" --append-eod -j "$nproc_" 2>&1 | tail -1)
    docs=$(echo "$line" | sed -E 's/.*: ([0-9]+) documents.*/\1/')
    toks=$(echo "$line" | sed -E 's/.* ([0-9]+) tokens.*/\1/')
    mbs=$(echo "$line" | sed -E 's/.* ([0-9.]+) MB\/s.*/\1/')
    echo "| $tok | $docs | $toks | $mbs |"
  done
} > "$out/preprocess.md"
"$build/nibble" preprocess -i "$data/shuf6m.jsonl" -o "$data/llama3small" -t "$data/llama3.tiktoken" --append-eod >/dev/null 2>&1
rm -f "$data"/shuf_llama3_text_document.* "$data"/*.jsonl
cat "$out/preprocess.md"
