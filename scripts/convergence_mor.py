#!/usr/bin/env python3
"""Mixture of Representations in the numerics study (docs/MOR.md): the share of GEMM operands in each format over
training (the training lines' mor_* fields) and where the fallbacks from the top rung land, by Linear, operand,
layer and decision step (the per-Linear `mor_linear` records of every 100th step that scripts/convergence.sh keeps).
A record's format is the one its decision chose for the steps that follow it."""
import os
import statistics

from convergence_common import COLOURS, TITLES, chart, tokens_per_step

ROLES = ("input", "weight", "grad")
ROLE_NAMES = {"input": "X (input)", "weight": "W (weight)", "grad": "dY (gradient)"}
# The top rung of each MoR configuration and the rungs below it, in order.
RUNGS = {"mor_fp8": ("e4m3", "bf16"), "mor_nvfp4": ("nvfp4", "e4m3", "bf16")}
FORMAT_NAMES = {"nvfp4": "NVFP4", "e4m3": "E4M3", "bf16": "BF16"}


def operand_shares(row, config):
    """{format: share of the step's GEMM operands} from one training line."""
    nv = row.get("mor_nvfp4_operands", 0.0) if config == "mor_nvfp4" else 0.0
    fp8 = row.get("mor_fp8_operands", 0.0)
    return {"nvfp4": nv, "e4m3": fp8, "bf16": max(0.0, 1.0 - nv - fp8)}


def share_plots(runs, root):
    """One chart per MoR configuration: each format's share of the operands over training, mean over seeds."""
    made = []
    for config, rungs in RUNGS.items():
        seeds = runs.get(config, {})
        if not seeds:
            continue
        k = tokens_per_step(next(iter(seeds.values()))) / 1e6
        steps = sorted(set.intersection(*(set(r["train"]) for r in seeds.values())))
        series = []
        for i, fmt in enumerate(rungs):
            pts = [(it * k, 100 * statistics.fmean(operand_shares(r["train"][it], config)[fmt] for r in seeds.values()))
                   for it in steps if all("mor_fp8_operands" in r["train"][it] for r in seeds.values())]
            series.append((FORMAT_NAMES[fmt], COLOURS[i + 1], pts, False))
        svg = f"{config}_shares.svg"
        if chart(series, f"{config}: GEMM operands per format (mean over {len(seeds)} seeds)", "tokens (millions)",
                 "% of operands", os.path.join(root, svg)):
            made.append((f"{TITLES[config]}: the operands' formats over training", svg))
    return made


def pct(n, d):
    return f"{100 * n / d:.1f}%" if d else "–"


def fallback_counts(records, key):
    """{key(record, role): [the format each of those decisions chose]} over every record and role."""
    out = {}
    for r in records:
        for role in ROLES:
            if role in r:
                out.setdefault(key(r, role), []).append(r[role]["format"])
    return out


def layer_of(name):
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else -1


def fallback_table(title, counts, rungs):
    lower = rungs[1:]
    head = f"| {title} | decisions | " + " | ".join(f"{FORMAT_NAMES[f]}" for f in rungs) + " |"
    rows = [head, "|---|---:|" + "---:|" * len(rungs)]
    for key, fmts in sorted(counts.items()):
        cells = [pct(sum(f == fmt for f in fmts), len(fmts)) for fmt in rungs]
        # The top rung in bold only where nothing fell back: the eye finds the fallbacks.
        if not any(f in lower for f in fmts):
            cells[0] = f"**{cells[0]}**"
        rows.append(f"| {key} | {len(fmts)} | " + " | ".join(cells) + " |")
    return rows


def lag_line(seeds, config, rungs):
    """What the one-step lag changes, bounded from below: between consecutive decisions (step 2 on, the first decision
    excluded), the operands whose format changed, net per format (the training lines carry every step's shares; two
    opposite flips of one step cancel). Each such operand ran one step on the format its own step's data reversed."""
    changed, operand_steps = [], []
    for run in seeds.values():
        rows = [row for it, row in sorted(run["train"].items()) if "mor_fp8_operands" in row and it >= 2]
        n = run.get("mor_operands", 0)
        if len(rows) < 2 or not n:
            continue
        moved = 0.0
        for a, b in zip(rows, rows[1:]):
            sa, sb = operand_shares(a, config), operand_shares(b, config)
            moved += sum(max(0.0, sb[f] - sa[f]) for f in rungs) * n
        changed.append(100 * moved / (n * (len(rows) - 1)))
        operand_steps.append(len(rows) - 1)
    if not changed:
        return []
    return [f"The lag (decisions read the step before theirs): between consecutive decisions at least "
            f"{statistics.fmean(changed):.2f}% of the operands changed format (mean over {len(changed)} seeds, "
            f"{min(changed):.2f}-{max(changed):.2f}%), so at least that share of operand-steps ran on the format their "
            "own step's data reversed; such operands sit at the threshold, where either format's error is close to "
            "it.", ""]


def mor_section(runs):
    """The report's MoR section: operand shares per configuration and where the fallbacks land."""
    lines = []
    for config, rungs in RUNGS.items():
        seeds = runs.get(config, {})
        records = [r for run in seeds.values() for r in run.get("mor", [])]
        if not records:
            continue
        mean_share = {fmt: [] for fmt in rungs}
        for run in seeds.values():
            rows = [row for it, row in sorted(run["train"].items()) if "mor_fp8_operands" in row]
            for fmt in rungs:
                mean_share[fmt].append(100 * statistics.fmean(operand_shares(row, config)[fmt] for row in rows))
        shares = ", ".join(f"{FORMAT_NAMES[f]} {statistics.fmean(v):.1f}%" + (
            f" ± {statistics.stdev(v):.1f}" if len(v) > 1 else "") for f, v in mean_share.items())
        lines += ["", f"### {TITLES[config]}", "",
                  f"Operands per format over the whole run (mean over the logged steps, then over {len(seeds)} seeds "
                  f"± s.d.): {shares}. The tables count the decisions of every 100th step (steps 1, 101, ...; "
                  f"{len(records)} Linear records over the seeds, each deciding X, W and dY).", ""]
        for run in seeds.values():  # operands per step: three per MoR Linear of a decision's records
            iters = [r["iteration"] for r in run.get("mor", [])]
            run["mor_operands"] = 3 * sum(1 for r in run.get("mor", []) if iters and r["iteration"] == iters[0])
        lines += lag_line(seeds, config, rungs)
        kinds = fallback_counts(records, lambda r, role: f"{r['mor_linear'].split('.', 3)[-1]}: {ROLE_NAMES[role]}")
        lines += fallback_table("Linear: operand", kinds, rungs) + [""]
        layers = fallback_counts(records, lambda r, role: layer_of(r["mor_linear"]))
        lines += fallback_table("layer", layers, rungs) + [""]
        steps = fallback_counts(records, lambda r, role: r["iteration"])
        lines += fallback_table("decision at step", steps, rungs)
    return lines
