#!/usr/bin/env python3
"""Writes the Megatron-FSDP sections of BENCHMARKS.md from a results folder of scripts/benchmark_fsdp.sh.

  python3 scripts/benchmark_fsdp_report.py OUT [--merge-into BENCHMARKS.md]

Per run NAME it reads NAME/metrics.jsonl (or rank 0's log lines), NAME.fit and the summary table's FSDP rows of
NAME.log (weights gathered and gradients reduce-scattered per step per rank). Means over iterations >= 2.
Standard library only; the step parsing is benchmark_dist_report.py's.
"""
import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_dist_report import device_and_commit, read, run_stats, timed_steps, topology  # noqa: E402
from md_sections import write_report  # noqa: E402

RECIPES = [("bf16_mixed", "BF16"), ("bf16_with_fp8_current_scaling_mixed", "FP8 current scaling"),
           ("bf16_with_nvfp4_mixed", "NVFP4, last 4 layers BF16")]
COST = [("fsdp-proxy-1gpu", "1 GPU"), ("fsdp-proxy-2gpu-optim", "2 GPUs, `optim` (distributed optimizer)"),
        ("fsdp-proxy-2gpu-optim_grads", "2 GPUs, `optim_grads`"),
        ("fsdp-proxy-2gpu-optim_grads_params", "2 GPUs, `optim_grads_params`"),
        ("fsdp-proxy-2gpu-optim_grads-eps", "2 GPUs, `optim_grads --fsdp-embeddings-per-step`"),
        ("fsdp-proxy-2gpu-optim_grads_params-eps", "2 GPUs, `optim_grads_params --fsdp-embeddings-per-step`"),
        ("fsdp-proxy-2gpu-optim-bf16", "2 GPUs, `optim --grad-reduce-in-bf16`"),
        ("fsdp-proxy-2gpu-optim_grads_params-bf16", "2 GPUs, `optim_grads_params --grad-reduce-in-bf16`"),
        ("fsdp-proxy-2gpu-optim_grads-eps-bf16",
         "2 GPUs, `optim_grads --fsdp-embeddings-per-step --grad-reduce-in-bf16`"),
        ("fsdp-proxy-2gpu-optim_grads_params-eps-bf16",
         "2 GPUs, `optim_grads_params --fsdp-embeddings-per-step --grad-reduce-in-bf16`")]


def summary_row(out, name, label):
    m = re.search(r"\| " + re.escape(label) + r"\s*\|\s*([0-9.]+) \|", read(out, name + ".log"))
    return float(m.group(1)) if m else None


def flags_8b(out, names):
    """Further flags the runs were given (benchmark_fsdp.sh's FSDP_8B_FLAGS), as their logs print them."""
    logs = "".join(read(out, n + ".log") for n in names)
    flags = " --fsdp-embeddings-per-step" if "(--fsdp-embeddings-per-step)" in logs else ""
    return flags + (" --optimizer-cpu-offload" if "host memory: optimizer state offloaded" in logs else "")


def section_8b(out):
    names = [f"fsdp-8b-{r}" for r, _ in RECIPES]
    stats = {r: run_stats(out, f"fsdp-8b-{r}") for r, _ in RECIPES}
    device, commit = device_and_commit(out, names)
    rows = ["| recipe | micro-batch, recompute | step time (s) | tokens/s/GPU | model TFLOP/s/GPU | peak GiB | "
            "weights gathered/step/GPU (GiB) | vs BF16 | gradients reduce-scattered/step/GPU (GiB) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    base = summary_row(out, "fsdp-8b-bf16_mixed", "FSDP weights gathered/step (GiB)")
    for r, label in RECIPES:
        s, fit = stats[r], " ".join(read(out, f"fsdp-8b-{r}.fit").split()) or "?"
        g = summary_row(out, f"fsdp-8b-{r}", "FSDP weights gathered/step (GiB)")
        red = summary_row(out, f"fsdp-8b-{r}", "FSDP grads reduced/step (GiB)")
        if not isinstance(s, dict):
            rows.append(f"| {label} | {fit} | {s} | | | | | | |")
            continue
        rel = f"{g / base:.2f}x" if g and base else "n/a"
        rows.append(f"| {label} | {fit} | {s['step_ms'] / 1000:.2f} | {s['tokens']:.0f} | {s['tflops']:.1f} | "
                    f"{s['peak']:.1f} | {g if g is not None else 'n/a'} | {rel} | "
                    f"{red if red is not None else 'n/a'} |")
    failed = sorted(f for f in os.listdir(out) if f.startswith("fsdp-8b-") and f.endswith(".failed.log"))
    flags = flags_8b(out, names)  # runs with further flags get their own section
    offload = "the optimizer state in host memory" if "offload" in flags else "no optimizer offload"
    text = [f"## Megatron-FSDP: Llama 3.1 8B on two {device}s, optim_grads_params{flags} (same run)\n",
            "`nibble train --model llama3.1-8b --nproc-per-node 2 --use-megatron-fsdp "
            f"--data-parallel-sharding-strategy optim_grads_params{flags}`: seq 4096, global batch 32, 4 steps, "
            f"{offload}; the lightest micro-batch/recompute that fits. Means over {timed_steps(stats)}; peak memory of "
            f"rank 0; link GPU0-GPU1 {topology(out) or 'unknown'}. Commit {commit}.\n"] + rows
    if failed:
        text.append("\nAttempts that did not fit: " + "; ".join(f"`{f[8:-11]}`" for f in failed) + ".")
    return "\n".join(text) + "\n", any(os.path.exists(os.path.join(out, n + ".log")) for n in names)


def section_cost(out):
    names = [n for n, _ in COST]
    stats = {n: run_stats(out, n) for n in names}
    device, commit = device_and_commit(out, names)
    one, optim = stats["fsdp-proxy-1gpu"], stats["fsdp-proxy-2gpu-optim"]
    rows = ["| configuration | step ms | tokens/s/GPU | vs 1 GPU | step time vs `optim` | peak GiB | "
            "weights gathered/step/GPU (GiB) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for n, label in COST:
        s = stats[n]
        if not os.path.exists(os.path.join(out, n + ".log")):
            continue  # a configuration this run did not include
        if not isinstance(s, dict):
            rows.append(f"| {label} | {s} | | | | | |")
            continue
        vs1 = f"{100 * s['tokens'] / one['tokens']:.1f}%" if isinstance(one, dict) else "n/a"
        vso = f"{s['step_ms'] / optim['step_ms']:.3f}x" if isinstance(optim, dict) and n != "fsdp-proxy-1gpu" else ""
        g = summary_row(out, n, "FSDP weights gathered/step (GiB)")
        rows.append(f"| {label} | {s['step_ms']:.1f} | {s['tokens']:.0f} | {vs1} | {vso} | {s['peak']:.1f} | "
                    f"{g if g is not None else ''} |")
    text = [f"## What parameter sharding costs: llama3-8b-proxy on two {device}s (same run)\n",
            "Seq 4096, micro-batch 2, 8 micro-batches per GPU per step, no recompute, NVLink; `--use-megatron-fsdp "
            f"--data-parallel-sharding-strategy` as named. Means over {timed_steps(stats)}. Commit {commit}. "
            "Targets: `optim_grads_params` step time <= 1.05x `optim`'s and >= 95% of one GPU's tokens/s/GPU.\n"] + rows
    return "\n".join(text) + "\n", any(os.path.exists(os.path.join(out, n + ".log")) for n in names)


def section_lora70b(out):
    name = "fsdp-lora70b-bf16"
    s, fit = run_stats(out, name), " ".join(read(out, name + ".fit").split()) or "?"
    device, commit = device_and_commit(out, [name])
    est = re.search(r"^  total\s+([0-9.]+) GiB", read(out, name + ".log"), re.M)  # the estimate's table
    g = summary_row(out, name, "FSDP weights gathered/step (GiB)")
    rows = ["| base | micro-batch, recompute | step time (s) | tokens/s/GPU | model TFLOP/s/GPU | peak GiB | "
            "estimate GiB | base gathered/step/GPU (GiB) |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    if isinstance(s, dict):
        rows.append(f"| BF16 | {fit} | {s['step_ms'] / 1000:.2f} | {s['tokens']:.0f} | {s['tflops']:.1f} | "
                    f"{s['peak']:.1f} | {est.group(1) if est else 'n/a'} | {g if g is not None else 'n/a'} |")
    else:
        rows.append(f"| BF16 | {fit} | {s} | | | | {est.group(1) if est else ''} | |")
    text = [f"## Megatron-FSDP: NeMo's Llama 3.1 70B LoRA row on two {device}s, BF16 base sharded (same run)\n",
            "`nibble train --model llama3.1-70b --peft lora --lora-rank 32 --lora-alpha 32 --lora-base-precision bf16 "
            "--nproc-per-node 2 --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params`: seq 4096, "
            "micro-batch 1, global batch 32, 4 steps; each GPU keeps half of the frozen base (seeded random values of "
            "the real shapes) and gathers each layer before its forward and its backward. Means over "
            f"{timed_steps({name: s})}; peak memory of rank 0; link GPU0-GPU1 {topology(out) or 'unknown'}. "
            f"Commit {commit}.\n"] + rows
    return "\n".join(text) + "\n", os.path.exists(os.path.join(out, name + ".log"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--merge-into")
    a = ap.parse_args()
    commit = read(a.out, "commit.txt").strip() or "unknown"
    write_report([section_8b(a.out), section_cost(a.out), section_lora70b(a.out)], a.merge_into, a.out, commit)


if __name__ == "__main__":
    main()
