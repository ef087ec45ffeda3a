#!/usr/bin/env python3
"""Regenerates CONVERGENCE.md and its SVG plots from the stored runs of the numerics study.

  python3 scripts/convergence_report.py bench/convergence

Reads STUDY/runs/<config>-s<seed>/{meta.json,metrics.jsonl} (written by scripts/convergence.sh) and
STUDY/corpus.json (the corpus manifest). Writes CONVERGENCE.md at the repository root and the plots into
STUDY/. Standard library only. Every number in the report is computed here from the stored metrics; the
verdicts compare each effect with the seed spread of the BF16-vs-NVFP4 difference.
"""
import json
import math
import os
import statistics
import sys
from xml.sax.saxutils import escape

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot_losses import frame, nice_ticks, polyline  # noqa: E402  (the same axes as the loss plots)

ORDER = ["bf16", "fp8", "mxfp8", "nvfp4", "nvfp4_all", "nvfp4_no_rht", "nvfp4_no_sr", "nvfp4_no_2d", "nvfp4_none",
         "nvfp4_anneal", "nvfp4_4over6", "nvfp4_4over6_mae"]
TITLES = {
    "bf16": "BF16 (bf16_mixed)", "fp8": "FP8 current scaling", "mxfp8": "MXFP8",
    "nvfp4": "NVFP4 (paper: last 2 of 12 blocks BF16)", "nvfp4_all": "NVFP4 in every block",
    "nvfp4_no_rht": "NVFP4 without RHT", "nvfp4_no_sr": "NVFP4 without SR", "nvfp4_no_2d": "NVFP4 without 2D",
    "nvfp4_none": "NVFP4 without RHT, SR, 2D", "nvfp4_anneal": "NVFP4, last 20% in BF16 (annealing)",
    "nvfp4_4over6": "NVFP4 with 4/6 (weights + activations), MSE",
    "nvfp4_4over6_mae": "NVFP4 with 4/6 (weights + activations), MAE",
}
COLOURS = ["#000000", "#1f77b4", "#17becf", "#d62728", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#2ca02c", "#bcbd22", "#6b6ecf"]
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
        train, valid, quant, anneal = {}, {}, [], []
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
        meta.update(train=train, valid=sorted(valid.items()), quant=quant, anneal=anneal)
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


def rel_diff_by_seed(runs, config, metric, base_config="bf16"):
    """{seed: (config - base) / base in %} for every seed both configurations have."""
    base = runs.get(base_config, {})
    return {s: 100.0 * (metric(r) - metric(base[s])) / metric(base[s])
            for s, r in sorted(runs.get(config, {}).items()) if s in base}


def paired_rel_diff(runs, config, metric):
    """(config - bf16) / bf16 in % for every seed both have, in seed order."""
    return list(rel_diff_by_seed(runs, config, metric).values())


def fmt_pm(m, sd, n, unit=""):
    if math.isnan(m):
        return "–"
    return f"{m:+.2f}{unit}" + (f" ± {sd:.2f}" if n > 1 and not math.isnan(sd) else "") + f" (n={n})"


def loss_plots(runs, root):
    """Training (smoothed) and validation loss of seed 1 (or the lowest seed) of every configuration, and
    the paired difference to BF16 over tokens."""
    made = []
    train_s, valid_s, diff_s = [], [], []
    for i, c in enumerate(ORDER):
        if c not in runs:
            continue
        seed = min(runs[c])
        run = runs[c][seed]
        k = tokens_per_step(run) / 1e6
        colour, dashed = COLOURS[i % len(COLOURS)], c.startswith("nvfp4_no") or c == "nvfp4_none"
        train_s.append((f"{c} (seed {seed})", colour, [(it * k, y) for it, y in smoothed(run)], dashed))
        valid_s.append((f"{c} (seed {seed})", colour, [(it * k, y) for it, y in run["valid"]], dashed))
        if c != "bf16" and seed in runs.get("bf16", {}):
            base = dict(smoothed(runs["bf16"][seed]))
            d = [(it * k, 100.0 * (y - base[it]) / base[it]) for it, y in smoothed(run) if it in base]
            diff_s.append((f"{c} (seed {seed})", colour, d, dashed))
    if chart(train_s, f"Training loss ({SMOOTH}-step moving average)", "tokens (millions)", "loss (nats/token)",
             os.path.join(root, "train_loss.svg")):
        made.append(("Training loss", "train_loss.svg"))
    if chart(valid_s, "Validation loss (held-out split)", "tokens (millions)", "loss (nats/token)",
             os.path.join(root, "val_loss.svg")):
        made.append(("Validation loss", "val_loss.svg"))
    if chart(diff_s, "Training loss relative to BF16, same seed", "tokens (millions)", "difference to BF16 (%)",
             os.path.join(root, "loss_diff.svg"), hline=0.0):
        made.append(("Loss difference to BF16", "loss_diff.svg"))
    return made


def results_table(runs):
    rows = ["| configuration | seeds | final validation loss | vs. BF16, paired (%) | final training loss "
            "(last 50 steps) | vs. BF16, paired (%) | tokens/s/GPU |", "|---|---:|---:|---:|---:|---:|---:|"]
    for c in ORDER:
        if c not in runs:
            continue
        rs = list(runs[c].values())
        v, vsd, n = mean_sd([final_val(r) for r in rs])
        t, tsd, _ = mean_sd([final_train(r) for r in rs])
        dv = mean_sd(paired_rel_diff(runs, c, final_val)) if c != "bf16" else (float("nan"),) * 3
        dt = mean_sd(paired_rel_diff(runs, c, final_train)) if c != "bf16" else (float("nan"),) * 3
        tps = statistics.fmean(statistics.median(x["tokens_per_s_per_gpu"] for x in r["train"].values()
                                                 if "tokens_per_s_per_gpu" in x) for r in rs)
        rows.append(f"| {TITLES[c]} | {', '.join(str(s) for s in sorted(runs[c]))} | {v:.4f}"
                    + (f" ± {vsd:.4f}" if n > 1 else "") + f" | {fmt_pm(*dv, unit='%')} | {t:.4f}"
                    + (f" ± {tsd:.4f}" if n > 1 else "") + f" | {fmt_pm(*dt, unit='%')} | {tps:,.0f} |")
    return rows


def verdicts(runs):
    """The paper's findings, each checked against the stored runs with the seed spread beside it."""
    out = []
    nv = paired_rel_diff(runs, "nvfp4", final_val)
    m, sd, n = mean_sd(nv)
    noise = sd if n > 1 else float("nan")
    if n:
        lo = m - (sd if n > 1 else 0.0)
        verdict = ("reproduced" if abs(m) <= 1.5 else
                   "consistent within the seed spread (mean minus one standard deviation is inside 1.5%)"
                   if lo <= 1.5 else "not reproduced: the gap is larger")
        worse = sum(d > 0 for d in nv)
        out.append(f"- **NVFP4 within about 1-1.5% of BF16 (paper):** NVFP4's final validation loss is {m:+.2f}%"
                   + (f" ± {sd:.2f}% (paired over {n} seeds: " + ", ".join(f"{d:+.2f}%" for d in nv) + ")"
                      if n > 1 else " (one seed)")
                   + f" from BF16; NVFP4 is worse in {worse} of {n} seeds. Verdict: {verdict}.")
    else:
        out.append("- **NVFP4 within about 1-1.5% of BF16:** no paired runs stored yet.")
    # (configuration, the feature, what the configuration does to it, paper): removed = the run lacks the
    # feature (it helps when the loss rises), added = the run adds it (it helps when the loss falls).
    for c, what, change, source in (("nvfp4_no_rht", "RHT", "removed", "paper"),
                                    ("nvfp4_no_sr", "SR", "removed", "paper"),
                                    ("nvfp4_no_2d", "2D", "removed", "paper"),
                                    ("nvfp4_none", "RHT+SR+2D", "removed", "paper"),
                                    ("nvfp4_all", "keeping the last blocks in BF16", "removed", "paper"),
                                    ("nvfp4_4over6", "4/6 block scaling (MSE)", "added", "Four Over Six"),
                                    ("nvfp4_4over6_mae", "4/6 block scaling (MAE)", "added",
                                     "Four Over Six, TransformerEngine's default")):
        by_seed = rel_diff_by_seed(runs, c, final_val, base_config="nvfp4")
        d = list(by_seed.values())
        if not d:
            out.append(f"- **{what} helps:** not measured yet (no `{c}` run with a matching NVFP4 seed).")
            continue
        dm, dsd, dn = mean_sd(d)
        gain = dm if change == "removed" else -dm  # > 0: the feature lowers the loss
        spread = dsd if dn > 1 else noise
        if math.isnan(spread):
            verdict = "no seed spread to judge against yet"
        elif gain > 2 * spread:
            verdict = "helps (its effect on the loss is more than twice the seed spread)"
        elif gain < -2 * spread:
            verdict = "hurts at this scale (its effect on the loss is more than twice the seed spread)"
        else:
            verdict = "no effect distinguishable from seed noise at this scale"
        run = f"without {what}" if change == "removed" else f"with {what}"
        out.append(f"- **{what[0].upper() + what[1:]} helps ({source}):** {run} the validation loss is {dm:+.2f}% "
                   f"vs. NVFP4 ({'seed' + ('s ' if dn > 1 else ' ') + ', '.join(str(s) for s in by_seed)}; "
                   f"seed spread of the NVFP4-BF16 difference: {noise:.2f}%): {verdict}.")
    # Paired by seed: the gap and the annealed run's difference over the seeds both configurations have.
    gaps, annealed = rel_diff_by_seed(runs, "nvfp4", final_val), rel_diff_by_seed(runs, "nvfp4_anneal", final_val)
    seeds = sorted(gaps.keys() & annealed.keys())
    if seeds:
        gap, agap = statistics.fmean(gaps[s] for s in seeds), statistics.fmean(annealed[s] for s in seeds)
        closed = (gap - agap) / gap if gap > 0 else float("nan")
        per_seed = [(gaps[s] - annealed[s]) / gaps[s] for s in seeds if gaps[s] > 0]
        out.append(f"- **Annealing closes most of the gap (paper):** over seed{'s' if len(seeds) > 1 else ''} "
                   + ", ".join(str(s) for s in seeds) + f", NVFP4 {gap:+.2f}%, annealed {agap:+.2f}% vs. BF16"
                   + (f": {100 * closed:.0f}% of the gap closed" if not math.isnan(closed) else
                      ": NVFP4 shows no gap to close")
                   + (" (per seed: " + ", ".join(f"{100 * x:.0f}%" for x in per_seed) + ")" if per_seed else "")
                   + f"; seed spread of the NVFP4-BF16 difference: {noise:.2f}%.")
    else:
        out.append("- **Annealing closes most of the gap:** not measured yet.")
    return out


def header(runs, root):
    metas = [r for c in runs.values() for r in c.values()]
    devices = sorted({m["device"] for m in metas if m.get("device")})
    commits = sorted({m["commit"] for m in metas})
    tokens = sorted({m["tokens"] for m in metas})
    corpus = json.load(open(os.path.join(root, "corpus.json"))) if os.path.isfile(os.path.join(root, "corpus.json")) else {}
    lines = ["# Convergence: how nibble's NVFP4 trains", "",
             "Generated by `bash scripts/convergence.sh report` from the runs stored in `bench/convergence/runs/` "
             "(each run: `bash scripts/convergence.sh run CONFIG SEED` on a GPU; runs accumulate across sessions).", "",
             f"- **Model:** llama-125m (12 blocks, hidden 768, GQA 12/4 heads, tied embeddings), sequence 1024, "
             f"global batch 64 (65,536 tokens per step), AdamW (0.9, 0.95, weight decay 0.1), peak LR 6e-4 with "
             f"150 warmup steps and cosine decay to 6e-5, gradient clip 1.0.",
             f"- **Tokens per run:** {', '.join(f'{t:,}' for t in tokens)}; every run stays under one epoch of the "
             "training split, and the validation split (documents never trained on) is scored every 100 steps "
             "(10 global batches, 655,360 tokens).",
             f"- **Device:** {', '.join(devices) or 'unknown'}; **commits:** {', '.join(commits)}.",
             ]
    if corpus:
        parts = ", ".join(f"{k} {v['documents']:,} documents / {v['bytes'] / 1e6:.0f} MB"
                          for k, v in corpus.get("sources", {}).items())
        lines.append(f"- **Corpus** (`scripts/setup_study_data.sh`, Debian packages): {parts}; "
                     f"{corpus.get('tokens', 0):,} GPT-2 tokens in all, split 969/30/1 by document "
                     f"(training split about {int(corpus.get('tokens', 0) * 0.969):,} tokens).")
    return lines


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "bench/convergence"
    runs = load_runs(root)
    if not runs:
        sys.exit(f"convergence_report.py: no runs under {root}/runs (run scripts/convergence.sh first)")
    lines = header(runs, root) + ["", "## What this scale reproduces", ""] + verdicts(runs)
    missing = [c for c in ORDER if c not in runs]
    lines += ["", "## Results", "",
              "Final validation loss: the last evaluation (after the last step). Training loss: the mean of the last "
              f"{SMOOTH} steps. Paired differences compare runs with the same seed (same initial weights and data "
              "order); ± is the standard deviation over seeds.", ""] + results_table(runs)
    if missing:
        lines += ["", "Not run yet: " + ", ".join(f"`{c}`" for c in missing) + "."]
    for title, svg in loss_plots(runs, root) + quant_plots(runs, root):
        lines += ["", f"### {title}", "", f"![{title}](bench/convergence/{svg})"]
    rht = rht_table(runs, load_runs(root, "crest"))
    if rht:
        lines += ["", "## Does RHT lower the Wgrad error? (measured on the runs' own tensors)", "",
                  "Each `--quant-stats` step measures, for every quantized Linear, the first micro-batch's weight "
                  "gradient three ways: from the BF16 operands (dW_ref), with the recipe's NVFP4 Wgrad operands "
                  "(RHT on both, SR on dY) and with the same operands quantized without RHT (same SR bytes). "
                  "Relative error = ||dW_q - dW_ref|| / ||dW_ref||.", ""] + rht
    lines += [""] + notes(root)
    with open("CONVERGENCE.md", "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print(f"convergence_report: CONVERGENCE.md from {sum(len(v) for v in runs.values())} runs of "
          f"{len(runs)} configurations")


def notes(root):
    path = os.path.join(root, "NOTES.md")
    return open(path, encoding="utf-8").read().splitlines() if os.path.isfile(path) else []


def per_linear(run):
    return [q for q in run["quant"] if "quant_stats" in q]


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


if __name__ == "__main__":
    main()
