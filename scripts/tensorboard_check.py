#!/usr/bin/env python3
"""Reads a nibble TensorBoard event folder (or file) with TensorBoard's own reader and compares every
scalar with SAVE/metrics.jsonl: each scalar must equal its metrics.jsonl figure rounded to float32, and
every step TensorBoard has must carry every step tag, every evaluation and every --quant-stats figure.
Needs the tensorboard Python package (not in CI; run it where tensorboard is installed).

    python3 scripts/tensorboard_check.py runs/p/tb runs/p/metrics.jsonl [--interval N]

Prints one summary line; exits 1 on a mismatch, 2 when the files cannot be read.
"""
import argparse
import json
import math
import struct
import sys

# tag -> (metrics.jsonl key, divisor from the JSONL unit to the tag's); docs/TENSORBOARD.md has the table.
STEP_TAGS = {
    "lm loss": ("lm_loss", 1), "learning-rate": ("lr", 1), "grad-norm": ("grad_norm", 1),
    "batch-size": ("global_batch_size", 1), "consumed-samples": ("consumed_samples", 1),
    "iteration-time": ("step_ms", 1000), "throughput": ("tflops_per_gpu", 1),
    "throughput/tokens_per_sec_per_gpu": ("tokens_per_s_per_gpu", 1), "throughput/mfu": ("mfu", 1),
    "mem/peak_gib": ("peak_mem_gib", 1), "skipped-iterations": ("skipped_iterations", 1),
    "nan-iterations": ("nan_iterations", 1), "optimizer-time": ("optimizer_ms", 1000),
    "data-wait-time": ("data_wait_ms", 1000),
}


def flatten(record, prefix, out):
    for key, value in record.items():
        if isinstance(value, dict):
            flatten(value, prefix + key + "/", out)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[prefix + key] = value


def jsonl_figures(path):
    """{(step, tag): (value or None, exact)} from metrics.jsonl; the last record of an iteration wins."""
    steps, other = {}, {}
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            it = r.pop("iteration")
            if "lm_loss" in r:
                steps[it] = {tag: (None if r[k] is None else r[k] / d, True) for tag, (k, d) in STEP_TAGS.items()}
            elif "val_loss" in r:  # printed with 6 significant digits
                other[(it, "lm loss validation")] = (r["val_loss"], False)
                other[(it, "lm loss validation ppl")] = (r["val_ppl"], False)
            elif "quant_worst_sqnr_db" in r:
                for k, v in r.items():
                    if v is not None:
                        other[(it, "quant/" + k[len("quant_"):])] = (v, True)
            elif "quant_stats" in r:
                figures = {}
                linear = r.pop("quant_stats")
                r.pop("layer", None)
                flatten(r, "quant/" + linear + "/", figures)
                for tag, v in figures.items():
                    other[(it, tag)] = (v, True)
    return steps, other


def tensorboard_scalars(path):
    from tensorboard.backend.event_processing import event_accumulator
    acc = event_accumulator.EventAccumulator(path, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    got = {}
    for tag in acc.Tags()["scalars"]:
        for e in acc.Scalars(tag):
            got[(e.step, tag)] = e.value
    return got


def float32(x):
    """x rounded to the nearest float32, as nibble stores a scalar (simple_value)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def same(value, want, exact):
    if want is None:
        return not math.isfinite(value)
    if exact:
        return float32(want) == value
    return abs(value - want) <= 1e-5 * abs(want)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("events", help="--tensorboard-dir folder or one event file")
    ap.add_argument("metrics", help="SAVE/metrics.jsonl of the same run")
    ap.add_argument("--interval", type=int, default=0, help="--tensorboard-log-interval, to check which steps")
    args = ap.parse_args()
    try:
        steps, other = jsonl_figures(args.metrics)
        got = tensorboard_scalars(args.events)
    except (OSError, ValueError, KeyError) as e:
        print(f"tensorboard_check: cannot read the inputs: {e}")
        return 2
    want = dict(other)
    logged = sorted({s for (s, tag) in got if tag == "lm loss"})
    if args.interval > 0 and steps:
        last = max(steps)
        expect = [s for s in sorted(steps) if s % args.interval == 0 or s == last]
        if logged != expect:
            print(f"tensorboard_check: step scalars at steps {logged}, expected {expect}")
            return 1
    for s in logged:
        for tag, figure in steps.get(s, {}).items():
            want[(s, tag)] = figure
    bad = []
    for key, (value, exact) in want.items():
        if key not in got:
            bad.append(f"{key[1]} at step {key[0]}: missing (metrics.jsonl {value})")
        elif not same(got[key], value, exact):
            bad.append(f"{key[1]} at step {key[0]}: {got[key]!r} vs metrics.jsonl {value!r}")
    extra = [k for k in got if k not in want]
    bad += [f"{tag} at step {s}: not in metrics.jsonl" for s, tag in extra]
    if bad or not got:
        print(f"tensorboard_check: {len(bad)} mismatches of {len(got)} scalars; first: "
              f"{bad[0] if bad else 'the event file holds no scalar'}")
        return 1
    quant = sum(1 for (_, tag) in got if tag.startswith("quant/"))
    print(f"tensorboard_check: all {len(got)} scalars match metrics.jsonl ({len(logged)} logged steps, "
          f"{len(got) - quant} step and validation scalars, {quant} quant scalars)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
