#!/usr/bin/env python3
"""BENCHMARKS.md's context-parallel section from scripts/benchmark_cp.sh's logs: per configuration the GPUs, the
summary's step time, tokens/s/GPU, model TFLOP/s/GPU, MFU, peak memory and the memory estimate's total, or why it
did not run.

Usage: benchmark_cp_report.py OUT [--merge-into BENCHMARKS.md]"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from md_sections import write_report  # noqa: E402  (the --merge-into logic, shared by the report scripts)


def read(out, name):
    path = os.path.join(out, name)
    return open(path, errors="replace").read() if os.path.exists(path) else ""


def summary(log):
    rows = {}
    for line in log.splitlines():
        m = re.match(r"\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def row(out, name):
    log = read(out, f"{name}.log")
    s = summary(log)
    data = re.search(r"data parallel: (\d+) ranks", log)
    gpus = int(data.group(1)) if data else 1  # a one-GPU run prints no data-parallel line
    for kind in ("context", "tensor"):  # a group's ranks times the data-parallel ranks
        groups = re.search(kind + r" parallel: (\d+) ranks per group", log)
        if groups and data:
            gpus *= int(groups.group(1))
    stages = re.search(r"pipeline parallel: (\d+) stages", log)
    if stages and data:
        gpus *= int(stages.group(1))
    # The end-of-run check's estimate is the logging rank's own (pipeline parallelism: rank 0's stage, whose peak the
    # row reports); the table before step 1 is the largest stage's (and all older logs print only that one).
    est = re.search(r"memory check: estimate ([\d.]+) GiB", log) or re.search(r"total\s+([\d.]+) GiB of", log)
    estimate = f"{float(est.group(1)):.2f}" if est else "?"
    if "tokens/s/GPU" not in s:
        err = [line for line in log.splitlines() if "error" in line.lower() or "does not" in line.lower()]
        return f"| {name} | {gpus} | did not run: {(err[-1] if err else 'see its log')[:140]} | | | | | |", s
    step = float(s["step time (ms, mean after step 1)"]) / 1000
    return (f"| {name} | {gpus} | {step:.2f} | {s['tokens/s/GPU']} | {s['model TFLOP/s/GPU']} | {s.get('MFU', '')} "
            f"| {s['peak memory (GiB)']} | {estimate} |"), s


def main():
    out = sys.argv[1]
    merge = sys.argv[sys.argv.index("--merge-into") + 1] if "--merge-into" in sys.argv else None
    names = [line.split(":")[0] for line in read(out, "runs.txt").splitlines() if line.strip()]
    rows, device = [], "the GPU machine"
    for name in names:
        text, s = row(out, name)
        rows.append(text)
        device = s.get("device", device)
    commit = read(out, "commit.txt").strip() or "unknown"
    text = (
        "## Context parallelism: Llama 3.1 8B BF16 at long sequences (same run)\n\n"
        f"`scripts/benchmark_cp.sh` on {device}s (commit {commit}): mock data, 4 steps, micro-batch 1, Megatron-FSDP "
        "optim_grads_params over every rank; each row's tokens split over C ranks (`--context-parallel-size`), "
        "ring attention (docs/DISTRIBUTED.md). Step time is the mean after step 1; the estimate is the memory "
        "estimate's total per GPU (with the CUDA libraries' constant) against the measured peak.\n\n"
        "| configuration | GPUs | step (s) | tokens/s/GPU | model TFLOP/s/GPU | MFU | peak memory (GiB) | "
        "estimate (GiB) |\n|---|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n")
    write_report([(text, bool(rows))], merge, out, commit)


if __name__ == "__main__":
    main()
