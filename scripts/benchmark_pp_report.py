#!/usr/bin/env python3
"""BENCHMARKS.md's pipeline-parallel section from scripts/benchmark_pp.sh's logs: per configuration the GPUs, step
time, tokens/s/GPU, model TFLOP/s/GPU, MFU, peak memory (rank 0's) and the memory estimate's total, and each
pipeline row's tokens/s/GPU against the Megatron-FSDP row of its recipe.

Usage: benchmark_pp_report.py OUT [--merge-into BENCHMARKS.md]
       benchmark_pp_report.py --overlap OUT... [--merge-into BENCHMARKS.md]   (profiled pairs with and without
       --no-overlap-p2p-communication, from one or more calls' folders)"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_cp_report import read, row  # noqa: E402  (the rows are the context-parallel report's)
from md_sections import write_report  # noqa: E402


def tokens(s):
    try:
        return float(s["tokens/s/GPU"])
    except (KeyError, ValueError):
        return None


def measured_bubble(out, name):
    """A profiled run's bubble: its roofline's phase "pipeline: messages + waits (bubble)" (the first stage's) as a
    share of the step, beside the formula's share from its log; None when the run printed no roofline."""
    log = read(out, f"{name}.log")
    phase = re.search(r"^pipeline: messages \+ waits \(bubble\)\s+([\d.]+)\s+([\d.]+)%", log, re.M)
    step = re.search(r"^step\s+([\d.]+) 100\.0%", log, re.M)
    formula = re.search(r"pipeline bubble by formula .* = ([\d.]+)% of the ideal step", log)
    layers = re.search(r"pipeline parallel: .*; layers: (.*)", log)
    if not phase or not step:
        return None
    where = f" (layers: {layers.group(1)})" if layers and len(layers.group(1)) < 120 else ""  # not V x P ranges
    what = ("waiting for pipeline messages (the measured bubble; the transfers run beside compute)"
            if message_modes(out, [name]) == {"overlapped"}
            else "in pipeline messages and waits (the measured bubble with the transfers)")
    return (f"- {name}{where}: the first stage spends {float(phase.group(1)):.0f} "
            f"ms of its {float(step.group(1)):.0f} ms step ({phase.group(2)}%) {what}; the formula (P - 1) / (V x M) "
            "gives "
            f"{formula.group(1) if formula else '?'}%\n")


def message_modes(out, names):
    """How the runs' messages moved, from their logs' plan lines: {"overlapped"} and/or {"posted"} ("overlapped with
    compute ..." or "posted between passes ..."; builds before the overlap printed "not yet overlapped")."""
    modes = set()
    for name in names:
        m = re.search(r"pipeline bubble by formula .*; messages (overlapped with compute|posted between passes|not yet "
                      r"overlapped)", read(out, f"{name}.log"))
        if m:
            modes.add("overlapped" if m.group(1).startswith("overlapped") else "posted")
    return modes


def messages(out, names):
    """The runs' message mode in words."""
    modes = message_modes(out, names)
    if modes == {"overlapped", "posted"}:
        return "messages overlapped with compute, except in the rows named no-overlap (posted between passes)"
    if modes == {"overlapped"}:
        return "messages overlapped with compute"
    return "messages posted between passes" if modes else "messages as the build posts them"


TABLE = ("| configuration | GPUs | step (s) | tokens/s/GPU | model TFLOP/s/GPU | MFU | peak memory (GiB) | "
         "estimate (GiB) |\n|---|---:|---:|---:|---:|---:|---:|---:|\n")


def lora_sections(out, names, rows, device, commit):
    four = [r for n, r in zip(names, rows) if "-pp4" in n]
    two = [r for n, r in zip(names, rows) if "-pp2" in n]
    quantized = any(n.endswith("-pp4vp20-selective") and "bf16" not in n for n in names)
    how = messages(out, names)
    common = ("LoRA rank 32 on a frozen base of seeded random values of the real shapes, sequence 4096, micro-batch 1, "
              "global batch 32 (32 micro-batches per step); 3 steps, step time the mean after step 1; peak memory is "
              f"rank 0's (the first stage); {how}. A frozen quantized base needs no full "
              "recompute (its Linears keep nothing of a micro-batch for the backward).")
    four_text = (
        "## Pipeline parallelism: NeMo's Llama 3.1 70B LoRA configuration, TP1 PP4 VP20 on four GPUs (same run)\n\n"
        f"`scripts/benchmark_pp_lora.sh` on {device}s (commit {commit}): {common} Bubble 3 / (20 x 32) = 0.5% by "
        "formula, interleaved 1F1B (83 passes in flight on the first stage). Beside: nibble's Megatron-FSDP row, "
        "1,721 tokens/s/GPU on two H200s (selective recompute), and NeMo's 8xB200 row, 3,772 (BF16).\n\n"
        + TABLE + "\n".join(four) + "\n\n"
        + "".join(b for b in (measured_bubble(out, n) for n in names if "-pp4" in n and n.endswith("-profile")) if b))
    two_text = (
        "## Pipeline parallelism: the Llama 3.1 70B LoRA at PP2 on two GPUs, beside Megatron-FSDP's row (same "
        "GPUs)\n\n"
        f"`scripts/benchmark_pp_lora.sh` on {device}s (commit {commit}): {common} 1F1B, bubble 1 / 32 = 3.1% by "
        "formula, 40 layers per stage. Megatron-FSDP's row on two H200s (its section above): 1,721 tokens/s/GPU at "
        "136.4 GiB (BF16 base, selective recompute).\n\n" + TABLE + "\n".join(two) + "\n")
    return [(four_text, bool(four) and not quantized), (two_text, bool(two)), (quantized_section(
        out, names, rows, device, commit), quantized)]


def quantized_section(out, names, rows, device, commit):
    """The 70B LoRA at PP4 VP20 with FP8 and NVFP4 bases beside a profiled BF16 base: selective recompute, which a
    frozen base's Linears allow (they keep nothing of a micro-batch for the backward)."""
    four = [r for n, r in zip(names, rows) if "-pp4" in n]
    profiled = [n for n in names if n.endswith("-profile")]
    return (
        "## Pipeline parallelism: the 70B LoRA at PP4 VP20 with BF16, FP8 and NVFP4 bases on four GPUs (same "
        "machine)\n\n"
        f"`scripts/benchmark_pp_lora.sh` on {device}s (commit {commit}), its selective-recompute rows, one after the "
        "other on one machine: LoRA rank 32 on a frozen base of seeded random values of the real shapes, sequence "
        "4096, micro-batch 1, global batch 32 (32 micro-batches per step), interleaved 1F1B, bubble 3 / (20 x 32) = "
        "0.5% by formula, 83 passes in flight on the first stage; 3 steps, step time the mean after step 1; peak memory "
        f"is rank 0's; {messages(out, names)}. The BF16 row is profiled (`--profile`; its roofline is the first "
        "stage's). FP8 GEMMs run on FP8 tensor cores, so its model TFLOP/s and MFU (against the BF16 peak) pass the "
        "BF16 ceiling; NVFP4 is emulated on Hopper (dequantized to BF16 for each GEMM).\n\n"
        + TABLE + "\n".join(four) + "\n\n" + "".join(b for b in (measured_bubble(out, n) for n in profiled) if b))


def stage_peaks(out, name):
    """"- NAME: peak memory by stage ..." from the run's summary rows "peak memory, stage N (GiB)" ('' if none)."""
    peaks = re.findall(r"^\| peak memory, stage (\d+) \(GiB\)\s*\|\s*([\d.]+)", read(out, f"{name}.log"), re.M)
    if not peaks:
        return ""
    return f"- {name}: peak memory by stage " + ", ".join(f"{p} GiB (stage {r})" for r, p in peaks) + "\n"


def layout_section(out, names, rows, stats, device, commit):
    """The 8B at PP2 VP4 with the even split and with a --pipeline-model-parallel-layout that moves one layer from
    the LM head's stage to the first: the measured bubble of each, every stage's peak memory, the ratio."""
    pair = [n for n in names if "-pp2vp4" in n]
    even = next((n for n in pair if "-layout" not in n), None)
    ratios = [f"- {n}: {stats[n] / stats[even]:.3f}x the even split's tokens/s/GPU\n"
              for n in pair if n != even and even and stats.get(n) and stats.get(even)]
    return (
        "## Pipeline parallelism: a layout against the interleaved schedule's imbalance, the 8B at PP2 VP4 on two "
        "GPUs (same run)\n\n"
        f"`scripts/benchmark_pp.sh` on {device}s (commit {commit}), profiled (`--profile`; the roofline is the first "
        "stage's): sequence 8192, micro-batch 1, global batch 32, selective recompute, interleaved 1F1B with 4 chunks "
        "per rank (bubble 1 / (4 x 32) = 0.8% by formula). The even split leaves the LM head and loss, about two "
        "layers' GEMM work, on the last stage; `--pipeline-model-parallel-layout "
        "Ettttt|tttt|tttt|tttt|tttt|tttt|tttt|tttL` moves one layer from it to the first (rank 0 holds 17 layers, "
        "rank 1 15 and the head). Under interleaving `--decoder-first-pipeline-num-layers` moves layers only in "
        "multiples of V. Each slot of a rank's activations is sized for its largest chunk, so the 5-layer chunk raises "
        "the first stage's memory.\n\n"
        + TABLE + "\n".join(r for n, r in zip(names, rows) if n in pair) + "\n\n"
        + "".join(b for b in (measured_bubble(out, n) for n in pair) if b)
        + "".join(stage_peaks(out, n) for n in pair) + "".join(ratios))


def run_names(out):
    """The configurations in OUT's runs.txt, in order; one run twice into one folder (runs.txt appends) is one row."""
    return list(dict.fromkeys(line.split(":")[0] for line in read(out, "runs.txt").splitlines() if line.strip()))


def overlap_section(outs):
    """The profiled pairs with and without --no-overlap-p2p-communication, from one or more result folders (each
    its own call, so maybe its own machine of the same kind): each row names its commit; each pair's ratio."""
    rows, bubbles, got, device = [], [], {}, "the GPU machine"
    for out in outs:
        commit = read(out, "commit.txt").strip() or "unknown"
        for name in (n for n in run_names(out) if n.endswith("-profile")):
            text, s = row(out, name)
            rows.append(text.replace(f"| {name} |", f"| {name} ({commit}) |", 1))
            bubbles.append(measured_bubble(out, name) or "")
            got[name] = tokens(s)
            device = s.get("device", device)
    ratios = [f"- {name}: {t / got[posted]:.3f}x the tokens/s/GPU of its run with --no-overlap-p2p-communication\n"
              for name, t in got.items()
              if (posted := name.replace("-profile", "-no-overlap-profile")) != name and "-no-overlap" not in name
              and t and got.get(posted)]
    return (
        "## Pipeline parallelism: messages overlapped with compute or posted between passes, on two GPUs\n\n"
        f"`scripts/benchmark_pp.sh` and `scripts/benchmark_pp_lora.sh` on {device}s, their profiled pairs (`--profile`; "
        "the roofline is the first stage's), each row from its own call, so possibly another machine of the same "
        "kind (its commit in brackets: the commits between them change no code these runs use). The default overlaps "
        "a pass's messages with the next pass on a stream of their own, and a pass waits only for its own input; "
        "`--no-overlap-p2p-communication` posts them between passes on the compute stream. The 8B: PP2 1F1B, 17 + 15 "
        "layers, sequence 8192, global batch 32, selective recompute (64 messages a step per rank). The 70B LoRA "
        "(BF16 base, selective recompute, sequence 4096, global batch 32): PP2 VP20 (interleaved, 1,280 two-layer "
        "passes a step per rank, each followed by its messages, as many as PP4 VP20's one-layer passes).\n\n"
        + TABLE + "\n".join(rows) + "\n\n" + "".join(bubbles) + "".join(ratios))


def main():
    if sys.argv[1] == "--overlap":  # --overlap OUT... [--merge-into FILE]: the overlap pairs' section
        args = sys.argv[2:]
        merge = args[args.index("--merge-into") + 1] if "--merge-into" in args else None
        outs = args[:args.index("--merge-into")] if merge else args
        commits = ", ".join(dict.fromkeys(read(o, "commit.txt").strip() for o in outs))
        write_report([(overlap_section(outs), True)], merge, "+".join(os.path.basename(o.rstrip("/")) for o in outs),
                     commits)
        return
    out = sys.argv[1]
    merge = sys.argv[sys.argv.index("--merge-into") + 1] if "--merge-into" in sys.argv else None
    names = run_names(out)
    rows, stats, device = [], {}, "the GPU machine"
    for name in names:
        text, s = row(out, name)
        rows.append(text)
        stats[name] = tokens(s)
        device = s.get("device", device)
    commit = read(out, "commit.txt").strip() or "unknown"
    if any("-pp2vp4" in n for n in names):
        write_report([(layout_section(out, names, rows, stats, device, commit), True)], merge, out, commit)
        return
    if any(n.startswith("70b-lora") for n in names):
        write_report(lora_sections(out, names, rows, device, commit), merge, out, commit)
        return
    lines = []
    for name, got in stats.items():
        recipe = name.split("-")[1]
        base = stats.get(f"8b-{recipe}-fsdp4")
        if "-pp" in name and got and base:
            lines.append(f"- {name}: {got / base:.3f}x the Megatron-FSDP row's tokens/s/GPU")
    four = [r for n, r in zip(names, rows) if not n.endswith("-profile")]
    profiled = [n for n in names if n.endswith("-profile")]
    # A run with NVFP4 stages without full recompute (the Linears' input slots) has a section of its own.
    slots = "8b-nvfp4-pp4-selective" in names
    title = ("NVFP4 stages with and without full recompute, and PP2 x T2, beside Megatron-FSDP on four GPUs (same "
             "machine)" if slots else "the 8B at PP4 and PP2 x D2 beside Megatron-FSDP on four GPUs (same run)")
    four_text = (
        f"## Pipeline parallelism: {title}\n\n"
        f"`scripts/benchmark_pp.sh` on {device}s (commit {commit}): mock data, sequence 8192, micro-batch 1, global "
        "batch 32 (32 micro-batches per step at PP4: bubble 3/32 = 9.4% by formula, 1F1B, "
        f"{messages(out, names)}); BF16 with selective recompute (PP2 x T2 with sequence parallelism), NVFP4 with the recompute its name "
        "gives (full when none: without it, each Linear keeps one quantized input per micro-batch in flight), selective "
        "under FSDP. Step time is "
        "the mean after step 1; peak memory is rank 0's (the first stage); the estimate is the memory estimate's "
        "total for it.\n\n" + TABLE + "\n".join(four) + "\n\n" + "".join(line + "\n" for line in lines))
    bubble_text = (
        "## Pipeline parallelism: the measured bubble against the formula, the 8B at PP2 on two GPUs (same run)\n\n"
        f"`scripts/benchmark_pp.sh` on {device}s (commit {commit}), its profiled rows (`--profile`: CUDA events around "
        "every phase, the messages' NCCL kernels and the waits for them as the phase \"pipeline: messages + waits "
        "(bubble)\"): sequence 8192, micro-batch 1, global batch 32, selective recompute; the roofline is the first "
        "stage's. The even split leaves the LM head's work on the last stage, and the first stage waits for it; "
        "`--decoder-first-pipeline-num-layers 17` gives the first stage one layer more and brings its waits down to "
        "the formula.\n\n" + TABLE + "\n".join(r for n, r in zip(names, rows) if n in profiled) + "\n\n"
        + "".join(b for b in (measured_bubble(out, n) for n in profiled) if b))
    write_report([(four_text, bool(four)), (bubble_text, bool(profiled))], merge, out, commit)


if __name__ == "__main__":
    main()
