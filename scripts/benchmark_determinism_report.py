#!/usr/bin/env python3
"""Writes the --deterministic-mode sections of BENCHMARKS.md from a results folder of scripts/benchmark_determinism.sh.

  python3 scripts/benchmark_determinism_report.py OUT [--merge-into BENCHMARKS.md]

Reads each run's log in OUT (the resolved configuration and the end-of-run summary table: means over the steps
after the first), its metrics.jsonl and checkpoint files, and commit.txt. Prints two "## " sections, each titled
with the GPU it ran on: what the mode costs in step time and peak memory on llama3-8b-proxy and llama3.2-1b, and
whether two runs of the 125M study configuration agree bit for bit, with and without the mode. With --merge-into
it replaces only the sections that have a run in OUT. Standard library only.
"""
import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from md_sections import read_result as read, summary_row, write_report  # noqa: E402

RECIPE_LABELS = {"bf16_mixed": "BF16", "bf16_with_fp8_current_scaling_mixed": "FP8 current scaling",
                 "bf16_with_nvfp4_mixed": "NVFP4 (last 2 layers BF16)"}
MODELS = [("proxy", "llama3-8b-proxy"), ("1b", "llama3.2-1b")]
SECTION_COST = "## Deterministic mode: what it costs on one {gpu} (same run)"
SECTION_REPEAT = "## Deterministic mode: the 125M study configuration twice on one {gpu} (same run)"
# metrics.jsonl fields that measure the machine rather than the training (tests/train/gpu/determinism_gpu_test.cpp
# leaves out the same ones).
TIMING = {"tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "peak_mem_gib", "eta_s"}


def gpu_of(device):
    """The GPU's short name for a section title: "NVIDIA H100 80GB HBM3" -> "H100"."""
    m = re.search(r"\b([A-Z]\d{3,4}[A-Za-z]*)\b", device)
    return m.group(1) if m else (device or "GPU")




def summary(out, name):
    """The run's figures from its log, or None when it did not finish."""
    text = read(out, name + ".log")
    if "nibble train: summary" not in text:
        return None

    def row(label):
        return summary_row(text, label)

    return {"device": row("device"), "step_ms": float(row("step time (ms, mean after step 1)")),
            "tokens": row("tokens/s/GPU"), "tflops": float(row("model TFLOP/s/GPU")),
            "peak": float(row("peak memory (GiB)"))}


def section_cost(out, commit):
    rows, device = [], ""
    recipes = sorted({m.group(1) for f in os.listdir(out)
                      for m in [re.match(r"cost-(?:proxy|1b)-(.+)-default\.log$", f)] if m})
    for tag, model in MODELS:
        for recipe in recipes:
            base = summary(out, f"cost-{tag}-{recipe}-default")
            det = summary(out, f"cost-{tag}-{recipe}-deterministic")
            if not base:
                continue
            device = base["device"]
            label = RECIPE_LABELS.get(recipe, recipe)
            rows.append(f"| {model} | {label} | default | {base['step_ms']:.1f} | {base['tokens']} | "
                        f"{base['tflops']:.1f} | {base['peak']:.2f} | 1.000x | +0.00 |")
            if det:
                rows.append(f"| {model} | {label} | deterministic | {det['step_ms']:.1f} | {det['tokens']} | "
                            f"{det['tflops']:.1f} | {det['peak']:.2f} | {det['step_ms'] / base['step_ms']:.3f}x | "
                            f"{det['peak'] - base['peak']:+.2f} |")
            else:
                rows.append(f"| {model} | {label} | deterministic | did not finish (see "
                            f"cost-{tag}-{recipe}-deterministic.log) | | | | | |")
    if not rows:
        return "", False
    lines = [SECTION_COST.format(gpu=gpu_of(device)), "",
             "The same job without and with `--deterministic-mode` (docs/PERFORMANCE.md, \"Deterministic mode\": "
             "attention's backward without the atomic dQ accumulator, GEMMs without split-K), seq 4096, micro-batch "
             "2, global batch 16, mock data; FP8 with every layer quantized. Means over the steps after the first; "
             "peak memory as the log reports it (the device's used memory, cuDNN's workspace included). Device: "
             + device + f"; commit {commit}.", "",
             "| model | recipe | mode | step time (ms) | tokens/s/GPU | model TFLOP/s/GPU | peak GPU memory GiB "
             "| step time vs default | peak memory vs default (GiB) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"] + rows
    return "\n".join(lines) + "\n", True


def records(path):
    """metrics.jsonl without its timing fields, one canonical JSON text per record."""
    out = []
    for line in read(path, "metrics.jsonl").splitlines():
        if line.strip():
            rec = json.loads(line)
            out.append(json.dumps({k: v for k, v in rec.items() if k not in TIMING and not k.endswith("_ms")},
                                  sort_keys=True))
    return out


def files(path):
    """Relative path -> bytes of every file of a run folder but metrics.jsonl."""
    got = {}
    for root, _, names in os.walk(path):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), path)
            if rel != "metrics.jsonl":
                got[rel] = open(os.path.join(root, n), "rb").read()
    return got


def compare(a, b):
    """(metrics verdict, checkpoint verdict) of two run folders."""
    ra, rb = records(a), records(b)
    if not ra or len(ra) != len(rb):
        metrics = f"{len(ra)} vs {len(rb)} records"
    else:
        diff = [i for i in range(len(ra)) if ra[i] != rb[i]]
        metrics = "identical" if not diff else f"differ from record {diff[0] + 1} of {len(ra)}"
    fa, fb = files(a), files(b)
    ckpt = [f for f in sorted(set(fa) | set(fb)) if f.startswith("iter_")]
    if not ckpt:
        return metrics, "no checkpoint"
    bad = [f for f in ckpt if fa.get(f) != fb.get(f)]
    return metrics, "identical" if not bad else "differ: " + ", ".join(bad)


def section_repeat(out, commit):
    rows, device = [], ""
    names = sorted({m.group(1) for f in os.listdir(out) for m in [re.match(r"(repeat-.+)-1\.log$", f)] if m})
    for name in names:
        first, second = summary(out, name + "-1"), summary(out, name + "-2")
        m = re.match(r"repeat-(.+)-(deterministic|default)$", name)
        if not m or not first:
            continue
        device = first["device"]
        recipe, mode = RECIPE_LABELS.get(m.group(1), m.group(1)), m.group(2)
        if not second:
            rows.append(f"| {recipe} | {mode} | second run did not finish | |")
            continue
        metrics, ckpt = compare(os.path.join(out, name + "-1"), os.path.join(out, name + "-2"))
        rows.append(f"| {recipe} | {mode} | {metrics} | {ckpt} |")
    if not rows:
        return "", False
    iters = re.search(r"^train_iters = (\d+)", read(out, names[0] + "-1.log"), re.M)
    lines = [SECTION_REPEAT.format(gpu=gpu_of(device)), "",
             "scripts/convergence.sh's llama-125m configuration (seq 1024, micro-batch 16, global batch 64, the study "
             f"corpus) for {iters.group(1) if iters else '?'} steps with a checkpoint at the end, run twice with the "
             "same command; metrics.jsonl compared without its timing and memory fields, the checkpoint folder byte "
             "for byte (both runs saved to the same path, so trainer_state.json's recorded configuration matches). "
             "Device: " + device + f"; commit {commit}.", "",
             "| recipe | mode | metrics.jsonl values | checkpoint bytes |", "|---|---|---|---|"] + rows
    return "\n".join(lines) + "\n", True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--merge-into")
    a = ap.parse_args()
    commit = read(a.out, "commit.txt").strip() or "unknown"
    write_report([section_cost(a.out, commit), section_repeat(a.out, commit)], a.merge_into, a.out, commit)


if __name__ == "__main__":
    main()
