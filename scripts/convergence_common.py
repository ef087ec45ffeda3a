#!/usr/bin/env python3
"""The numerics study's runs as convergence_report.py reads them (scripts/convergence.sh writes them), the
configurations' names and colours, the per-run losses, and the SVG line chart of the report's plots."""
import json
import math
import os
import statistics
import sys
from xml.sax.saxutils import escape

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot_losses import frame, nice_ticks, polyline  # noqa: E402  (the same axes as the loss plots)

ORDER = ["bf16", "fp8", "mxfp8", "nvfp4", "nvfp4_all", "nvfp4_no_rht", "nvfp4_no_sr", "nvfp4_no_2d", "nvfp4_none",
         "nvfp4_anneal", "nvfp4_4over6", "nvfp4_4over6_mae", "mor_fp8", "mor_nvfp4", "mor_fp8_block",
         "mor_fp8_now", "mor_fp8_channel", "mor_nvfp4_block", "mor_nvfp4_block_rows"]
TITLES = {
    "bf16": "BF16 (bf16_mixed)", "fp8": "FP8 current scaling", "mxfp8": "MXFP8",
    "nvfp4": "NVFP4 (paper: last 2 of 12 blocks BF16)", "nvfp4_all": "NVFP4 in every block",
    "nvfp4_no_rht": "NVFP4 without RHT", "nvfp4_no_sr": "NVFP4 without SR", "nvfp4_no_2d": "NVFP4 without 2D",
    "nvfp4_none": "NVFP4 without RHT, SR, 2D", "nvfp4_anneal": "NVFP4, last 20% in BF16 (annealing)",
    "nvfp4_4over6": "NVFP4 with 4/6 (weights + activations), MSE",
    "nvfp4_4over6_mae": "NVFP4 with 4/6 (weights + activations), MAE",
    "mor_fp8": "MoR, E4M3 or BF16 per tensor (bf16_with_mor_fp8_mixed)",
    "mor_nvfp4": "MoR's NVFP4 ladder per tensor (bf16_with_mor_nvfp4_mixed)",
    "mor_fp8_block": "MoR, E4M3 or BF16 per 128x128 block (--mor-granularity block)",
    "mor_fp8_now": "MoR, E4M3 or BF16 per tensor, each decided in its own step (--mor-decide-now)",
    "mor_fp8_channel": "MoR per tensor, measuring per-channel scaling's error too (--mor-channel-statistic)",
    "mor_nvfp4_block": "MoR's NVFP4 ladder per 128x128 block (--mor-granularity block)",
    "mor_nvfp4_block_rows": "MoR's NVFP4 ladder per 128x128 block, 1x16 NVFP4 blocks on X and dY (--mor-nvfp4-rows)",
}
COLOURS = ["#000000", "#1f77b4", "#17becf", "#d62728", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#2ca02c", "#bcbd22", "#6b6ecf", "#393b79", "#e7ba52", "#843c39", "#5254a3", "#8ca252", "#de9ed6",
           "#637939"]
W, H, L, R, T, B = 860, 500, 80, 250, 48, 58
SMOOTH = 50  # steps in the training-loss moving average


def load_runs(root, sub="runs"):
    """Runs stored under root/sub: {config: {seed: meta + metrics}}. sub "crest" holds the short runs taken
    only for their block crest factors (not part of the loss comparison)."""
    runs = {}
    if not os.path.isdir(os.path.join(root, sub)):
        return runs
    for name in sorted(os.listdir(os.path.join(root, sub))):
        d = os.path.join(root, sub, name)
        if not os.path.isfile(os.path.join(d, "meta.json")):
            continue
        meta = json.load(open(os.path.join(d, "meta.json")))
        train, valid, quant, anneal, mor = {}, {}, [], [], []
        for line in open(os.path.join(d, "metrics.jsonl")):
            r = json.loads(line)
            if isinstance(r.get("lm_loss"), (int, float)):
                train[r["iteration"]] = r
            elif isinstance(r.get("val_loss"), (int, float)):
                valid[r["iteration"]] = r["val_loss"]
            elif "quant_stats" in r or "quant_worst_sqnr_db" in r:
                quant.append(r)
            elif "anneal" in r:
                anneal.append(r)
            elif "mor_linear" in r:
                mor.append(r)
        meta.update(train=train, valid=sorted(valid.items()), quant=quant, anneal=anneal, mor=mor, eval={})
        meta.setdefault("deterministic", False)  # runs from before --deterministic-mode have no key
        for which in ("valid", "heldout"):
            path = os.path.join(d, f"eval_{which}.json")
            if os.path.isfile(path):
                meta["eval"][which] = json.load(open(path))
        runs.setdefault(meta["config"], {})[meta["seed"]] = meta
    return runs


def smoothed(run):
    """Moving average of the training loss over the last SMOOTH steps, per iteration."""
    its = sorted(run["train"])
    out, window = [], []
    for it in its:
        window.append(run["train"][it]["lm_loss"])
        if len(window) > SMOOTH:
            window.pop(0)
        if len(window) == SMOOTH:
            out.append((it, sum(window) / SMOOTH))
    return out


def final_train(run):
    s = smoothed(run)
    return s[-1][1] if s else float("nan")


def final_val(run):
    return run["valid"][-1][1] if run["valid"] else float("nan")


def tokens_per_step(run):
    return run["tokens"] / run["iterations"]


def chart(series, title, xlabel, ylabel, path, hline=None):
    """series: [(name, colour, [(x, y)], dashed)]; writes an SVG line chart with a legend on the right."""
    pts = [p for _, _, s, _ in series for p in s]
    if not pts:
        return False
    xt, xs = nice_ticks(0, max(x for x, _ in pts))
    ys_all = [y for _, y in pts] + ([hline] if hline is not None else [])
    yt, ys = nice_ticks(min(ys_all), max(ys_all))
    x0, x1, y0, y1 = xt[0], xt[-1], yt[0], yt[-1]
    sx = lambda x: L + (x - x0) / (x1 - x0) * (W - L - R)
    sy = lambda y: H - B - (y - y0) / (y1 - y0) * (H - T - B)
    out = frame(title, xlabel, ylabel, xt, xs, yt, ys, sx, sy, (W, H, L, R, T, B), (L + W - R) / 2)
    if hline is not None:
        out.append(f'<line x1="{L}" y1="{sy(hline):.1f}" x2="{W - R}" y2="{sy(hline):.1f}" stroke="#555" '
                   'stroke-dasharray="6,4"/>')
    for i, (name, colour, s, dashed) in enumerate(series):
        line = polyline(s, sx, sy, colour, 1.6)
        if dashed:
            line = line.replace("/>", ' stroke-dasharray="5,3"/>')
        out.append(line)
        y = T + 10 + 18 * i
        out.append(f'<line x1="{W - R + 12}" y1="{y}" x2="{W - R + 36}" y2="{y}" stroke="{colour}" stroke-width="2.5"'
                   + (' stroke-dasharray="5,3"' if dashed else "") + "/>")
        out.append(f'<text x="{W - R + 42}" y="{y + 4}" font-size="11">{escape(name)}</text>')
    out.append("</svg>")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")
    return True


def mean_sd(xs):
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return float("nan"), float("nan"), 0
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else float("nan")), len(xs)


def heldout_loss(run):
    return run.get("eval", {}).get("heldout", {}).get("mean_nll", float("nan"))


def valid_eval_loss(run):
    return run.get("eval", {}).get("valid", {}).get("mean_nll", float("nan"))
