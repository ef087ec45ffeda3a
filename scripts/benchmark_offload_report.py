#!/usr/bin/env python3
"""Writes the optimizer-offload sections of BENCHMARKS.md from a results folder of scripts/benchmark_offload.sh.

  python3 scripts/benchmark_offload_report.py OUT [--merge-into BENCHMARKS.md]

Reads each run's log in OUT (the resolved configuration and the end-of-run summary table: mean over the steps
after the first), commit.txt and an optional note_8b.txt (how the 8B runs were split over calls). Prints three
"## " sections, each titled with the GPU it ran on: Llama 3.1 8B on one GPU with the optimizer state in host
memory, beside the NVFP4 playbook's published GB300 rows; what offload costs on models that fit both ways; and
NeMo's 8B SFT workload beside NeMo's published 8xB200 rows. With --merge-into it replaces only the sections that
have a run in OUT (so an H100 and an H200 section live side by side). Standard library only.
"""
import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from md_sections import read_result as read, summary_row, write_report  # noqa: E402

RECIPES = [("bf16_mixed", "BF16"), ("bf16_with_fp8_current_scaling_mixed", "FP8 current scaling"),
           ("bf16_with_nvfp4_mixed", "NVFP4, last 4 layers BF16")]
PLAYBOOK = "https://github.com/NVIDIA/dgx-spark-playbooks/tree/main/nvidia/station-nvfp4-pretraining"
# The NVFP4 pretraining playbook's published rows (1x GB300, Llama 3.1 8B, seq 4096, global batch 64,
# micro-batch 4): (precision, model TFLOP/s/GPU, step time, memory). Published constants, not our measurements.
PLAYBOOK_ROWS = [("BF16", "~1399", "9.05 s", "221.6 GB (nvidia-smi)"),
                 ("NVFP4, last 4 layers BF16", "~2347", "5.39 s", "207.8 GB (nvidia-smi)")]
SECTION_8B = "## Llama 3.1 8B on one {gpu}: optimizer state in host memory (same run)"
SECTION_COST = "## What optimizer offload costs: llama3.2-3b and the proxy on one {gpu} (same run)"
SECTION_SFT = "## NeMo's Llama 3.1 8B SFT workload on one {gpu}: optimizer state in host memory (same run)"
# NeMo's SFT rows (8x B200, Llama 3.1 8B, seq 16384, micro-batch 1, global batch 8, packed) as issue 28
# quotes them: tokens/s/GPU per precision. Constants, not our measurements.
NEMO_SFT_ROWS = [("BF16", "24,690"), ("FP8 current scaling", "33,362"), ("NVFP4", "35,578")]


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

    def key(k):
        m = re.search(r"^" + k + r" = \"?([^\"\n]*)\"?", text, re.M)
        return m.group(1) if m else ""

    offload = key("optimizer_cpu_offload") == "true"
    return {"device": row("device"), "step_s": float(row("step time (ms, mean after step 1)")) / 1000,
            "tokens": row("tokens/s/GPU"), "tflops": float(row("model TFLOP/s/GPU")), "mfu": row("MFU"),
            "peak": row("peak memory (GiB)"), "opt_ms": row("optimizer update (ms, mean)"),
            "host": row("optimizer state in host mem (GiB)") if offload else "0",
            "fraction": key("optimizer_offload_fraction") if offload else "off",
            "fit": key("micro_batch_size") + ", " + key("recompute")}


def verdict(ok):
    return "**met**" if ok else "**not met**"


def section_8b(out, commit):
    runs = [(label, summary(out, f"offload-8b-{r}"), summary(out, f"offload-8b-{r}-least")) for r, label in RECIPES]
    ran = [s for _, s, _ in runs if s]
    if not ran:
        return "", False
    bf16 = runs[0][1]
    lines = [SECTION_8B.format(gpu=gpu_of(ran[0]["device"])), "",
             "`nibble train --model llama3.1-8b --seq-length 4096 --global-batch-size 64 --optimizer-cpu-offload`: "
             "the NVFP4 playbook's model and batch on one GPU, FP32 master weights and AdamW m, v (12 bytes/param, "
             "89.75 GiB) in page-locked host memory, streamed through the GPU's AdamW each step (docs/OFFLOAD.md). "
             "Micro-batch and recompute per recipe are the first of 2/none, 2/selective, 1/none, 1/selective, 1/full "
             "that ran; NVFP4 with the last 4 layers BF16 (the playbook's setting). Figures are means over the steps "
             "after the first. \"Optimizer update\" is the AdamW update's time on its own queue (copy-ins included); "
             "the copy-outs and, from commit be2aa06 on, the next step's first forward overlap it. Device: " + ran[0]["device"] + f"; commit {commit}. "
             + read(out, "note_8b.txt").strip(), "",
             "| recipe | micro-batch, recompute | offload fraction | step time (s) | tokens/s/GPU | model TFLOP/s/GPU "
             "| MFU | peak GPU memory GiB | host memory (page-locked) GiB | optimizer update (ms) "
             "| step time vs BF16 |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, s, least in runs:
        for r in (s, least):
            if not r:
                continue
            ratio = f"{r['step_s'] / bf16['step_s']:.2f}x" if bf16 else "n/a"
            lines.append(f"| {label} | {r['fit']} | {r['fraction']} | {r['step_s']:.2f} | {r['tokens']} | "
                         f"{r['tflops']:.1f} | {r['mfu']} | {r['peak']} | {r['host']} | {r['opt_ms']} | {ratio} |")
    nvfp4 = runs[2][1]
    lines += ["", "Targets (fraction 1.0 rows):", ""]
    if bf16:
        lines.append(f"- BF16 >= 520 model TFLOP/s/GPU on one GPU: {verdict(bf16['tflops'] >= 520)} "
                     f"({bf16['tflops']:.1f})")
    if bf16 and nvfp4:
        r = nvfp4["step_s"] / bf16["step_s"]
        lines.append(f"- NVFP4 step time <= 1.15x BF16: {verdict(r <= 1.15)} ({r:.3f}x; NVFP4 fits micro-batch "
                     f"{nvfp4['fit']}, BF16 {bf16['fit']})")
    lines += ["", "Published reference figures (other hardware; not the same run):", "",
              "| source | hardware and configuration | precision | model TFLOP/s/GPU | step time | memory |",
              "|---|---|---|---:|---:|---:|"]
    for prec, tf, step, mem in PLAYBOOK_ROWS:
        lines.append(f"| [NVFP4 pretraining playbook]({PLAYBOOK}) | 1x GB300, Llama 3.1 8B, seq 4096, global batch "
                     f"64, micro-batch 4 | {prec} | {tf} | {step} | {mem} |")
    return "\n".join(lines) + "\n", True


def section_cost(out, commit):
    pairs = [("llama3.2-3b, seq 4096, global batch 64", "cost-3b"),
             ("llama3-8b-proxy, seq 4096, micro-batch 2, global batch 16", "cost-proxy")]
    rows, verdicts, device = [], [], ""
    for label, name in pairs:
        base = summary(out, name + "-device")
        if not base:
            continue
        device = base["device"]
        for suffix in ("-device", "-offload", "-offload-ungated", "-offload-half", "-offload-least"):
            r = summary(out, name + suffix)
            if not r:
                continue
            if suffix == "-offload-ungated":
                r["fraction"] += " (no per-layer gates)"
            ratio = r["step_s"] / base["step_s"]
            rows.append(f"| {label} | {r['fit']} | {r['fraction']} | {r['step_s'] * 1000:.1f} | {r['tokens']} | "
                        f"{r['tflops']:.1f} | {r['peak']} | {r['host']} | {r['opt_ms']} | {ratio:.3f}x |")
            if name == "cost-3b" and suffix != "-device":
                verdicts.append(f"- llama3.2-3b, offload fraction {r['fraction']}: step time <= 1.05x without: "
                                f"{verdict(ratio <= 1.05)} ({ratio:.3f}x)")
    if not rows:
        return "", False
    lines = [SECTION_COST.format(gpu=gpu_of(device)), "",
             "The same job without and with `--optimizer-cpu-offload` (fraction 1.0; for the 3B also with the next "
             "forward waiting for the whole update instead of layer by layer (`NIBBLE_OFFLOAD_GATES=0`), at fraction "
             "0.5, and at the least fraction that fits the GPU when that is not 0), same micro-batch and recompute. "
             "BF16; means over the steps after the first. Device: " + device + f"; commit {commit}.", "",
             "| model | micro-batch, recompute | offload fraction | step time (ms) | tokens/s/GPU | model TFLOP/s/GPU "
             "| peak GPU memory GiB | host memory (page-locked) GiB | optimizer update (ms) "
             "| step time vs no offload |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"] + rows + ["", "Target:", ""] + verdicts
    return "\n".join(lines) + "\n", True


def section_sft(out, commit):
    runs = [(label, summary(out, f"offload-sft-8b-{r}")) for r, label in RECIPES]
    ran = [s for _, s in runs if s]
    if not ran:
        return "", False
    device = ran[0]["device"]
    lines = [SECTION_SFT.format(gpu=gpu_of(device)), "",
             "`nibble train --sft --model llama3.1-8b --seq-length 16384 --micro-batch-size 1 --global-batch-size 8 "
             "--packed-sequence true --optimizer-cpu-offload`: NeMo's 8B SFT shape (packed rows of short "
             "prompt/answer samples; here the project's own SFT pairs from scripts/sft_pairs.py, random initial "
             "weights) on one GPU. Recompute is the lightest of none, selective, full that ran. Means over the "
             "steps after the first. Model TFLOP/s follows the protocol's formula, which counts causal attention over "
             "the whole 16,384-token row; packed samples (here about 300 tokens each) attend only within themselves, "
             "so it overstates the work done: compare tokens/s. The NeMo column is the 8x B200 figure issue 28 quotes "
             "for this workload (other hardware, not the same run). Device: " + device + f"; commit {commit}.", "",
             "| recipe | micro-batch, recompute | step time (s) | tokens/s/GPU | model TFLOP/s/GPU | peak GPU memory GiB "
             "| host memory (page-locked) GiB | optimizer update (ms) | NeMo 8x B200 tokens/s/GPU (quoted) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for (recipe, _), (label, r), (_, nemo) in zip(RECIPES, runs, NEMO_SFT_ROWS):
        if not r and read(out, f"offload-sft-8b-{recipe}-mbs1-full.failed.log"):
            est = re.search(r"needs about ([0-9.]+) GiB", read(out, f"offload-sft-8b-{recipe}-mbs1-full.failed.log"))
            lines.append(f"| {label} | none of none, selective, full ran: out of GPU memory at 1, full (estimate "
                         f"{est.group(1) if est else '?'} GiB) | | | | | | | {nemo} |")
        if r:
            lines.append(f"| {label} | {r['fit']} | {r['step_s']:.2f} | {r['tokens']} | {r['tflops']:.1f} | "
                         f"{r['peak']} | {r['host']} | {r['opt_ms']} | {nemo} |")
    return "\n".join(lines) + "\n", True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--merge-into")
    a = ap.parse_args()
    commit = read(a.out, "commit.txt").strip() or "unknown"
    write_report([section_8b(a.out, commit), section_cost(a.out, commit), section_sft(a.out, commit)], a.merge_into,
                 a.out, commit)


if __name__ == "__main__":
    main()
