#!/usr/bin/env python3
"""BENCHMARKS.md's Mixture of Representations section from scripts/benchmark_mor.sh's logs: per configuration the
step time, tokens/s/GPU, model TFLOP/s/GPU, MFU, peak memory and the estimate; for each MoR run the mean share of
GEMM operands (and of GEMMs) in FP8 over its steps; MoR's tokens/s against FP8 current scaling's (the issue's goal:
within 5% where >= 95% of operands pick FP8); and what deciding costs per step (the goal: <= 2%): MoR at threshold
0.999 keeps every operand FP8, so its GEMMs are FP8 current scaling's with every layer FP8, and the difference in
tokens/s is the statistic, the board's read-back and the host's decisions (metrics.jsonl mor_decide_ms, shown too).

Usage: benchmark_mor_report.py OUT [--merge-into BENCHMARKS.md]"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_cp_report import read, row  # noqa: E402
from benchmark_tp_report import tokens  # noqa: E402
from md_sections import write_report  # noqa: E402


def records(out, name):
    try:
        with open(os.path.join(out, name, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def shares(out, name):
    """Mean FP8 operand and GEMM shares over the run's steps, and the mean decision host time (ms)."""
    recs = records(out, name)
    ops = [r["mor_fp8_operands"] for r in recs if "mor_fp8_operands" in r]
    gemms = [r["mor_fp8_gemms"] for r in recs if "mor_fp8_gemms" in r]
    decide = [r["mor_decide_ms"] for r in recs if "mor_decide_ms" in r]
    mean = lambda v: sum(v) / len(v) if v else None  # noqa: E731
    return mean(ops), mean(gemms), mean(decide)


def speed_lines(out, stats, model, run, what):
    """MoR at the default threshold (run) against FP8 current scaling and BF16, and the speed goal."""
    mor, fp8, fp8_all, bf16 = (stats.get(f"{model}-{k}") for k in (run, "fp8", "fp8-all", "bf16"))
    ops, gemms, _ = shares(out, f"{model}-{run}")
    out_lines = []
    if ops is not None:
        out_lines.append(f"- {model}, {what}: MoR kept {100 * ops:.2f}% of GEMM operands and {100 * gemms:.2f}% of "
                         "GEMMs in FP8 (mean over the steps)")
    for label, base in (("FP8 current scaling (preset)", fp8), ("FP8 current scaling, every layer", fp8_all),
                        ("BF16", bf16)):
        if mor and base:
            out_lines.append(f"- {model}, {what}: MoR's tokens/s/GPU {mor / base:.3f}x {label}'s")
    if mor and fp8 and ops is not None:
        if ops >= 0.95:
            verdict = "met" if mor / fp8 >= 0.95 else "not met"
            out_lines.append(f"- {model}, {what}: goal, within 5% of FP8 current scaling's tokens/s with >= 95% of "
                             f"operands in FP8 ({100 * ops:.1f}%): {mor / fp8:.3f}x, {verdict}")
        else:
            out_lines.append(f"- {model}, {what}: only {100 * ops:.1f}% of operands pick FP8, under the goal's 95%; "
                             "its speed goal does not apply")
    return out_lines


def cost_lines(out, stats, model, run, what):
    """What deciding adds to the step: MoR at threshold 0.999 (every operand FP8) against every-layer FP8."""
    allfp8, fp8_all = stats.get(f"{model}-{run}"), stats.get(f"{model}-fp8-all")
    ops_all, _, decide_ms = shares(out, f"{model}-{run}")
    if not (allfp8 and fp8_all and ops_all is not None):
        return []
    cost = 1 - allfp8 / fp8_all  # the share of MoR's step that deciding adds
    return [f"- {model}, {what}: deciding costs {100 * cost:.2f}% of the step (MoR at threshold 0.999 kept "
            f"{100 * ops_all:.1f}% of operands FP8: {allfp8 / fp8_all:.3f}x the every-layer FP8 run's tokens/s; "
            f"the host's time {decide_ms or 0.0:.2f} ms per decision); goal <= 2%: "
            f"{'met' if cost <= 0.02 else 'not met'}"]


def lines(out, stats):
    out_lines = []
    for model in ("proxy", "3b"):
        for suffix, what in (("", "deciding every step"), ("-i4", "--mor-interval 4")):
            out_lines += speed_lines(out, stats, model, "mor" + suffix, what)
            out_lines += cost_lines(out, stats, model, "mor-allfp8" + suffix, what)
    return "\n".join(out_lines)


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
        "## Mixture of Representations: bf16_with_mor_fp8_mixed on one GPU (same run)\n\n"
        f"`scripts/benchmark_mor.sh` on {device} (commit {commit}): mock data, sequence 8192, micro-batch 1; the 8B "
        "proxy (global batch 8, 8 steps) and Llama 3.2 3B (global batch 4, 6 steps, selective recompute). `-all` rows "
        "keep every layer FP8 as MoR's preset does (the FP8 preset keeps the first and last in BF16); `-allfp8` rows "
        "run MoR at threshold 0.999, which keeps every operand FP8 (what deciding costs); `-i4` rows decide "
        "after steps 1, 5 and 9 of 9 (`--mor-interval 4`: 2 of the 8 timed steps measure). Step time is the mean after step 1; the estimate is the memory estimate's total.\n\n"
        "| configuration | GPUs | step (s) | tokens/s/GPU | model TFLOP/s/GPU | MFU | peak memory (GiB) | "
        "estimate (GiB) |\n|---|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n\n" + lines(out, stats)
        + "\n")
    write_report([(text, bool(rows))], merge, out, commit)


if __name__ == "__main__":
    main()
