# Shared start of the GPU benchmark scripts (benchmark_dist.sh, benchmark_nemo.sh, benchmark_offload.sh, ...), sourced
# once they have set build, out and parts: NVLink multicast off (NCCL_NVLS_ENABLE=0, as the shared machines
# require), the results folder with info.txt, commit.txt and topo.txt, and the helpers has PART, run NAME ARGS...,
# fit NAME ARGS... and run_configs CONFIG...
nb="$build/nibble"
export NCCL_NVLS_ENABLE=0
mkdir -p "$out"
has() { [[ ",$parts," == *",$1,"* ]]; }
"$nb" info > "$out/info.txt" 2>&1
# NIBBLE_COMMIT names the commit of a carried build (a copied tree may hold a stale .git).
echo "${NIBBLE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" > "$out/commit.txt"
nvidia-smi topo -m > "$out/topo.txt" 2>&1 || true

# run NAME ARGS...: one training run whose metrics.jsonl lands in OUT/NAME (no checkpoints are written).
run() {
  local name=$1; shift
  rm -rf "${out:?}/$name"
  "$nb" train --save "$out/$name" --log-interval 1 --lr-warmup-iters 1 "$@" > "$out/$name.log" 2>&1
}

# fit NAME ARGS...: the first micro-batch/recompute pair of FIT_PAIRS (default: 2/none, 2/selective,
# 1/none, 1/selective, 1/full) that runs; records it in OUT/NAME.fit and keeps the logs of the pairs that
# did not fit.
fit() {
  local name=$1; shift
  local pairs=("2 none" "2 selective" "1 none" "1 selective" "1 full")
  [ -n "${FIT_PAIRS:-}" ] && IFS=, read -r -a pairs <<< "$FIT_PAIRS"
  for pair in "${pairs[@]}"; do
    read -r mbs recompute <<< "$pair"
    if run "$name" "$@" --micro-batch-size "$mbs" --recompute "$recompute"; then
      echo "$mbs $recompute" > "$out/$name.fit"
      return 0
    fi
    cp "$out/$name.log" "$out/$name-mbs$mbs-$recompute.failed.log"
  done
  return 1
}

# run_configs CONFIG...: each "name|GPUs|flags" (flags after the array COMMON's) on the first GPUs of BENCH_GPUS
# (default: every GPU), one at a time, bounded by BENCH_TIMEOUT seconds (default 400) so that a hung rank cannot
# eat the machine's time (its launched ranks are killed with it); OUT/runs.txt records each exit.
run_configs() {
  local c name gpus flags devices start code
  local -a lanes extra
  read -r -a lanes <<< "${BENCH_GPUS:-$(seq -s ' ' 0 $(($(nvidia-smi -L | wc -l) - 1)))}"
  for c in "$@"; do
    IFS='|' read -r name gpus flags <<< "$c"
    [ "$parts" = all ] || has "$name" || continue
    read -r -a extra <<< "$flags"
    devices=$(IFS=,; echo "${lanes[*]:0:$gpus}")
    start=$(date +%s)
    rm -rf "${out:?}/$name"
    CUDA_VISIBLE_DEVICES=$devices timeout "${BENCH_TIMEOUT:-400}" "$nb" train --save "$out/$name" --log-interval 1 \
      --lr-warmup-iters 1 "${COMMON[@]}" --nproc-per-node "$gpus" "${extra[@]}" > "$out/$name.log" 2>&1
    code=$?
    [ $code -eq 124 ] && pkill -9 -f "$nb train" || true
    echo "$name: exit $code after $(($(date +%s) - start)) s" | tee -a "$out/runs.txt"
  done
}
