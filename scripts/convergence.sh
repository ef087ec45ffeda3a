#!/usr/bin/env bash
# The numerics study (CONVERGENCE.md): llama-125m trained on the study corpus (scripts/setup_study_data.sh)
# in each precision configuration, every run under one epoch. Runs accumulate: each finished run's metrics
# go to bench/convergence/runs/<config>-s<seed>/ (metrics.jsonl thinned to what the report reads, meta.json),
# and `report` regenerates CONVERGENCE.md and its plots from everything stored there.
#
#   bash scripts/convergence.sh list                      configurations and their flags
#   bash scripts/convergence.sh prepare TOKENIZER CORPUS.xz [MORE_PARTS...]   tokenize the corpus into
#                                                          $STUDY_DATA (parts: `split` pieces of one .xz)
#   bash scripts/convergence.sh run CONFIG SEED [OUTDIR]  one run (needs a GPU), metrics into OUTDIR
#   bash scripts/convergence.sh batch BUDGET_S OUTDIR CONFIG:SEED ...   runs in order while the next one
#                                                          still fits in BUDGET_S seconds (its estimate:
#                                                          the longest run so far, or 330 s)
#   bash scripts/convergence.sh report                    CONVERGENCE.md + bench/convergence/*.svg
# Environment: NIBBLE (the binary, default build/nibble), STUDY_DATA (default runs/study-data),
# STUDY_TOKENS (tokens per run, default 100M), STUDY_STATS_INTERVAL (--quant-stats interval, default 100),
# STUDY_COMMIT (the commit the binary was built from, when the tree is not a git checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
NIBBLE="${NIBBLE:-build/nibble}"
DATA="${STUDY_DATA:-runs/study-data}"
TOKENS="${STUDY_TOKENS:-100000000}"
SEQ=1024
GBS=64
MBS=16
ITERS=$(((TOKENS + SEQ * GBS - 1) / (SEQ * GBS)))

# The paper keeps about 15% of the blocks in BF16 (the last ones); of llama-125m's 12 that is 2.
NVFP4="--recipe bf16_with_nvfp4_mixed --num-layers-at-end-in-bf16 2"
config_flags() {
  case "$1" in
    bf16) echo "--recipe bf16_mixed" ;;
    fp8) echo "--recipe bf16_with_fp8_current_scaling_mixed" ;;
    mxfp8) echo "--recipe bf16_with_mxfp8_mixed" ;;
    nvfp4) echo "$NVFP4 --quant-stats" ;;
    nvfp4_all) echo "--recipe bf16_with_nvfp4_mixed --num-layers-at-end-in-bf16 0 --quant-stats" ;;
    nvfp4_no_rht) echo "$NVFP4 --fp4-disable-rht" ;;
    nvfp4_no_sr) echo "$NVFP4 --fp4-disable-sr" ;;
    nvfp4_no_2d) echo "$NVFP4 --fp4-disable-2d" ;;
    nvfp4_none) echo "$NVFP4 --fp4-disable-rht --fp4-disable-sr --fp4-disable-2d" ;;
    nvfp4_anneal) echo "$NVFP4 --anneal-start-fraction 0.8 --anneal-recipe bf16_mixed" ;;
    # 4/6 on weights + activations. nvfp4_4over6 ran with the squared error (the only rule before issue 31);
    # nvfp4_4over6_mae uses TransformerEngine's default, the absolute error.
    nvfp4_4over6) echo "$NVFP4 --fp4-4over6 all --fp4-4over6-err-mode mse" ;;
    nvfp4_4over6_mae) echo "$NVFP4 --fp4-4over6 all --fp4-4over6-err-mode mae" ;;
    *) echo "unknown configuration '$1'; see: bash scripts/convergence.sh list" >&2; return 1 ;;
  esac
}
CONFIGS="bf16 fp8 mxfp8 nvfp4 nvfp4_all nvfp4_no_rht nvfp4_no_sr nvfp4_no_2d nvfp4_none nvfp4_anneal nvfp4_4over6 nvfp4_4over6_mae"

prepare() {
  local tok="$1"
  shift
  if [ -s "$DATA/study_text_document.idx" ]; then return 0; fi
  mkdir -p "$DATA"
  cp "$tok" "$DATA/tokenizer.tiktoken"
  cat "$@" > "$DATA/study.jsonl.xz"
  if command -v xz >/dev/null; then xz -dc "$DATA/study.jsonl.xz" > "$DATA/study.jsonl"; else
    python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" \
      "$DATA/study.jsonl.xz" "$DATA/study.jsonl"
  fi
  rm -f "$DATA/study.jsonl.xz"
  "$NIBBLE" preprocess -i "$DATA/study.jsonl" -o "$DATA/study" -t "$DATA/tokenizer.tiktoken" --append-eod -j "$(nproc)"
  rm -f "$DATA/study.jsonl"
}

# The report reads: training lines (iteration, lm_loss, grad_norm, step_ms), validation lines, quantization
# statistics and annealing records; everything else of metrics.jsonl is dropped to keep the stored runs small.
thin_metrics() {
  python3 - "$1" "$2" <<'PY'
import json, sys
keep = ("iteration", "lm_loss", "grad_norm", "step_ms", "tokens_per_s_per_gpu")
with open(sys.argv[1]) as f, open(sys.argv[2], "w") as out:
    for line in f:
        r = json.loads(line)
        if "lm_loss" in r:
            r = {k: r[k] for k in keep if k in r}
        out.write(json.dumps(r, separators=(",", ":")) + "\n")
PY
}

# Binaries from before --quant-stats-interval took the statistics every --log-interval (also 100 here).
stats_interval() {
  case "$1" in *--quant-stats*) "$NIBBLE" train --help | grep -q -- --quant-stats-interval &&
    echo "--quant-stats-interval ${STUDY_STATS_INTERVAL:-100}" ;; esac
  return 0
}

run_one() {
  local config="$1" seed="$2" out="${3:-bench/convergence/runs}"
  local flags name dir t0
  flags=$(config_flags "$config")
  name="$config-s$seed"
  dir="runs/convergence/$name"
  rm -rf "$dir" && mkdir -p "$dir" "$out/$name"
  t0=$(date +%s)
  # shellcheck disable=SC2086
  "$NIBBLE" train --model llama-125m --seq-length $SEQ --micro-batch-size $MBS --global-batch-size $GBS \
    --train-iters "$ITERS" --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 150 --lr-decay-style cosine \
    --weight-decay 0.1 --clip-grad 1.0 --seed "$seed" --mock-data false --data-path "$DATA/study_text_document" \
    --tokenizer "$DATA/tokenizer.tiktoken" --split 969,30,1 --eval-interval 100 --eval-iters 10 \
    --log-interval 100 --save "$dir" $flags $(stats_interval "$flags") > "$dir/train.log" 2>&1 ||
    { tail -5 "$dir/train.log" >&2; return 1; }
  thin_metrics "$dir/metrics.jsonl" "$out/$name/metrics.jsonl"
  cp "$dir/train.log" "$out/$name/train.log"
  python3 - "$out/$name/meta.json" "$config" "$seed" "$ITERS" "$((ITERS * SEQ * GBS))" "$flags" "$(($(date +%s) - t0))" \
    "$(grep -m1 '^| device' "$dir/train.log" | cut -d'|' -f3 || true)" "${STUDY_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" <<'PY'
import json, sys
a = sys.argv
json.dump({"config": a[2], "seed": int(a[3]), "iterations": int(a[4]), "tokens": int(a[5]), "flags": a[6],
           "wall_s": int(a[7]), "device": a[8].strip(), "commit": a[9], "model": "llama-125m",
           "seq_length": 1024, "global_batch": 64}, open(a[1], "w"), indent=1)
PY
  echo "$name: done in $(($(date +%s) - t0)) s"
}

batch() {
  local budget="$1" out="$2"
  shift 2
  local start longest=330 t0 took
  start=$(date +%s)
  for cs in "$@"; do
    if [ $(($(date +%s) - start + longest)) -gt "$budget" ]; then
      echo "skipped $cs: the next run needs about ${longest} s and $((budget - $(date +%s) + start)) s remain"
      continue
    fi
    t0=$(date +%s)
    run_one "${cs%%:*}" "${cs##*:}" "$out" || echo "FAILED $cs"
    took=$(($(date +%s) - t0))
    [ "$took" -gt "$longest" ] && longest=$took
  done
}

case "${1:-}" in
  list) for c in $CONFIGS; do printf '%-14s %s\n' "$c" "$(config_flags "$c")"; done ;;
  prepare) shift; prepare "$@" ;;
  run) run_one "$2" "$3" "${4:-bench/convergence/runs}" ;;
  batch) shift; batch "$@" ;;
  report) python3 scripts/convergence_report.py bench/convergence ;;
  *) sed -n '2,17p' "$0"; exit 2 ;;
esac
