#!/usr/bin/env python3
"""BENCHMARKS.md's pipeline-parallel section from scripts/benchmark_pp.sh's logs: per configuration the GPUs, step
time, tokens/s/GPU, model TFLOP/s/GPU, MFU, peak memory (rank 0's) and the memory estimate's total, and each
pipeline row's tokens/s/GPU against the Megatron-FSDP row of its recipe.

Usage: benchmark_pp_report.py OUT [--merge-into BENCHMARKS.md]"""
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_cp_report import read, row  # noqa: E402  (the rows are the context-parallel report's)
from md_sections import write_report  # noqa: E402


def tokens(s):
    try:
        return float(s["tokens/s/GPU"])
    except (KeyError, ValueError):
        return None


def measured_bubble(out, name):
    """The profiled run's bubble phase (the first stage's messages and waits) as a share of its step, and the
    formula's share from its log; None when the run wrote no roofline."""
    path = os.path.join(out, name, "roofline.json")
    if not os.path.exists(path):
        return None
    r = json.load(open(path))
    phase = [p for p in r.get("phases", []) if p.get("name", "").startswith("pipeline: messages")]
    formula = re.search(r"pipeline bubble by formula .* = ([\d.]+)% of the ideal step", read(out, f"{name}.log"))
    if not phase or not r.get("step_ms"):
        return None
    return (f"- {name}: the first stage spends {phase[0]['ms']:.0f} ms of its {r['step_ms']:.0f} ms step "
            f"({100 * phase[0]['ms'] / r['step_ms']:.1f}%) in pipeline messages and waits (the measured bubble with "
            f"the transfers); the formula (P - 1) / (V x M) gives {formula.group(1) if formula else '?'}% of the ideal "
            "step\n")


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
    lines = []
    for name, got in stats.items():
        recipe = name.split("-")[1]
        base = stats.get(f"8b-{recipe}-fsdp4")
        if "-pp" in name and got and base:
            lines.append(f"- {name}: {got / base:.3f}x the Megatron-FSDP row's tokens/s/GPU")
    bubbles = [b for b in (measured_bubble(out, name) for name in names) if b]
    commit = read(out, "commit.txt").strip() or "unknown"
    if any(n.startswith("70b-lora") for n in names):
        text = (
            "## Pipeline parallelism: NeMo's Llama 3.1 70B LoRA configuration, TP1 PP4 VP20 on four GPUs (same run)\n\n"
            f"`scripts/benchmark_pp_lora.sh` on {device}s (commit {commit}): LoRA rank 32 on a frozen base of seeded "
            "random values of the real shapes, sequence 4096, micro-batch 1, global batch 32 (32 micro-batches per step: "
            "bubble 3 / (20 x 32) = 0.5% by formula, interleaved 1F1B, messages posted between passes); 3 steps, step "
            "time the mean after step 1; peak memory is rank 0's (the first stage: 83 passes in flight). Beside: "
            "nibble's Megatron-FSDP row, 1,721 tokens/s/GPU on two H200s (selective recompute), and NeMo's 8xB200 row, "
            "3,772 (BF16).\n\n"
            "| configuration | GPUs | step (s) | tokens/s/GPU | model TFLOP/s/GPU | MFU | peak memory (GiB) | "
            "estimate (GiB) |\n|---|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n"
            + ("\n" + "".join(bubbles) if bubbles else ""))
        write_report([(text, bool(rows))], merge, out, commit)
        return
    text = (
        "## Pipeline parallelism: the 8B at PP4 and PP2 x D2 beside Megatron-FSDP on four GPUs (same run)\n\n"
        f"`scripts/benchmark_pp.sh` on {device}s (commit {commit}): mock data, sequence 8192, micro-batch 1, global "
        "batch 32 (32 micro-batches per step at PP4: bubble 3/32 = 9.4% by formula, 1F1B, messages posted between "
        "passes); BF16 with selective recompute (PP2 x T2 with sequence parallelism), NVFP4 with full recompute under "
        "pipeline parallelism (its Linears keep one micro-batch's quantized input), selective under FSDP; the "
        "profiled row's speed includes the profiler's events. Step time is the mean after step 1; peak "
        "memory is rank 0's (the first stage); the estimate is the memory estimate's total for it.\n\n"
        "| configuration | GPUs | step (s) | tokens/s/GPU | model TFLOP/s/GPU | MFU | peak memory (GiB) | "
        "estimate (GiB) |\n|---|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n\n"
        + "".join(line + "\n" for line in lines) + "".join(bubbles))
    write_report([(text, bool(rows))], merge, out, commit)


if __name__ == "__main__":
    main()
