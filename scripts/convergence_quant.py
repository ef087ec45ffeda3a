#!/usr/bin/env python3
"""CONVERGENCE.md's quantization telemetry, from the NVFP4 runs' per-Linear `--quant-stats` records: SQNR,
underflow/saturation and Wgrad SNR plots, the RHT-toggled Wgrad error and block crest factor tables, and each
run's crest-factor vote (convergence_report.py turns the vote into the RHT prediction)."""
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from convergence_common import COLOURS, TITLES, chart, tokens_per_step  # noqa: E402


def per_linear(run):
    return [q for q in run["quant"] if "quant_stats" in q]


def crest_vote(run):
    """Operand records (X and dY of every quantized Linear at every stats step) where the RHT lowers the block
    crest factor, and where it raises it; (0, 0) for a run whose binary predates the statistic."""
    lowered = raised = 0
    for q in per_linear(run):
        for role in ("input", "grad"):
            r = q.get("roles", {}).get(role, {})
            if r.get("crest") is not None and r.get("crest_rht") is not None:
                lowered += r["crest_rht"] < r["crest"]
                raised += r["crest_rht"] > r["crest"]
    return lowered, raised


def quant_plots(runs, root):
    """From the NVFP4 runs' per-Linear records (--quant-stats): each role's SQNR and the Wgrad SNR over
    training (median over the quantized Linears, seed 1 or the lowest), against the sqrt(3) criterion."""
    made = []
    for c in ("nvfp4", "nvfp4_all"):
        if c not in runs or not per_linear(runs[c][min(runs[c])]):
            continue
        run = runs[c][min(runs[c])]
        k = tokens_per_step(run) / 1e6
        by_it = {}
        for q in per_linear(run):
            by_it.setdefault(q["iteration"], []).append(q)
        med = lambda xs: statistics.median(xs) if xs else float("nan")
        series = []
        for i, role in enumerate(("input", "weight", "grad")):
            pts = [(it * k, med([q["roles"][role]["sqnr_db"] for q in qs if role in q["roles"]
                                 and q["roles"][role]["sqnr_db"] is not None])) for it, qs in sorted(by_it.items())]
            series.append((f"{role} SQNR (dB)", COLOURS[i + 1], pts, False))
        if chart(series, f"{c}: quantization SQNR per role (median over Linears)", "tokens (millions)", "SQNR (dB)",
                 os.path.join(root, f"{c}_sqnr.svg")):
            made.append((f"{TITLES[c]}: SQNR per role", f"{c}_sqnr.svg"))
        if chart(range_series(by_it, k, med), f"{c}: underflow and saturation per role (median over Linears)",
                 "tokens (millions)", "% of elements", os.path.join(root, f"{c}_range.svg")):
            made.append((f"{TITLES[c]}: underflow (flushed to zero, solid) and saturation (dashed) per role",
                         f"{c}_range.svg"))
        snr = [("median", COLOURS[3], [(it * k, med([q["wgrad"]["snr"] for q in qs if "wgrad" in q]))
                                       for it, qs in sorted(by_it.items())], False),
               ("lowest Linear", COLOURS[4], [(it * k, min(q["wgrad"]["snr"] for q in qs if "wgrad" in q))
                                              for it, qs in sorted(by_it.items())], True)]
        if chart(snr, f"{c}: Wgrad signal-to-quantization-noise (dashed line: sqrt 3)", "tokens (millions)",
                 "||dW_ref|| / ||dW_q - dW_ref||", os.path.join(root, f"{c}_wgrad_snr.svg"), hline=math.sqrt(3)):
            made.append((f"{TITLES[c]}: Wgrad SNR against the sqrt(3) criterion", f"{c}_wgrad_snr.svg"))
    return made


def range_series(by_it, k, med):
    """Per role, the flushed (underflow) share of non-zero elements, solid, and the saturated share, dashed,
    in percent. NVFP4 stores each block's largest element at the top code, so saturation is at least 1/16
    for 1x16 blocks (inputs, gradients) and 1/256 for 16x16 weight tiles."""
    series = []
    for i, role in enumerate(("input", "weight", "grad")):
        for key, dashed in (("flushed", False), ("saturated", True)):
            pts = [(it * k, 100.0 * med([q["roles"][role][key] for q in qs if role in q["roles"]
                                         and q["roles"][role][key] is not None]))
                   for it, qs in sorted(by_it.items())]
            series.append((f"{role} {key}", COLOURS[i + 1], pts, dashed))
    return series


def rht_table(runs, crest_runs):
    """Per Linear kind, the relative Wgrad error with the recipe's RHT and with RHT toggled, averaged over
    every stats step of every NVFP4 seed (real activations and gradients of the study's runs)."""
    rows, acc = [], {}
    for c in ("nvfp4", "nvfp4_all"):
        for run in runs.get(c, {}).values():
            for q in per_linear(run):
                if "wgrad_alt" not in q:
                    continue
                kind = q["quant_stats"].split(".")[-1]
                e = acc.setdefault((c, kind), [[], [], 0])
                e[0].append(q["wgrad"]["rel_err"])
                e[1].append(q["wgrad_alt"]["rel_err"])
                e[2] += q["wgrad_alt"]["rel_err"] < q["wgrad"]["rel_err"]
    if not acc:
        return rows
    rows += ["| run | Linear | records | Wgrad rel. error, with RHT | without RHT | without / with | "
             "records where RHT lost |", "|---|---|---:|---:|---:|---:|---:|"]
    for (c, kind), (w, wo, lost) in sorted(acc.items()):
        rows.append(f"| {c} | {kind} | {len(w)} | {statistics.fmean(w):.4f} | {statistics.fmean(wo):.4f} | "
                    f"{statistics.fmean(wo) / statistics.fmean(w):.3f} | {lost} |")
    return rows + crest_table([("", runs), (" (short run)", crest_runs)])


def crest_table(sources):
    """Mean crest factor (max|x| / rms) of the Wgrad operands' column-wise blocks (16 tokens of one feature),
    before and after the RHT, per Linear kind: the quantity that decides whether the RHT lowers the error.
    Records from binaries before the statistic have none; then there is no table."""
    acc = {}
    for suffix, runs in sources:
        for c in ("nvfp4", "nvfp4_all"):
            for run in runs.get(c, {}).values():
                label = c + suffix + (f", {run['tokens'] / 1e6:.0f}M tokens" if suffix else "")
                crest_records(label, run, acc)
    if not acc:
        return []
    rows = ["", "Block crest factors of the Wgrad operands (mean of max|x| / rms over the sampled 16-token "
            "column blocks; a Gaussian block has about 2.1). On synthetic operands (tests/nvfp4/rht_study_test.cpp) "
            "the RHT raises the FP4 error of an operand whose crest factor it lowers, and lowers it where it raises "
            "the crest factor.", "",
            "| run | Linear | operand | records | crest factor | after RHT |", "|---|---|---|---:|---:|---:|"]
    for (c, kind, role), (before, after) in sorted(acc.items()):
        name = "X (input)" if role == "input" else "dY (grad)"
        rows.append(f"| {c} | {kind} | {name} | {len(before)} | {statistics.fmean(before):.3f} | "
                    f"{statistics.fmean(after):.3f} |")
    return rows


def crest_records(label, run, acc):
    for q in per_linear(run):
        kind = q["quant_stats"].split(".")[-1]
        for role in ("input", "grad"):
            r = q.get("roles", {}).get(role, {})
            if r.get("crest") is not None and r.get("crest_rht") is not None:
                e = acc.setdefault((label, kind, role), [[], []])
                e[0].append(r["crest"])
                e[1].append(r["crest_rht"])
