#!/usr/bin/env python3
"""BENCHMARKS.md's Mixture of Representations section from scripts/benchmark_mor.sh's logs: per configuration the
step time, tokens/s/GPU, model TFLOP/s/GPU, MFU, peak memory and the estimate; for each MoR run the mean share of
GEMM operands (and of GEMMs) in FP8 over its steps; MoR's tokens/s against FP8 current scaling's (the issue's goal:
within 5% where >= 95% of operands pick FP8); and what deciding costs per step (the goal: <= 2%): MoR at threshold
0.999 keeps every operand FP8, so its GEMMs are FP8 current scaling's with every layer FP8, and the difference in
tokens/s is the statistic, the board's read-back and the host's decisions (metrics.jsonl mor_decide_ms, shown too).
A second section does the same for the NVFP4 ladder (bf16_with_mor_nvfp4_mixed) against bf16_with_nvfp4_mixed (the
goal: no slower by more than 5%); each section is merged only when its runs are in OUT.

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


def shares(out, name, rung="fp8"):
    """Mean operand and GEMM shares on `rung` (fp8 or nvfp4) over the run's steps, and the mean decision host time
    (ms)."""
    recs = records(out, name)
    ops = [r[f"mor_{rung}_operands"] for r in recs if f"mor_{rung}_operands" in r]
    gemms = [r[f"mor_{rung}_gemms"] for r in recs if f"mor_{rung}_gemms" in r]
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


def ladder_lines(out, stats, model, run, what):
    """The NVFP4 ladder against bf16_with_nvfp4_mixed (its preset and every layer NVFP4); the goal: no slower than
    the NVFP4 recipe by more than 5%."""
    ladder = stats.get(f"{model}-{run}")
    if not ladder:
        return []
    nv_ops, nv_gemms, _ = shares(out, f"{model}-{run}", "nvfp4")
    e4_ops, _, _ = shares(out, f"{model}-{run}")
    out_lines = []
    if nv_ops is not None:
        out_lines.append(f"- {model}, ladder, {what}: {100 * nv_ops:.2f}% of GEMM operands NVFP4, "
                         f"{100 * (e4_ops or 0):.2f}% E4M3, the rest BF16; {100 * nv_gemms:.2f}% of GEMMs NVFP4 "
                         "(mean over the steps)")
    for key, label in (("nvfp4", "bf16_with_nvfp4_mixed (preset)"), ("nvfp4-all", "NVFP4 in every layer")):
        base = stats.get(f"{model}-{key}")
        if base:
            verdict = "met" if ladder / base >= 0.95 else "not met"
            out_lines.append(f"- {model}, ladder, {what}: tokens/s/GPU {ladder / base:.3f}x {label}'s; goal >= 0.95x: "
                             f"{verdict}")
    return out_lines


def ladder_cost_lines(out, stats, model):
    """What deciding adds to the ladder's step: threshold 0.999 keeps every operand NVFP4, against every-layer NVFP4."""
    allnv, nv_all = stats.get(f"{model}-ladder-allnvfp4"), stats.get(f"{model}-nvfp4-all")
    ops, _, decide_ms = shares(out, f"{model}-ladder-allnvfp4", "nvfp4")
    if not (allnv and nv_all and ops is not None):
        return []
    cost = 1 - allnv / nv_all
    return [f"- {model}, ladder, deciding every step: deciding costs {100 * cost:.2f}% of the step (NVFP4 threshold "
            f"0.999 kept {100 * ops:.1f}% of operands NVFP4: {allnv / nv_all:.3f}x the every-layer NVFP4 run's "
            f"tokens/s; the host's time {decide_ms or 0.0:.2f} ms per decision)"]


def block_lines(out, stats, model):
    """The block rule (BF16 GEMMs over operands with FP8 blocks): its FP8 block share and speed against BF16."""
    run, bf16, fp8 = (stats.get(f"{model}-{k}") for k in ("mor-block", "bf16", "fp8"))
    blocks = [r["mor_fp8_blocks"] for r in records(out, f"{model}-mor-block") if "mor_fp8_blocks" in r]
    if not run or not blocks:
        return []
    line = (f"- {model}, --mor-granularity block: {100 * sum(blocks) / len(blocks):.2f}% of operand blocks in E4M3 "
            "(mean over the steps)")
    if bf16:
        line += f"; tokens/s/GPU {run / bf16:.3f}x BF16's"
    if fp8:
        line += f", {run / fp8:.3f}x FP8 current scaling's"
    return [line]


def ladder_block_lines(out, stats, model):
    """The NVFP4 ladder per block (16x16 tiles, or 1x16 blocks on X and dY): its block shares and its speed against
    every-layer NVFP4 and the E4M3 block rule."""
    lines = []
    for name, what in (("ladder-block", "16x16 tiles"), ("ladder-block-rows", "--mor-nvfp4-rows")):
        run = stats.get(f"{model}-{name}")
        rows = [r for r in records(out, f"{model}-{name}") if "mor_nvfp4_blocks" in r]
        if not run or not rows:
            continue
        nv = 100 * sum(r["mor_nvfp4_blocks"] for r in rows) / len(rows)
        fp8 = 100 * sum(r["mor_fp8_blocks"] for r in rows) / len(rows)
        ratios = [f"{run / stats[f'{model}-{peer}']:.3f}x {label}"
                  for peer, label in (("nvfp4-all", "every-layer NVFP4's"), ("mor-block", "the E4M3 block rule's"))
                  if stats.get(f"{model}-{peer}")]
        lines.append(f"- {model}, ladder per block ({what}): {nv:.2f}% of operand blocks NVFP4, {fp8:.2f}% E4M3"
                     + (f"; tokens/s/GPU {', '.join(ratios)}" if ratios else ""))
    return lines


def fp8_lines(out, stats):
    out_lines = []
    for model in ("proxy", "3b"):
        for suffix, what in (("", "deciding every step"), ("-i4", "--mor-interval 4")):
            out_lines += speed_lines(out, stats, model, "mor" + suffix, what)
            out_lines += cost_lines(out, stats, model, "mor-allfp8" + suffix, what)
    return "\n".join(out_lines)


def ladder_section_lines(out, stats):
    out_lines = []
    for model in ("proxy", "3b"):
        for suffix, what in (("", "deciding every step"), ("-i4", "--mor-interval 4")):
            out_lines += ladder_lines(out, stats, model, "ladder" + suffix, what)
        out_lines += ladder_cost_lines(out, stats, model)
        out_lines += ladder_block_lines(out, stats, model)
    return "\n".join(out_lines)


TABLE_HEAD = ("| configuration | GPUs | step (s) | tokens/s/GPU | model TFLOP/s/GPU | MFU | peak memory (GiB) | "
              "estimate (GiB) |\n|---|---:|---:|---:|---:|---:|---:|---:|\n")


def is_ladder(name):
    return "nvfp4" in name or "ladder" in name


def is_block(name):
    return "mor-block" in name


def is_peer(name):
    """BF16 and FP8 current scaling's rows, which the tensor and the block sections both compare with."""
    return name.endswith("-bf16") or name.endswith("-fp8") or name.endswith("-fp8-all")


def main():
    out = sys.argv[1]
    merge = sys.argv[sys.argv.index("--merge-into") + 1] if "--merge-into" in sys.argv else None
    names = [line.split(":")[0] for line in read(out, "runs.txt").splitlines() if line.strip()]
    rows, ladder_rows, block_rows, stats, device = [], [], [], {}, "the GPU machine"
    for name in names:
        text, s = row(out, name)
        if is_ladder(name):
            ladder_rows.append(text)
        else:
            if not is_block(name):
                rows.append(text)
            if is_block(name) or is_peer(name):
                block_rows.append(text)
        stats[name] = tokens(s)
        device = s.get("device", device)
    # The tensor rule's section is merged only when a tensor-rule run is in OUT (a block-rule call measures its peers
    # too, which alone would replace the tensor rule's rows).
    tensor_runs = any("-mor" in n and not is_block(n) and not is_ladder(n) for n in names)
    commit = read(out, "commit.txt").strip() or "unknown"
    text = (
        "## Mixture of Representations: bf16_with_mor_fp8_mixed on one GPU (same run)\n\n"
        f"`scripts/benchmark_mor.sh` on {device} (commit {commit}): mock data, sequence 8192, micro-batch 1; the 8B "
        "proxy (global batch 8, 8 steps) and Llama 3.2 3B (global batch 4, 6 steps, selective recompute). `-all` rows "
        "keep every layer FP8 as MoR's preset does (the FP8 preset keeps the first and last in BF16); `-allfp8` rows "
        "run MoR at threshold 0.999, which keeps every operand FP8 (what deciding costs); `-i4` rows decide "
        "after steps 1, 5 and 9 of 9 (`--mor-interval 4`: 2 of the 8 timed steps measure). Step time is the mean "
        "after step 1; the estimate is the memory estimate's total.\n\n"
        + TABLE_HEAD + "\n".join(rows) + "\n\n" + fp8_lines(out, stats) + "\n")
    ladder_text = (
        "## Mixture of Representations: the NVFP4 ladder (bf16_with_mor_nvfp4_mixed) on one GPU (same run)\n\n"
        f"`scripts/benchmark_mor.sh` on {device} (commit {commit}), as the section above: `ladder` rows run "
        "bf16_with_mor_nvfp4_mixed at its default thresholds (NVFP4 0.3, E4M3 0.045), `-allnvfp4` at NVFP4 threshold "
        "0.999 (every operand NVFP4: its GEMMs are the every-layer NVFP4 run's, so the difference is what deciding "
        "costs), `-i4` with `--mor-interval 4` (9 steps); `nvfp4` is bf16_with_nvfp4_mixed's preset (its last 4 layers "
        "BF16, which on the 4-layer proxy is every layer: the proxy has only the every-layer row, `-all`); `ladder-block` "
        "rows run the ladder per 128x128 block (`--mor-granularity block`, 16x16 NVFP4 tiles; `-rows` with "
        "`--mor-nvfp4-rows`: 1x16 blocks on X and dY, a copy per direction), whose GEMMs are BF16 GEMMs. On Hopper "
        "NVFP4 GEMMs are emulated (dequantized to BF16, then BF16 tensor cores).\n\n"
        + TABLE_HEAD + "\n".join(ladder_rows) + "\n\n" + ladder_section_lines(out, stats) + "\n")
    block_text = (
        "## Mixture of Representations: the block rule (--mor-granularity block) on one GPU (same run)\n\n"
        f"`scripts/benchmark_mor.sh` on {device} (commit {commit}), as the sections above: `mor-block` rows run "
        "bf16_with_mor_fp8_mixed with `--mor-granularity block` (each 128x128 block of every operand E4M3 or BF16 by "
        "its own error, every step, GAM scales), beside BF16 and FP8 current scaling (its preset). The block rule's "
        "GEMMs are BF16 GEMMs over operands whose E4M3-decided blocks hold their FP8 values, so on Hopper it costs "
        "its rule's pass over every operand and cannot run faster than BF16.\n\n"
        + TABLE_HEAD + "\n".join(block_rows) + "\n\n"
        + "\n".join(sum((block_lines(out, stats, m) for m in ("proxy", "3b")), [])) + "\n")
    write_report([(text, tensor_runs and bool(rows)), (ladder_text, bool(ladder_rows)),
                  (block_text, any(is_block(n) for n in names))], merge, out, commit)


if __name__ == "__main__":
    main()
