#!/usr/bin/env bash
# The numerics study (CONVERGENCE.md): llama-125m trained on the study corpus (scripts/setup_study_data.sh)
# in each precision configuration, every run under one epoch. Runs accumulate: each finished run's metrics
# go to bench/convergence/runs/<config>-s<seed>/ (metrics.jsonl thinned to what the report reads, meta.json,
# and the final model's loss on the whole validation split and on the held-out test set, eval_valid.json and
# eval_heldout.json), and `report` regenerates CONVERGENCE.md and its plots from everything stored there.
# Every run trains with --deterministic-mode (meta.json: "deterministic": true) and saves its final checkpoint,
# which `nibble eval` scores and which is then deleted (STUDY_KEEP_CHECKPOINT=1 keeps it).
#
#   bash scripts/convergence.sh list                      configurations and their flags
#   bash scripts/convergence.sh prepare TOKENIZER CORPUS.xz [MORE_PARTS...]   tokenize the corpus into
#                                                          $STUDY_DATA (parts: `split` pieces of one .xz)
#   bash scripts/convergence.sh prepare-heldout TOKENIZER HELDOUT.jsonl.xz   tokenize the held-out test set
#                                                          (scripts/setup_study_data.sh) into $STUDY_DATA
#   bash scripts/convergence.sh run CONFIG SEED [OUTDIR]  one run (needs a GPU), metrics into OUTDIR
#   bash scripts/convergence.sh batch BUDGET_S OUTDIR CONFIG:SEED ...   runs in order while the next one
#                                                          still fits in BUDGET_S seconds (its estimate:
#                                                          the longest run so far, or 330 s); with
#                                                          STUDY_GPUS=N, N queues run side by side, one per
#                                                          GPU, the runs dealt out in turn
#   bash scripts/convergence.sh report                    CONVERGENCE.md + bench/convergence/*.svg
#   bash scripts/convergence.sh pending                   the CONFIG:SEED runs still to make (seeds 1-3 of
#                                                          every configuration, deterministic and scored on the
#                                                          held-out set), on one line for `batch`
# Environment: NIBBLE (the binary, default build/nibble), STUDY_DATA (default runs/study-data),
# STUDY_TOKENS (tokens per run, default 100M), STUDY_STATS_INTERVAL (--quant-stats interval, default 100),
# STUDY_WORK (where runs train, default runs/convergence), STUDY_GPUS (batch: GPUs to spread the runs over, one
# queue per GPU, default 1), STUDY_COMMIT (the commit the binary was built from, when the tree is not a git checkout),
# STUDY_DETERMINISTIC=0 (train without --deterministic-mode; meta.json says so), STUDY_HELDOUT=0 (no evaluation
# of the final model), STUDY_KEEP_CHECKPOINT=1. For a smoke test of this script on a CPU only (such runs are not
# the study's): STUDY_SEQ, STUDY_GBS, STUDY_MBS (default 1024, 64, 16) and STUDY_TRAIN_FLAGS (appended to the
# train command, e.g. "--num-layers 2"). STUDY_TIME_LIMIT_S=N (run, batch): a run's training gets SIGTERM after N
# seconds, saves a checkpoint and pauses (exit status 3, "PAUSED" in a batch); the same command later continues it
# from there, bit for bit as if uninterrupted (meta.json lists the iterations it paused at): for machines lent in
# pieces shorter than a run.
set -euo pipefail
cd "$(dirname "$0")/.."
NIBBLE="${NIBBLE:-build/nibble}"
DATA="${STUDY_DATA:-runs/study-data}"
TOKENS="${STUDY_TOKENS:-100000000}"
SEQ="${STUDY_SEQ:-1024}"
GBS="${STUDY_GBS:-64}"
MBS="${STUDY_MBS:-16}"
MODEL=llama-125m
DETERMINISTIC="${STUDY_DETERMINISTIC:-1}"
HELDOUT="${STUDY_HELDOUT:-1}"
ITERS=$(((TOKENS + SEQ * GBS - 1) / (SEQ * GBS)))
# What the trainer prints once a SIGTERM's checkpoint is written (STUDY_TIME_LIMIT_S's pause), up to its iteration.
PAUSED_LINE='SIGTERM received: checkpoint of iteration [0-9]*'

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
    # Mixture of Representations (docs/MOR.md), tensor level, deciding every step: E4M3 or BF16; and the NVFP4 ladder
    # (NVFP4, E4M3 or BF16), which keeps no block BF16 by position.
    mor_fp8) echo "--recipe bf16_with_mor_fp8_mixed" ;;
    mor_nvfp4) echo "--recipe bf16_with_mor_nvfp4_mixed" ;;
    # The block rule: each 128x128 block E4M3 or BF16 inside its quantization (GAM scales, no lag).
    mor_fp8_block) echo "--recipe bf16_with_mor_fp8_mixed --mor-granularity block" ;;
    # The NVFP4 ladder per 128x128 block: NVFP4 (16x16 tiles, SR on gradients, no RHT), else E4M3, else BF16.
    mor_nvfp4_block) echo "--recipe bf16_with_mor_nvfp4_mixed --mor-granularity block" ;;
    # The same with the NVFP4 recipe's 1x16 blocks on X and dY (a row and a column copy each, decided per block).
    mor_nvfp4_block_rows) echo "--recipe bf16_with_mor_nvfp4_mixed --mor-granularity block --mor-nvfp4-rows" ;;
    # The tensor rule without its one-step lag: the host reads each quantization's statistic back (slower; a study's
    # control for what the lag changes).
    mor_fp8_now) echo "--recipe bf16_with_mor_fp8_mixed --mor-decide-now" ;;
    # The tensor rule as mor_fp8, also measuring each operand's error with per-row (per-channel) E4M3 scales: the
    # paper's per-channel share at this scale, decisions unchanged.
    mor_fp8_channel) echo "--recipe bf16_with_mor_fp8_mixed --mor-channel-statistic" ;;
    *) echo "unknown configuration '$1'; see: bash scripts/convergence.sh list" >&2; return 1 ;;
  esac
}
CONFIGS="bf16 fp8 mxfp8 nvfp4 nvfp4_all nvfp4_no_rht nvfp4_no_sr nvfp4_no_2d nvfp4_none nvfp4_anneal nvfp4_4over6 nvfp4_4over6_mae mor_fp8 mor_nvfp4 mor_fp8_block mor_fp8_now mor_fp8_channel mor_nvfp4_block mor_nvfp4_block_rows"

# The token count of a Megatron .idx: the sum of its sequence lengths (int32, after a 34-byte header).
idx_tokens() {
  python3 - "$1" <<'PY'
import struct, sys
with open(sys.argv[1], "rb") as f:
    n = struct.unpack("<Q", f.read(34)[18:26])[0]
    print(sum(struct.unpack(f"<{n}i", f.read(4 * n))))
PY
}

# Says so when the tokenized corpus is not the one the stored runs trained on (bench/convergence/corpus.json):
# Debian revises packages, and new runs then pair with the stored ones only approximately (CONVERGENCE.md).
check_corpus() {
  local have want
  have=$(idx_tokens "$DATA/study_text_document.idx")
  want=$(python3 -c "import json; print(json.load(open('bench/convergence/corpus.json'))['tokens'])" 2>/dev/null || echo "")
  if [ -n "$want" ] && [ "$have" != "$want" ]; then
    echo "convergence.sh: warning: this corpus has $have tokens, the stored runs' $want (bench/convergence/corpus.json):" \
      "new runs will pair with them only approximately; the report names such runs" >&2
  fi
  return 0
}

prepare() {
  local tok="$1"
  shift
  if [ -s "$DATA/study_text_document.idx" ]; then check_corpus; return 0; fi
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
  check_corpus
}

# The held-out test set: another Debian package's text (scripts/setup_study_data.sh), the study's tokenizer.
prepare_heldout() {
  local tok="$1" xzfile="$2"
  if [ -s "$DATA/heldout_text_document.idx" ]; then return 0; fi
  mkdir -p "$DATA"
  python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" \
    "$xzfile" "$DATA/heldout.jsonl"
  "$NIBBLE" preprocess -i "$DATA/heldout.jsonl" -o "$DATA/heldout" -t "$tok" --append-eod -j "$(nproc)"
  rm -f "$DATA/heldout.jsonl"
}

# The final model's mean token loss (the trainer's "lm loss") on a whole dataset split, in BF16 on the GPU
# (`nibble eval --data-path`: packed samples of SEQ tokens as the trainer builds them, fixed sample order):
# the validation split (969,30,1 as in training) and the held-out set (all of it: split 0,1,0).
eval_final() {
  local dir="$1" dest="$2" set
  for set in valid heldout; do
    if [ "$set" = valid ]; then
      "$NIBBLE" eval --load "$dir" --data-path "$DATA/study_text_document" --split 969,30,1 --seq-length "$SEQ" \
        --out "$dir/eval_$set.json" > "$dir/eval_$set.log" 2>&1
    else
      "$NIBBLE" eval --load "$dir" --data-path "$DATA/heldout_text_document" --split 0,1,0 --seq-length "$SEQ" \
        --out "$dir/eval_$set.json" > "$dir/eval_$set.log" 2>&1
    fi || { tail -5 "$dir/eval_$set.log" >&2; return 1; }
    # Stored: the figures and the device, not the paths of the machine that ran it.
    python3 - "$dir/eval_$set.json" "$dest/eval_$set.json" "$set" <<'PY' || return 1
import json, sys
r = json.load(open(sys.argv[1]))
d = {k: r["data"][k] for k in ("samples", "tokens", "nll", "mean_nll", "token_perplexity", "split", "seq_length")}
json.dump({"set": sys.argv[3], "device": r.get("device"), **d}, open(sys.argv[2], "w"), indent=1)
PY
  done
}

# Refuses a run that could not count for the study (no deterministic mode, no held-out set) unless asked.
check_run_inputs() {
  # The help text is read whole (grep -c, not -q): with pipefail, a grep that quits early fails the pipe.
  if [ "$DETERMINISTIC" = 1 ] && ! "$NIBBLE" train --help 2>&1 | grep -c -- --deterministic-mode >/dev/null; then
    echo "convergence.sh: $NIBBLE has no --deterministic-mode (STUDY_DETERMINISTIC=0 runs without it)" >&2
    return 1
  fi
  if [ "$HELDOUT" = 1 ] && [ ! -s "$DATA/heldout_text_document.idx" ]; then
    echo "convergence.sh: no held-out set in $DATA: run prepare-heldout first (or STUDY_HELDOUT=0)" >&2
    return 1
  fi
  return 0
}

# The report reads: training lines (iteration, lm_loss, grad_norm, step_ms, MoR's format shares), validation lines,
# quantization statistics and annealing records, and MoR's decisions (its per-Linear records of every 100th step,
# where the fallbacks land); everything else of metrics.jsonl is dropped to keep the stored runs small.
thin_metrics() {
  python3 - "$1" "$2" <<'PY'
import json, sys
keep = ("iteration", "lm_loss", "grad_norm", "step_ms", "tokens_per_s_per_gpu", "mor_fp8_operands", "mor_fp8_gemms",
        "mor_nvfp4_operands", "mor_nvfp4_gemms", "mor_fp8_blocks", "mor_e5m2_blocks", "mor_nvfp4_blocks")
with open(sys.argv[1]) as f, open(sys.argv[2], "w") as out:
    for line in f:
        r = json.loads(line)
        if "lm_loss" in r:
            r = {k: r[k] for k in keep if k in r}
        elif r.get("input", {}).get("format") == "blocks":
            pass  # the block rule's records come every --log-interval already
        elif ("mor_linear" in r or "mor_decide_ms" in r) and r.get("iteration", 0) % 100 != 1:
            continue
        out.write(json.dumps(r, separators=(",", ":")) + "\n")
PY
}

# Binaries from before --quant-stats-interval took the statistics every --log-interval (also 100 here).
stats_interval() {
  case "$1" in *--quant-stats*) "$NIBBLE" train --help 2>&1 | grep -c -- --quant-stats-interval >/dev/null &&
    echo "--quant-stats-interval ${STUDY_STATS_INTERVAL:-100}" ;; esac
  return 0
}

# After the trainer exited non-zero: a stop by STUDY_TIME_LIMIT_S's SIGTERM (its checkpoint saved) pauses the run,
# to be continued by the same command (returns 3); anything else is a failure (returns 1).
paused_or_failed() {
  local dir="$1" name="$2" took="$3" flags="$4" from="$5" it
  # Only this piece's part of the log counts: an earlier piece's pause is no excuse for this one's failure.
  it=$(tail -c +"$((from + 1))" "$dir/train.log" | grep -o "$PAUSED_LINE" |
    tail -1 | grep -o '[0-9]*$' || true)
  # The trainer says so only after its checkpoint is written; the tracker must name it too.
  if [ -z "$it" ] || [ "$(cat "$dir/latest_checkpointed_iteration.txt" 2>/dev/null)" != "$it" ]; then
    tail -5 "$dir/train.log" >&2
    return 1
  fi
  echo "$took" > "$dir/train_s"
  echo "$flags" > "$dir/paused"
  echo "$name: paused at iteration $it after $took s of training (STUDY_TIME_LIMIT_S); the same command continues it"
  return 3
}

run_one() {
  local config="$1" seed="$2" out="${3:-bench/convergence/runs}"
  local flags name dir stage t0 train_s stats
  flags=$(config_flags "$config") || return 1
  check_run_inputs || return 1
  if [ "$DETERMINISTIC" = 1 ]; then flags="$flags --deterministic-mode"; fi
  name="$config-s$seed"
  dir="${STUDY_WORK:-runs/convergence}/$name"
  stage="$dir.store"  # the stored run is assembled here and replaces $out/$name only when everything worked
  # A run paused by STUDY_TIME_LIMIT_S continues from its checkpoint (resume is bit for bit: TESTING.md), its train.log
  # and metrics.jsonl appended to; anything else starts afresh.
  local resume=() done_s=0
  if [ -f "$dir/paused" ] && [ "$(cat "$dir/paused")" = "$flags ${STUDY_TRAIN_FLAGS:-}" ]; then
    resume=(--load "$dir")
    done_s=$(cat "$dir/train_s")
    echo "$name: continuing from $(cat "$dir/latest_checkpointed_iteration.txt" 2>/dev/null || echo '?')"
  else
    rm -rf "$dir" && mkdir -p "$dir"
  fi
  rm -rf "$stage" && mkdir -p "$stage"
  t0=$(date +%s)
  local log_from
  log_from=$(stat -c %s "$dir/train.log" 2>/dev/null || echo 0)
  # --save-interval ITERS: one checkpoint, the final model's, for the evaluation.
  local extra=()
  if [ "$HELDOUT" = 1 ]; then extra+=(--save-interval "$ITERS"); fi
  read -r -a stats <<< "$(stats_interval "$flags")"
  extra+=("${stats[@]}")
  # With STUDY_TIME_LIMIT_S the trainer gets SIGTERM after that many seconds: it saves a checkpoint and stops.
  local limit=()
  if [ -n "${STUDY_TIME_LIMIT_S:-}" ]; then limit=(timeout -s TERM -k 300 "$STUDY_TIME_LIMIT_S"); fi
  # shellcheck disable=SC2086
  "${limit[@]}" "$NIBBLE" train --model $MODEL --seq-length $SEQ --micro-batch-size $MBS --global-batch-size $GBS \
    --train-iters "$ITERS" --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters $((ITERS < 150 ? ITERS : 150)) --lr-decay-style cosine \
    --weight-decay 0.1 --clip-grad 1.0 --seed "$seed" --mock-data false --data-path "$DATA/study_text_document" \
    --tokenizer "$DATA/tokenizer.tiktoken" --split 969,30,1 --eval-interval 100 --eval-iters 10 \
    --log-interval 100 --save "$dir" "${resume[@]}" "${extra[@]}" $flags ${STUDY_TRAIN_FLAGS:-} >> "$dir/train.log" 2>&1 ||
    paused_or_failed "$dir" "$name" $((done_s + $(date +%s) - t0)) "$flags ${STUDY_TRAIN_FLAGS:-}" "$log_from" ||
    return $?
  train_s=$((done_s + $(date +%s) - t0))
  rm -f "$dir/paused"
  if [ "$HELDOUT" = 1 ]; then
    eval_final "$dir" "$stage" || return 1
    if [ "${STUDY_KEEP_CHECKPOINT:-0}" != 1 ]; then rm -rf "$dir"/iter_*; fi
  fi
  thin_metrics "$dir/metrics.jsonl" "$stage/metrics.jsonl" || return 1
  cp "$dir/train.log" "$stage/train.log"
  python3 - "$stage/meta.json" "$config" "$seed" "$ITERS" "$((ITERS * SEQ * GBS))" "$flags ${STUDY_TRAIN_FLAGS:-}" \
    "$train_s" "$(grep -m1 '^| device' "$dir/train.log" | cut -d'|' -f3 || true)" \
    "${STUDY_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" "$MODEL" "$SEQ" "$GBS" \
    "$DETERMINISTIC" "$(($(date +%s) - t0 - train_s + done_s))" "$(idx_tokens "$DATA/study_text_document.idx")" \
    "$(grep -o "$PAUSED_LINE" "$dir/train.log" | grep -o '[0-9]*$' | tr '\n' ' ' || true)" \
    <<'PY' || return 1
import json, sys
a = sys.argv
json.dump({"config": a[2], "seed": int(a[3]), "iterations": int(a[4]), "tokens": int(a[5]), "flags": a[6].strip(),
           "wall_s": int(a[7]), "device": a[8].strip(), "commit": a[9], "model": a[10],
           "seq_length": int(a[11]), "global_batch": int(a[12]), "deterministic": a[13] == "1",
           "eval_s": int(a[14]), "corpus_tokens": int(a[15]),
           **({"paused_at": [int(i) for i in a[16].split()]} if a[16].split() else {})}, open(a[1], "w"), indent=1)
PY
  mkdir -p "$out" && rm -rf "${out:?}/$name" && mv "$stage" "$out/$name"
  echo "$name: done in $(($(date +%s) - t0)) s"
}

# One queue of runs on the visible GPU(s), in order, while the next one still fits in the budget.
batch_queue() {
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
    local rc=0
    run_one "${cs%%:*}" "${cs##*:}" "$out" || rc=$?
    if [ "$rc" = 3 ]; then echo "PAUSED $cs"; elif [ "$rc" != 0 ]; then echo "FAILED $cs"; fi
    took=$(($(date +%s) - t0))
    [ "$took" -gt "$longest" ] && longest=$took
  done
}

# STUDY_GPUS queues side by side, GPU g taking runs g, g+N, g+2N, ...: each run alone on its GPU, so a run's
# numbers (and, in deterministic mode, its bits) do not depend on how many ran beside it.
batch() {
  local budget="$1" out="$2" gpus="${STUDY_GPUS:-1}" g i
  shift 2
  local runs=("$@")
  if [ "$gpus" -le 1 ]; then batch_queue "$budget" "$out" "${runs[@]}"; return; fi
  for ((g = 0; g < gpus; g++)); do
    local mine=()
    for ((i = g; i < ${#runs[@]}; i += gpus)); do mine+=("${runs[$i]}"); done
    [ ${#mine[@]} -eq 0 ] && continue
    (export CUDA_VISIBLE_DEVICES=$g; batch_queue "$budget" "$out" "${mine[@]}" 2>&1 | sed "s/^/[gpu $g] /") &
  done
  wait
}

case "${1:-}" in
  list) for c in $CONFIGS; do printf '%-14s %s\n' "$c" "$(config_flags "$c")"; done ;;
  prepare) shift; prepare "$@" ;;
  prepare-heldout) prepare_heldout "$2" "$3" ;;
  run) run_one "$2" "$3" "${4:-bench/convergence/runs}" ;;
  batch) shift; batch "$@" ;;
  report) python3 scripts/convergence_report.py bench/convergence ;;
  pending) python3 scripts/convergence_report.py --pending bench/convergence ;;
  *) sed -n '2,32p' "$0"; exit 2 ;;
esac
