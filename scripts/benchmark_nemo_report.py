#!/usr/bin/env python3
"""Writes the NeMo-configuration sections of BENCHMARKS.md from a results folder of scripts/benchmark_nemo.sh.

  python3 scripts/benchmark_nemo_report.py OUT [--merge-into BENCHMARKS.md]

Reads OUT/info.txt, commit.txt, gpus.txt, topo.txt and the runs nemo-8b-RECIPE-NgpU and nemo-proxy-RECIPE-Ngpu
(their metrics.jsonl or rank 0's log lines, through benchmark_dist_report.run_stats). Prints two "## " sections:
Llama 3.1 8B in NeMo's configuration on N GPUs beside NeMo's published 8xB200 figures, and the proxy's scaling
from 1 GPU up at NeMo's per-GPU batch. With --merge-into it replaces only the sections that have a run in OUT.
Tokens/s/GPU is (global batch x seq) / step time / GPUs, as NeMo defines it. Standard library only.
"""
import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_dist_report import device_and_commit, read, run_stats, timed_steps, topology, verdict  # noqa: E402
from md_sections import write_report  # noqa: E402

RECIPES = [("bf16_mixed", "BF16"), ("bf16_with_fp8_current_scaling_mixed", "FP8 current scaling"),
           ("bf16_with_fp8_delayed_scaling_mixed", "FP8 delayed scaling"), ("bf16_with_mxfp8_mixed", "MXFP8"),
           ("bf16_with_nvfp4_mixed", "NVFP4")]
WORLD_SIZES = [1, 2, 4, 8]
SUMMARY_URL = "https://docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary-archive.html"
# NeMo's published Llama3 8B pretraining rows in this configuration (seq 8192, global batch 128, micro-batch 2,
# TP/PP/CP 1, 8 accumulation steps) on 8x DGX-B200, Megatron-Bridge performance summary, 25.11 container:
# (precision, tokens/s/GPU, model TFLOP/s/GPU). Published constants, not our measurements.
B200_PUBLISHED = [("FP8 current scaling (FP8-CS)", "30624", "1576"), ("MXFP8 (FP8-MX)", "29521", "1519")]
SECTION_8B = "## NeMo's Llama3 8B pretraining configuration on one machine's GPUs (same run)"
SECTION_SCALING = "## NeMo's per-GPU batch: llama3-8b-proxy from 1 to 8 GPUs (same run)"


def gpu_count(out):
    text = read(out, "gpus.txt").strip()
    return int(text) if text.isdigit() else 0


def fit_of(out, name):
    return ", ".join(read(out, name + ".fit").split()) or "?"


def recipe_rows(out, n, stats, peak_tflops):
    rows = ["| recipe | micro-batch, recompute | avg step time after warm-up (s) | tokens/s/GPU | model TFLOP/s/GPU | "
            f"MFU ({peak_tflops:g} TFLOP/s dense BF16 peak) | peak memory GiB | tokens/s vs BF16 |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    base = stats.get("bf16_mixed")
    for recipe, label in RECIPES:
        s = stats[recipe]
        label += ", last 4 layers BF16" if recipe == "bf16_with_nvfp4_mixed" else ""
        if not isinstance(s, dict):
            rows.append(f"| {label} (`{recipe}`) | | {s} | | | | | |")
            continue
        vs = f"{s['tokens'] / base['tokens']:.2f}x" if isinstance(base, dict) else "n/a"
        rows.append(f"| {label} (`{recipe}`) | {fit_of(out, f'nemo-8b-{recipe}-{n}gpu')} | {s['step_ms'] / 1000:.2f} | "
                    f"{s['tokens']:.0f} | {s['tflops']:.1f} | {100 * s['tflops'] / peak_tflops:.1f}% | "
                    f"{s['peak']:.1f} | {vs} |")
    return rows


def published_rows():
    rows = [f"NeMo's published figures for the same configuration on 8x DGX-B200 (Blackwell: native FP8 and FP4 "
            f"tensor cores; other hardware, not the same run; [Megatron-Bridge performance summary, 25.11 "
            f"container]({SUMMARY_URL})):\n", "| precision | tokens/s/GPU | model TFLOP/s/GPU |", "|---|---:|---:|"]
    rows += [f"| {p} | {t} | {f} |" for p, t, f in B200_PUBLISHED]
    rows.append("\nThe summary publishes no BF16, FP8 delayed-scaling or NVFP4 row for this configuration.")
    return rows


def section_8b(out, device, commit):
    skipped = read(out, "8b.skipped").strip()  # the machine had fewer than 2 GPUs: say so, name the plan of 8
    n = 8 if skipped else gpu_count(out)
    stats = {r: run_stats(out, f"nemo-8b-{r}-{n}gpu") for r, _ in RECIPES}
    peak = re.search(r"MFU is reported against ([0-9.]+) TFLOP/s", read(out, f"nemo-8b-bf16_mixed-{n}gpu.log"))
    text = [SECTION_8B + "\n",
            f"`nibble train --model llama3.1-8b --nproc-per-node {n} --use-distributed-optimizer --seq-length 8192 "
            "--global-batch-size 128`: NeMo's Llama3-8B pretraining configuration (Llama 3 and 3.1 8B have the same "
            f"shapes), TP = PP = CP = 1, gradient accumulation 128 / (micro-batch x {n}); micro-batch and recompute "
            "per recipe are the first of 2/none, 2/selective, 1/none, 1/selective, 1/full that fit (NeMo: 2/none); "
            "NVFP4 with the last 4 layers BF16 (the NVFP4 playbook's setting). 4 steps, means over "
            f"{timed_steps(stats)}, peak memory of rank 0. Device: "
            + (f"not run ({skipped})" if skipped else f"{n} x {device}") + f"; commit {commit}.\n"]
    text += recipe_rows(out, n, stats, float(peak.group(1)) if peak else 989.4)
    failed = sorted(f for f in os.listdir(out) if f.startswith("nemo-8b-") and f.endswith(".failed.log"))
    if failed:
        text.append("\nAttempts that did not fit: " + "; ".join(f"`{f[8:-11]}`" for f in failed) + ".")
    two, many = run_stats(out, "nemo-8b-bf16_mixed-2gpu"), stats["bf16_mixed"]
    if isinstance(two, dict) and isinstance(many, dict):
        r = many["tokens"] / two["tokens"]
        text.append(f"\nTarget: {n}-GPU tokens/s/GPU >= 95% of 2 GPUs' on the full 8B (BF16, micro-batch 2 x 8 per "
                    f"GPU; 2 GPUs: {two['tokens']:.0f} tokens/s/GPU, fit {fit_of(out, 'nemo-8b-bf16_mixed-2gpu')}): "
                    f"{verdict(r >= 0.95)} ({100 * r:.1f}%).")
    else:
        text.append(f"\nTarget: {n}-GPU tokens/s/GPU >= 95% of 2 GPUs' on the full 8B: not measured.")
    text += [""] + published_rows()
    ran = bool(skipped) or any(os.path.exists(os.path.join(out, f"nemo-8b-{r}-{n}gpu.log")) for r, _ in RECIPES)
    return "\n".join(text) + "\n", ran


def scaling_rows(stats):
    rows = ["| recipe | GPUs | global batch | avg step ms | tokens/s/GPU | model TFLOP/s/GPU | "
            "per-GPU scaling vs 1 GPU | tokens/s vs BF16 on as many GPUs | peak GiB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for recipe, label in RECIPES:
        one = stats.get((recipe, 1))
        for n in WORLD_SIZES:
            s = stats.get((recipe, n))
            if s is None:
                continue
            if not isinstance(s, dict):
                rows.append(f"| {label} | {n} | {16 * n} | {s} | | | | | |")
                continue
            scale = f"{100 * s['tokens'] / one['tokens']:.1f}%" if isinstance(one, dict) else "n/a"
            bf16 = stats.get(("bf16_mixed", n))
            vs = f"{s['tokens'] / bf16['tokens']:.2f}x" if isinstance(bf16, dict) else "n/a"
            rows.append(f"| {label} | {n} | {16 * n} | {s['step_ms']:.1f} | {s['tokens']:.0f} | {s['tflops']:.1f} | "
                        f"{scale} | {vs} | {s['peak']:.1f} |")
    return rows


def section_scaling(out, device, commit):
    stats = {(r, n): run_stats(out, f"nemo-proxy-{r}-{n}gpu") for r, _ in RECIPES for n in WORLD_SIZES
             if os.path.exists(os.path.join(out, f"nemo-proxy-{r}-{n}gpu.log"))}
    link = topology(out) if gpu_count(out) >= 2 else None
    text = [SECTION_SCALING + "\n",
            "`nibble train --model llama3-8b-proxy --seq-length 8192 --micro-batch-size 2 --train-iters 8`: NeMo's "
            "per-GPU batch (micro-batch 2 x 8 accumulation steps) on 1 GPU (global batch 16) and on N GPUs (global "
            "batch 16 N, `--use-distributed-optimizer`), every layer in the recipe (no BF16 layers kept), "
            "NVLink multicast off (`NCCL_NVLS_ENABLE=0`). Means over "
            f"{timed_steps(stats)}, peak memory of rank 0. Device: {device}"
            f"{f' (GPU0-GPU1 link in `nvidia-smi topo -m`: {link})' if link else ''}; this machine has "
            f"{gpu_count(out)} GPU(s); commit {commit}.\n"]
    text += scaling_rows(stats)
    one, eight = stats.get(("bf16_mixed", 1)), stats.get(("bf16_mixed", 8))
    if isinstance(one, dict) and isinstance(eight, dict):
        r = eight["tokens"] / one["tokens"]
        text.append(f"\nTarget: 8 GPUs >= 95% of 1 GPU's tokens/s/GPU (BF16): {verdict(r >= 0.95)} ({100 * r:.1f}%).")
    else:
        text.append("\nTarget: 8 GPUs >= 95% of 1 GPU's tokens/s/GPU (BF16): not measured "
                    f"(the 8-GPU run needs a machine with 8 GPUs; this one has {gpu_count(out)}).")
    return "\n".join(text) + "\n", bool(stats)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="results folder of scripts/benchmark_nemo.sh")
    ap.add_argument("--merge-into", help="Markdown file whose sections of the same titles are replaced")
    args = ap.parse_args()
    logs = [f[:-4] for f in os.listdir(args.out) if f.startswith("nemo-") and f.endswith(".log")]
    device, commit = device_and_commit(args.out, logs)
    write_report([section_8b(args.out, device, commit), section_scaling(args.out, device, commit)], args.merge_into,
                 args.out, commit)


if __name__ == "__main__":
    main()
