#!/usr/bin/env python3
"""Report of scripts/benchmark_generate.sh: nibble generate's prefill and decode tokens/s for llama3.2-1b at
batch 1 and 32 beside transformers' generate (dynamic and static cache), against the HBM bandwidth bound,
and prefill beside the training forward.

    python3 scripts/benchmark_generate_report.py OUT [--merge-into BENCHMARKS.md]

Bandwidth bound of a decode step at batch B: every weight is read once (BF16: 2 bytes x 1.236e9 parameters
the step reads, the tied embedding counted once as the LM head) and each sequence's cache once (K and V, 16
layers x 512 x 2 bytes per position, at the mean context prompt + new/2), so tokens/s <= B x HBM bandwidth /
(weight bytes + B x cache bytes). Bandwidth: the datasheet figure of the GPU named in OUT/gpu.txt. The training
forward's tokens/s is 3x the training step's (a step is one forward and a backward of twice its FLOPs), at the
same tokens per micro-batch as the batch-32 prefill.
"""
import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from md_sections import read_result as read, write_report  # noqa: E402

HBM = [("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12)]  # datasheet bytes/s
HIDDEN, FFN, LAYERS, QD, KVD, VOCAB = 2048, 8192, 16, 2048, 512, 128256
WEIGHT_BYTES = 2 * (LAYERS * (HIDDEN * (QD + 2 * KVD) + QD * HIDDEN + 3 * HIDDEN * FFN) + VOCAB * HIDDEN)




def nibble_figures(text):
    m = re.search(r"prefill: \d+ tokens in [\d.]+ ms \((\d+) tokens/s\); decode: \d+ tokens in [\d.]+ ms "
                  r"\(([\d.]+) tokens/s\)", text)
    return (float(m.group(1)), float(m.group(2))) if m else None


def hf_figures(text):
    res = {}
    for m in re.finditer(r"result cache=(\w+) batch=\d+ prompt=(\d+) new=(\d+) prefill_tok_s=([\d.]+) "
                         r"decode_tok_s=([\d.]+)", text):
        res[m.group(1)] = (float(m.group(4)), float(m.group(5)), int(m.group(2)), int(m.group(3)))
    return res


def train_tokens_per_s(out):
    rows = [json.loads(line) for line in read(out, "train-1b/metrics.jsonl").splitlines() if '"lm_loss"' in line]
    vals = [r["tokens_per_s_per_gpu"] for r in rows[1:]]  # the first step warms up
    return sum(vals) / len(vals) if vals else None


def bandwidth(gpu):
    return next((bw, name) for name, bw in HBM + [(gpu or "unknown", 0)] if name in (gpu or "unknown"))


def section(out, commit):
    gpu = read(out, "gpu.txt").split(",")[0].strip()
    bw, bw_name = bandwidth(gpu)
    lines = [f"## Generation: llama3.2-1b on one GPU ({gpu or 'unknown GPU'})", "",
             f"`bash scripts/benchmark_generate.sh` (commit {commit}): a random llama3.2-1b in BF16, greedy, end tokens "
             "ignored; nibble generate (BF16 weights and KV cache; decode steps replayed as CUDA graphs, matrix-vector "
             "kernels for the linears at batch <= 8, cuBLASLt above; timed after one warm-up run) beside transformers' generate (BF16, sdpa, dynamic and static cache, no torch.compile). Bound: "
             f"HBM {bw / 1e12:.2f} TB/s ({bw_name} datasheet) over the bytes a step reads (weights "
             f"{WEIGHT_BYTES / 1e9:.2f} GB plus each sequence's cache).", "",
             "| batch | nibble prefill tok/s | nibble decode tok/s | transformers decode tok/s (dynamic / static) "
             "| nibble / best | bandwidth bound tok/s | nibble / bound |", "|---|---|---|---|---|---|---|"]
    ran = False
    prefill32 = None
    for b in (1, 32):
        nib, hf = nibble_figures(read(out, f"nibble_b{b}.log")), hf_figures(read(out, f"hf_b{b}.log"))
        if not nib:
            lines.append(f"| {b} | (no run) | | | | | |")
            continue
        ran = True
        prompt, new = next(iter(hf.values()))[2:] if hf else (128, 256)
        cache = 2 * LAYERS * KVD * 2 * (prompt + new / 2)
        bound = b * bw / (WEIGHT_BYTES + b * cache) if bw else 0
        best = max((v[1] for v in hf.values()), default=0)
        hf_text = " / ".join(f"{hf[c][1]:.1f}" if c in hf else "-" for c in ("dynamic", "static"))
        lines.append(f"| {b} | {nib[0]:.0f} | {nib[1]:.1f} | {hf_text} | "
                     f"{nib[1] / best:.2f}x | {bound:.0f} | {nib[1] / bound:.0%} |" if best and bound else
                     f"| {b} | {nib[0]:.0f} | {nib[1]:.1f} | {hf_text} | - | - | - |")
        if b == 32:
            prefill32 = nib[0]
    train = train_tokens_per_s(out)
    if prefill32 and train:
        lines += ["", f"Prefill at batch 32: {prefill32:.0f} tokens/s; the training forward at the same shape: "
                      f"{3 * train:.0f} tokens/s (3x the training step's {train:.0f}): prefill at "
                      f"{prefill32 / (3 * train):.0%} of it."]
    return "\n".join(lines) + "\n", ran


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--merge-into")
    a = ap.parse_args()
    commit = read(a.out, "commit.txt").strip() or "unknown"
    write_report([section(a.out, commit)], a.merge_into, a.out, commit)


if __name__ == "__main__":
    main()
