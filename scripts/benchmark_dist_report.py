#!/usr/bin/env python3
"""Writes the multi-GPU sections of BENCHMARKS.md from a results folder of scripts/benchmark_dist.sh.

  python3 scripts/benchmark_dist_report.py OUT [--merge-into BENCHMARKS.md]

Reads OUT/info.txt, commit.txt, topo.txt and, per run NAME, NAME/metrics.jsonl or else the iteration lines of
NAME.log (rank 0's), plus 8b-RECIPE.fit ("MBS RECOMPUTE"). Prints two "## " sections, the Llama 3.1 8B recipes
(with targets and published reference figures) and the llama3-8b-proxy data-parallel scaling; with --merge-into
it replaces only those sections in the file (scripts/md_sections.py), skipping a section none of whose runs
exists. Averages are means over iterations >= 2 (step 1 builds plans). Standard library only.
"""
import argparse
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from md_sections import write_report  # noqa: E402  (the --merge-into logic, shared with benchmark_report.py)

RECIPES = [("bf16_mixed", "BF16"), ("bf16_with_fp8_current_scaling_mixed", "FP8 current scaling"),
           ("bf16_with_nvfp4_mixed", "NVFP4, last 4 layers BF16")]
SOCKET = "sockets (`NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1`)"
SCALING = [("proxy-1gpu", "1 GPU"), ("proxy-2gpu-nvlink", "2 GPUs, NVLink, no overlap"),
           ("proxy-2gpu-nvlink-overlap", "2 GPUs, NVLink, `--overlap-grad-reduce --overlap-param-gather`"),
           ("proxy-2gpu-socket-none", f"2 GPUs, {SOCKET}, no overlap"),
           ("proxy-2gpu-socket-grad", f"2 GPUs, {SOCKET}, `--overlap-grad-reduce`"),
           ("proxy-2gpu-socket-both", f"2 GPUs, {SOCKET}, `--overlap-grad-reduce --overlap-param-gather`")]
# The same with one micro-batch per step, where the overlaps have the whole forward and backward to hide behind.
SCALING1 = [("proxy1-1gpu", "1 GPU"), ("proxy1-2gpu-nvlink-none", "2 GPUs, NVLink, no overlap"),
            ("proxy1-2gpu-nvlink-both", "2 GPUs, NVLink, both overlaps"),
            ("proxy1-2gpu-socket-none", f"2 GPUs, {SOCKET}, no overlap"),
            ("proxy1-2gpu-socket-both", f"2 GPUs, {SOCKET}, both overlaps")]
MEGATRON_URL = "https://docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary-archive.html"
PLAYBOOK_URL = "https://github.com/NVIDIA/dgx-spark-playbooks/tree/main/nvidia/station-nvfp4-pretraining"
# Published constants (not our measurements): source, hardware and configuration, precision, tokens/s/GPU,
# model TFLOP/s/GPU, step time, peak memory, URL.
PUBLISHED = [
    ("Megatron-Bridge performance summary, 25.11 container", "8x DGX-H100, Llama3 8B, seq 8192, global batch 128, "
     "micro-batch 1, FSDP 8, TP/PP/CP 1", "FP8-CS", "14451", "744", "", "", MEGATRON_URL),
    ("NVFP4 pretraining playbook", "1x GB300, Llama 3.1 8B, seq 4096, global batch 64, micro-batch 4, CP 1",
     "BF16", "not published", "~1399", "9.05 s", "221.6 GB (nvidia-smi)", PLAYBOOK_URL),
    ("NVFP4 pretraining playbook", "1x GB300, same settings", "NVFP4, last 4 layers BF16", "not published",
     "~2347", "5.39 s", "207.8 GB (nvidia-smi)", PLAYBOOK_URL),
]
LOG_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+) \| "
                      r"tokens/s/GPU: ([0-9.]+) \| throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+) \|.*?"
                      r"peak memory: ([0-9.]+) GiB")


def read(out, name, default=""):
    p = os.path.join(out, name)
    return open(p).read() if os.path.exists(p) else default


def steps(out, name):
    """Per-step (iteration, step_ms, tokens/s/GPU, TFLOP/s/GPU, peak GiB): metrics.jsonl, else the log lines."""
    lines = read(out, os.path.join(name, "metrics.jsonl")).splitlines()
    rows = [json.loads(l) for l in lines if '"step_ms"' in l]
    if rows:
        return [(r.get("iteration", i + 1), r["step_ms"], r["tokens_per_s_per_gpu"], r["tflops_per_gpu"],
                 r["peak_mem_gib"]) for i, r in enumerate(rows)]
    return [(int(m[1]), *map(float, m.groups()[1:])) for m in LOG_LINE.finditer(read(out, name + ".log"))]


def run_stats(out, name):
    """Means over iterations >= 2 (peak memory: the highest of all steps), or a "not run"/"failed: ..." string."""
    all_steps = steps(out, name)
    timed = [s for s in all_steps if s[0] >= 2]
    if timed:
        return {"step_ms": statistics.mean(s[1] for s in timed), "tokens": statistics.mean(s[2] for s in timed),
                "tflops": statistics.mean(s[3] for s in timed), "peak": max(s[4] for s in all_steps),
                "n": len(timed)}
    if not os.path.exists(os.path.join(out, name + ".log")):
        return "not run"
    last = [l for l in read(out, name + ".log").splitlines() if l.strip()]
    return "failed: " + (last[-1].strip()[:120].replace("|", "\\|") if last else "empty log")


def device_and_commit(out, names):
    gpu = re.search(r"GPU 0\s*:\s*([^,]+)", read(out, "info.txt"))
    if not gpu:  # no info.txt: the device row of a run's summary table
        gpu = next(filter(None, (re.search(r"\| device\s*\|\s*(.+?)\s*\|", read(out, n + ".log")) for n in names)),
                   None)
    return (gpu.group(1).strip() if gpu else "unknown"), (read(out, "commit.txt").strip() or "unknown")


def timed_steps(stats):
    """ "steps 2-N" over the runs that have results (the runs of one section have the same length)."""
    n = max((s["n"] for s in stats.values() if isinstance(s, dict)), default=0)
    return f"steps 2-{n + 1}" if n else "steps from 2"


def ratio(a, b, key):
    return f"{a[key] / b[key]:.2f}x" if isinstance(a, dict) and isinstance(b, dict) else "n/a"


def verdict(ok):
    return "**met**" if ok else "**not met**"


def recipe_table(out, stats, peak_tflops):
    rows = ["| recipe | micro-batch, recompute | avg step time after warm-up (s) | tokens/s/GPU | model TFLOP/s/GPU | "
            f"MFU ({peak_tflops:g} TFLOP/s dense BF16 peak) | peak memory GiB | tokens/s vs BF16 | "
            "step time vs BF16 | peak memory vs BF16 |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = stats["bf16_mixed"]
    for recipe, label in RECIPES:
        s, fit = stats[recipe], read(out, f"8b-{recipe}.fit").split()
        if not isinstance(s, dict):
            rows.append(f"| {label} (`{recipe}`) | {', '.join(fit)} | {s} | | | | | | | |")
            continue
        rows.append(f"| {label} (`{recipe}`) | {', '.join(fit) or '?'} | {s['step_ms'] / 1000:.2f} | "
                    f"{s['tokens']:.0f} | {s['tflops']:.1f} | {100 * s['tflops'] / peak_tflops:.1f}% | "
                    f"{s['peak']:.1f} | {ratio(s, base, 'tokens')} | {ratio(s, base, 'step_ms')} | "
                    f"{ratio(s, base, 'peak')} |")
    return rows


def recipe_targets(stats):
    bf16, fp8, fp4 = (stats[r] for r, _ in RECIPES)

    def unmeasured(*runs):
        return "not measured (" + "; ".join(f"{RECIPES[i][1]}: {stats[RECIPES[i][0]]}" for i in runs
                                            if not isinstance(stats[RECIPES[i][0]], dict)) + ")"
    out = ["Targets:\n"]
    out.append("- BF16 >= 560 model TFLOP/s/GPU: " + (f"{verdict(bf16['tflops'] >= 560)} ({bf16['tflops']:.1f})"
                                                       if isinstance(bf16, dict) else unmeasured(0)))
    if isinstance(bf16, dict) and isinstance(fp8, dict):
        r = fp8["tokens"] / bf16["tokens"]
        out.append(f"- FP8 current scaling >= 1.35x BF16 tokens/s: {verdict(r >= 1.35)} ({r:.2f}x)")
    else:
        out.append("- FP8 current scaling >= 1.35x BF16 tokens/s: " + unmeasured(0, 1))
    if isinstance(bf16, dict) and isinstance(fp4, dict):
        t, m = fp4["step_ms"] / bf16["step_ms"], fp4["peak"] / bf16["peak"]
        out.append(f"- NVFP4 step time <= 1.10x BF16 and peak memory below BF16: {verdict(t <= 1.10 and m < 1)} "
                   f"(step time {t:.2f}x: {'met' if t <= 1.10 else 'not met'}; peak memory {fp4['peak']:.1f} vs "
                   f"{bf16['peak']:.1f} GiB, {m:.2f}x: {'met' if m < 1 else 'not met'})")
    else:
        out.append("- NVFP4 step time <= 1.10x BF16 and peak memory below BF16: " + unmeasured(0, 2))
    return out


def published_table():
    rows = ["Published reference figures (other hardware, other configurations; not the same run):\n",
            "| source | hardware and configuration | precision | tokens/s/GPU | model TFLOP/s/GPU | step time | "
            "peak memory |", "|---|---|---|---:|---:|---:|---:|"]
    for src, conf, prec, tok, tfl, step, mem, url in PUBLISHED:
        rows.append(f"| [{src}]({url}) | {conf} | {prec} | {tok} | {tfl} | {step or 'n/a'} | {mem or 'n/a'} |")
    rows.append("\nNo Llama3 8B BF16 row, for H100 or any other system, was found in NVIDIA's published "
                "Megatron-Bridge and NeMo performance summaries (every stored version checked); the H100 row above "
                "is FP8.")
    return rows


def section_8b(out, device, commit):
    stats = {r: run_stats(out, f"8b-{r}") for r, _ in RECIPES}
    bf16_log = read(out, "8b-bf16_mixed.log")
    peak = re.search(r"MFU is reported against ([0-9.]+) TFLOP/s", bf16_log)
    fits = {"/".join(read(out, f"8b-{r}.fit").split()) for r, _ in RECIPES} - {""}
    emulated = "(emulated)" in read(out, "8b-bf16_with_nvfp4_mixed.log")
    text = ["## Llama 3.1 8B on two H200s: data parallel, distributed optimizer (same run)\n",
            "`nibble train --model llama3.1-8b --nproc-per-node 2 --use-distributed-optimizer`: seq 4096, global batch "
            "64 over 2 ranks, 4 steps; micro-batch and recompute per recipe are the first of 2/none, 1/none, "
            f"1/selective, 1/full that fit ({'; '.join(sorted(fits)) or 'none recorded'}); NVFP4 with the last 4 "
            "layers BF16 (`--num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 4`)"
            f"{', emulated on this GPU (BF16 tensor cores)' if emulated else ''}. Means over {timed_steps(stats)}, "
            f"peak memory of rank 0. Device: {device}; commit {commit}.\n"]
    text += recipe_table(out, stats, float(peak.group(1)) if peak else 989.4)
    failed = sorted(f for f in os.listdir(out) if f.startswith("8b-") and f.endswith(".failed.log"))
    if failed:
        text.append("\nAttempts that did not fit: " + "; ".join(
            f"`{f[3:-11]}` ({run_stats(out, f[:-4])})" for f in failed) + ".")
    text += [""] + recipe_targets(stats) + [""] + published_table()
    return "\n".join(text) + "\n", any(os.path.exists(os.path.join(out, f"8b-{r}.log")) for r, _ in RECIPES)


def topology(out):
    """The GPU0-GPU1 entry of `nvidia-smi topo -m` (e.g. NV18), or None."""
    row = re.search(r"(?m)^GPU0\s+X\s+(\S+)", read(out, "topo.txt"))
    return row.group(1) if row else None


def scaling_table(stats, spec=SCALING):
    one = stats[spec[0][0]]
    rows = ["| configuration | avg step ms | tokens/s/GPU | per-GPU scaling vs 1 GPU | communication exposed per step "
            "(ms) | peak GiB |", "|---|---:|---:|---:|---:|---:|"]
    for name, label in spec:
        s = stats[name]
        if not isinstance(s, dict):
            rows.append(f"| {label} | {s} | | | | |")
            continue
        scale = f"{100 * s['tokens'] / one['tokens']:.1f}%" if isinstance(one, dict) else "n/a"
        exposed = f"{s['step_ms'] - one['step_ms']:.1f}" if isinstance(one, dict) and s is not one else "baseline"
        rows.append(f"| {label} | {s['step_ms']:.1f} | {s['tokens']:.0f} | {scale} | {exposed} | {s['peak']:.1f} |")
    return rows


def scaling_findings(stats):
    one = stats["proxy-1gpu"]
    nvlink = [(stats[n]["tokens"] / one["tokens"], label) for n, label in SCALING[1:3]
              if isinstance(one, dict) and isinstance(stats[n], dict)]
    if nvlink:
        best, label = max(nvlink)
        text = [f"Target: 2 GPUs over NVLink >= 97% of 1 GPU's tokens/s/GPU: {verdict(best >= 0.97)} "
                f"({100 * best:.1f}%, the better NVLink row: {label})."]
    else:
        text = ["Target: 2 GPUs over NVLink >= 97% of 1 GPU's tokens/s/GPU: not measured."]
    exposed = {n: stats[n]["step_ms"] - one["step_ms"] for n, _ in SCALING[3:]
               if isinstance(one, dict) and isinstance(stats[n], dict)}
    base = exposed.get("proxy-2gpu-socket-none")
    if base is None:
        return text + ["\nOver sockets: not measured (needs the 1-GPU run and the socket run without overlap)."]
    parts = [f"{exposed[n]:.1f} ms with {what} ({base - exposed[n]:.1f} ms less"
             + (f", {100 * (base - exposed[n]) / base:.0f}% of it)" if base > 0 else ")")
             for n, what in [("proxy-2gpu-socket-grad", "the gradient overlap"),
                             ("proxy-2gpu-socket-both", "both overlaps")] if n in exposed]
    return text + [f"\nOver sockets, {base:.1f} ms of communication per step is exposed without overlap"
                   + (", " + " and ".join(parts) if parts else "; the overlap runs have no results") + "."]


def one_micro_batch_findings(stats):
    """Exposed time without and with both overlaps, over NVLink and over sockets (one micro-batch per step)."""
    one, text = stats["proxy1-1gpu"], []
    for link in ["nvlink", "socket"]:
        a, b = stats[f"proxy1-2gpu-{link}-none"], stats[f"proxy1-2gpu-{link}-both"]
        if isinstance(one, dict) and isinstance(a, dict) and isinstance(b, dict):
            ea, eb = a["step_ms"] - one["step_ms"], b["step_ms"] - one["step_ms"]
            text.append(f"- {'NVLink' if link == 'nvlink' else 'sockets'}: {ea:.1f} ms exposed without overlap, "
                        f"{eb:.1f} ms with both overlaps ({ea - eb:.1f} ms less).")
    return text or ["- not measured."]


def section_one_micro_batch(out):
    stats = {n: run_stats(out, n) for n, _ in SCALING1}
    if not any(isinstance(v, dict) for v in stats.values()):
        return []
    return (["", "With one micro-batch per step (micro-batch 2; global batch 2 on 1 GPU, 4 on 2 GPUs; 12 steps) the "
             "overlaps have the whole backward and forward to hide behind; with 8 micro-batches only the last "
             "micro-batch's backward (for the gradient reduction) and the first one's forward (for the weight "
             "gathers) can hide them, as in Megatron. Default buckets with an overlap: 40M elements.", ""]
            + scaling_table(stats, SCALING1) + [""] + one_micro_batch_findings(stats))


def section_scaling(out, device, commit):
    stats = {n: run_stats(out, n) for n, _ in SCALING}
    link = topology(out)
    text = ["## Data-parallel scaling: llama3-8b-proxy (same run)\n",
            "`nibble train --model llama3-8b-proxy --seq-length 4096 --micro-batch-size 2 --train-iters 8`: the same "
            "per-GPU batch (micro-batch 2 x 8 micro-batches) on 1 GPU (global batch 16) and on 2 GPUs (global batch "
            "32, `--use-distributed-optimizer`), NVLink multicast off (`NCCL_NVLS_ENABLE=0`). Means over "
            f"{timed_steps(stats)}, peak memory of rank 0. Communication exposed per step = avg step ms - the 1-GPU "
            "avg step ms. Device: "
            f"{device}{f' (GPU0-GPU1 link in `nvidia-smi topo -m`: {link})' if link else ''}; commit {commit}.\n"]
    text += scaling_table(stats) + [""] + scaling_findings(stats) + section_one_micro_batch(out)
    return "\n".join(text) + "\n", any(os.path.exists(os.path.join(out, n + ".log")) for n, _ in SCALING)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="results folder of scripts/benchmark_dist.sh")
    ap.add_argument("--merge-into", help="Markdown file whose sections of the same titles are replaced")
    args = ap.parse_args()
    names = [f"8b-{r}" for r, _ in RECIPES] + [n for n, _ in SCALING + SCALING1]
    device, commit = device_and_commit(args.out, names)
    write_report([section_8b(args.out, device, commit), section_scaling(args.out, device, commit)], args.merge_into,
                 args.out, commit)


if __name__ == "__main__":
    main()
