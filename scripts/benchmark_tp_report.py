#!/usr/bin/env python3
"""BENCHMARKS.md's tensor-parallel section from scripts/benchmark_tp.sh's logs: per configuration the GPUs, step
time, tokens/s/GPU, model TFLOP/s/GPU, MFU, peak memory and the memory estimate's total, then each proxy's
tokens/s/GPU against one GPU's of the same recipe (the issue's goals: >= 90% at T2, >= 80% at T4) and FP8's
speedup over BF16 at T1 and T2.

Usage: benchmark_tp_report.py OUT [--merge-into BENCHMARKS.md]"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_cp_report import read, row  # noqa: E402  (the rows are the context-parallel report's)
from md_sections import write_report  # noqa: E402


def tokens(s):
    try:
        return float(s["tokens/s/GPU"])
    except (KeyError, ValueError):
        return None


def gathered(out, name):
    """The last step's tensor-parallel all-gathered bytes per GPU (metrics.jsonl's tp_gathered_bytes)."""
    try:
        with open(os.path.join(out, name, "metrics.jsonl")) as f:
            last = [json.loads(line) for line in f if line.strip()][-1]
        return last.get("tp_gathered_bytes")
    except (OSError, IndexError, ValueError):
        return None


def gather_lines(out, names):
    """Sequence parallelism's all-gathered bytes per step per GPU in each recipe, against BF16's."""
    base = gathered(out, "proxy-bf16-t2-sp")
    lines = []
    for name in names:
        got = gathered(out, name) if name.endswith("-t2-sp") else None
        if got and base:
            lines.append(f"- {name}: {got / 2**30:.2f} GiB all-gathered per step per GPU, {got / base:.3f}x BF16's")
    return lines


def ratios(stats):
    lines = []
    for name, got in stats.items():  # every tensor-parallel proxy row against one GPU's of its recipe
        parts = name.split("-")
        base = stats.get(f"proxy-{parts[1]}-t1") if name.startswith("proxy-") else None
        if base and got and parts[2] != "t1":
            lines.append(f"- {name}: {100 * got / base:.1f}% of one GPU's tokens/s/GPU")
    for t in ("t1", "t2", "t2-sp"):
        b, f = stats.get(f"proxy-bf16-{t}"), stats.get(f"proxy-fp8-{t}")
        if b and f:
            lines.append(f"- FP8 current scaling over BF16 at {t.upper()}: {f / b:.3f}x")
    return "\n".join(lines)


def main():
    out = sys.argv[1]
    merge = sys.argv[sys.argv.index("--merge-into") + 1] if "--merge-into" in sys.argv else None
    names = [line.split(":")[0] for line in read(out, "runs.txt").splitlines() if line.strip()]
    rows, stats, device = [], {}, "the GPU machine"
    for name in names:
        text, s = row(out, name)
        rows.append(text)
        stats[name] = tokens(s)
        device = s.get("device", device)
    commit = read(out, "commit.txt").strip() or "unknown"
    text = (
        "## Tensor parallelism: the 8B proxy at T = 1, 2, 4 and the 8B on four GPUs (same run)\n\n"
        f"`scripts/benchmark_tp.sh` on {device}s (commit {commit}): mock data, sequence 8192, micro-batch 1, global "
        "batch 8; `--tensor-model-parallel-size T` splits heads, FFN and vocabulary (docs/DISTRIBUTED.md); `-overlap` "
        "rows (and proxy-bf16-t4) add `--tp-comm-overlap`, `-sp` rows and the 8B's TP rows `--sequence-parallel "
        "--tp-comm-overlap`. Step time is the mean after step 1; the estimate is the memory estimate's total per GPU "
        "against the measured peak.\n\n"
        "| configuration | GPUs | step (s) | tokens/s/GPU | model TFLOP/s/GPU | MFU | peak memory (GiB) | "
        "estimate (GiB) |\n|---|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n\n" + ratios(stats) + "\n"
        + "".join(line + "\n" for line in gather_lines(out, names)))
    write_report([(text, bool(rows))], merge, out, commit)


if __name__ == "__main__":
    main()
