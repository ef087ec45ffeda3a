#!/usr/bin/env python3
"""Mixture of Representations in the numerics study (docs/MOR.md): the share of GEMM operands in each format over
training (the training lines' mor_* fields) and where the fallbacks from the top rung land, by Linear, operand,
layer and decision step (the per-Linear `mor_linear` records of every 100th step that scripts/convergence.sh keeps).
A record's format is the one its decision chose for the steps that follow it. The block rule (mor_fp8_block) and the
NVFP4 ladder per block (mor_nvfp4_block) decide each 128x128 block inside its quantization: their records count the
blocks per format, and their sections count blocks.
"""
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


def mean_shares(seeds, formats, names, share_of, key):
    """'NAME x% ± s.d., ...': each format's share over a run's training lines that have `key`, mean over those steps,
    then over the seeds."""
    means = {f: [] for f in formats}
    for run in seeds.values():
        rows = [row for _, row in sorted(run["train"].items()) if key in row]
        for f in formats:
            means[f].append(100 * statistics.fmean(share_of(row)[f] for row in rows))
    return ", ".join(f"{names[f]} {statistics.fmean(v):.1f}%" + (f" ± {statistics.stdev(v):.1f}" if len(v) > 1 else "")
                     for f, v in means.items())


def mor_section(runs):
    """The report's MoR section: operand shares per configuration and where the fallbacks land."""
    lines = []
    for config, rungs in RUNGS.items():
        seeds = runs.get(config, {})
        records = [r for run in seeds.values() for r in run.get("mor", [])]
        if not records:
            continue
        shares = mean_shares(seeds, rungs, FORMAT_NAMES, lambda row: operand_shares(row, config), "mor_fp8_operands")
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


# The block configurations' formats, the top rung first: the E4M3 block rule (E5M2 with --mor-three-way) and the
# NVFP4 ladder per block.
BLOCK_FORMATS = {"mor_fp8_block": ("e4m3", "e5m2", "bf16"), "mor_nvfp4_block": ("nvfp4", "e4m3", "bf16"),
                 "mor_nvfp4_block_rows": ("nvfp4", "e4m3", "bf16")}
BLOCK_NAMES = {"nvfp4": "NVFP4", "e4m3": "E4M3", "e5m2": "E5M2", "bf16": "BF16"}


def block_counts(records, key, formats):
    """{key(record, role): {format: blocks}} over a block configuration's records (each role's blocks per format)."""
    out = {}
    for r in records:
        for role in ROLES:
            if role in r and r[role].get("format") == "blocks":
                c = out.setdefault(key(r, role), dict.fromkeys(formats, 0))
                for f in formats:
                    c[f] += r[role].get(f"{f}_blocks", 0)
    return out


def block_table(title, counts, formats):
    rows = [f"| {title} | blocks | " + " | ".join(BLOCK_NAMES[f] for f in formats) + " |",
            "|---|---:|" + "---:|" * len(formats)]
    for key, c in sorted(counts.items()):
        n = sum(c.values())
        cells = [pct(c[f], n) for f in formats]
        if c[formats[0]] == n:
            cells[0] = f"**{cells[0]}**"
        rows.append(f"| {key} | {n:,} | " + " | ".join(cells) + " |")
    return rows


def block_shares(row, config):
    """{format: share of the step's blocks} from one training line of a block configuration."""
    fp8, e5m2 = row.get("mor_fp8_blocks", 0.0), row.get("mor_e5m2_blocks", 0.0)
    nv = row.get("mor_nvfp4_blocks", 0.0) if config.startswith("mor_nvfp4_block") else 0.0
    return {"nvfp4": nv, "e4m3": fp8 - e5m2, "e5m2": e5m2, "bf16": max(0.0, 1.0 - nv - fp8)}


def block_share_plot(runs, root):
    """Each block configuration's blocks below its top rung, as a share of every operand's blocks over training, mean
    over seeds (the E4M3 rule's E4M3 share is the rest, near 100%, so the fallbacks are what the chart shows)."""
    made = []
    for config, formats in BLOCK_FORMATS.items():
        seeds = runs.get(config, {})
        if not seeds:
            continue
        k = tokens_per_step(next(iter(seeds.values()))) / 1e6
        steps = [it for it in sorted(set.intersection(*(set(r["train"]) for r in seeds.values())))
                 if all("mor_fp8_blocks" in r["train"][it] for r in seeds.values())]
        series = []
        for i, fmt in enumerate(formats[1:]):
            pts = [(it * k, 100 * statistics.fmean(block_shares(r["train"][it], config)[fmt] for r in seeds.values()))
                   for it in steps]
            if fmt == "bf16" or any(v > 0 for _, v in pts):
                series.append((BLOCK_NAMES[fmt], COLOURS[i + 1], pts, False))
        svg = f"{config}_shares.svg"
        top = BLOCK_NAMES[formats[0]]
        if chart(series, f"{config}: blocks not in {top} (mean over {len(seeds)} seeds)", "tokens (millions)",
                 "% of blocks", os.path.join(root, svg)):
            made.append((f"{TITLES[config]}: the blocks that fell back, over training", svg))
    return made


BLOCK_INTROS = {
    "mor_fp8_block": "Unlike the tensor rule, each 128x128 block of every operand is decided inside its own step's "
                     "quantization (no lag); E5M2 is a rung only with `--mor-three-way`.",
    "mor_nvfp4_block": "Each 128x128 block of every operand is decided inside its own step's quantization (no lag): "
                       "NVFP4 (16x16 tiles with the tensor's global scale, SR on gradients, no RHT) while its NVFP4 "
                       "error is below 0.3, else E4M3 while its error is below 4.5%, else BF16.",
    "mor_nvfp4_block_rows": "The ladder per block with the NVFP4 recipe's 1x16 blocks on X and dY: each has a row copy "
                            "(1x16 along K) and a column copy (16x1 down the tokens, the Wgrad operand), each 128x128 "
                            "block decided in each copy, and both copies counted (so X's and dY's blocks count twice); "
                            "the weight keeps its 16x16 tiles.",
}


def block_section(runs):
    """The block configurations' part of the MoR section: their block shares, and where the fallbacks land."""
    lines = []
    for config, formats in BLOCK_FORMATS.items():
        seeds = runs.get(config, {})
        records = [r for run in seeds.values() for r in run.get("mor", [])]
        if not records:
            continue
        shares = mean_shares(seeds, formats, BLOCK_NAMES, lambda row: block_shares(row, config), "mor_fp8_blocks")
        lines += ["", f"### {TITLES[config]}", "",
                  f"{BLOCK_INTROS[config]} Blocks per format over the whole run (every operand's blocks, mean over the "
                  f"steps, then over {len(seeds)} seeds ± s.d.): {shares}. The tables count the blocks of the operands "
                  f"of every 100th step (steps 100, 200, ...: the `mor_linear` records; {len(records)} over the "
                  "seeds).", ""]
        kinds = block_counts(records, lambda r, role: f"{r['mor_linear'].split('.', 3)[-1]}: {ROLE_NAMES[role]}",
                             formats)
        lines += block_table("Linear: operand", kinds, formats) + [""]
        lines += block_table("layer", block_counts(records, lambda r, role: layer_of(r["mor_linear"]), formats),
                             formats) + [""]
        lines += block_table("blocks at step", block_counts(records, lambda r, role: r["iteration"], formats), formats)
    return lines


# MoR's default E4M3 threshold (the study's runs do not change it).
E4M3_THRESHOLD = 0.045


def passes(error, nonfinite):
    return error is not None and not nonfinite and error < E4M3_THRESHOLD


def channel_section(runs):
    """The paper's per-channel figure at this scale (mor_fp8_channel: the tensor rule with --mor-channel-statistic):
    every decision's per-tensor E4M3 error beside the error per-row (per-channel) scaling would give the same operand,
    and the share of operands each would keep in E4M3 at the threshold. Training follows the per-tensor decisions."""
    seeds = runs.get("mor_fp8_channel", {})
    records = [r for run in seeds.values() for r in run.get("mor", [])]
    by_kind = {}  # Linear: operand -> [(per-tensor passes, per-channel passes, per-tensor error, per-channel error)]
    for r in records:
        for role in ROLES:
            d = r.get(role, {})
            if "channel_error" not in d:
                continue
            key = f"{r['mor_linear'].split('.', 3)[-1]}: {ROLE_NAMES[role]}"
            by_kind.setdefault(key, []).append((passes(d["error"], d["nonfinite"]),
                                                passes(d["channel_error"], d.get("channel_nonfinite", False)),
                                                d["error"], d["channel_error"]))
    if not by_kind:
        return []
    allp = [p[:2] for v in by_kind.values() for p in v]
    lines = ["", f"### {TITLES['mor_fp8_channel']}", "",
             "The paper reports 98.38% of tensors in E4M3 with per-channel scaling at its 4.5% threshold, about 95% with "
             "per-tensor scaling. These runs train as `mor_fp8` (per-tensor decisions) and also measure, on every "
             "quantization, the error of the same operand scaled per row of its row-wise copy (per token for X and dY, "
             "per output channel for W). Over the decisions of every 100th step "
             f"({len(records)} Linear records over {len(seeds)} seed(s)): E4M3 at 4.5% per tensor "
             f"{pct(sum(a for a, _ in allp), len(allp))} of the operands, per channel "
             f"{pct(sum(b for _, b in allp), len(allp))}.", "",
             "| Linear: operand | decisions | E4M3 per tensor | E4M3 per channel | mean error per tensor | "
             "mean error per channel |", "|---|---:|---:|---:|---:|---:|"]
    for key, v in sorted(by_kind.items()):
        mean = [statistics.fmean(e) if (e := [p[i] for p in v if p[i] is not None]) else float("nan") for i in (2, 3)]
        lines.append(f"| {key} | {len(v)} | {pct(sum(p[0] for p in v), len(v))} | {pct(sum(p[1] for p in v), len(v))}"
                     f" | {100 * mean[0]:.2f}% | {100 * mean[1]:.2f}% |")
    return lines

