#!/usr/bin/env python3
"""BENCHMARKS.md's context-parallel rows from scripts/benchmark_cp.sh's logs: per configuration the GPUs, the
summary's step time, tokens/s/GPU, model TFLOP/s/GPU, MFU and peak memory, or why it did not run."""
import pathlib
import re
import sys


def summary(log):
    rows = {}
    for line in log.splitlines():
        m = re.match(r"\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def main():
    out = pathlib.Path(sys.argv[1])
    runs = (out / "runs.txt").read_text().splitlines() if (out / "runs.txt").exists() else []
    device = ""
    print("| configuration | GPUs | step (s) | tokens/s/GPU | model TFLOP/s/GPU | MFU | peak memory (GiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for line in runs:
        name = line.split(":")[0]
        log = (out / f"{name}.log").read_text(errors="replace")
        s = summary(log)
        gpus = re.search(r"context parallel: (\d+) ranks per group", log)
        world = re.search(r"data parallel: (\d+) ranks", log)
        n = int(gpus.group(1)) * int(world.group(1)) if gpus and world else "?"
        if "tokens/s/GPU" not in s:
            err = [l for l in log.splitlines() if "error" in l.lower()]
            print(f"| {name} | {n} | did not run: {(err[-1] if err else 'see log')[:120]} | | | | |")
            continue
        device = s.get("device", device)
        step = float(s["step time (ms, mean after step 1)"]) / 1000
        print(f"| {name} | {n} | {step:.2f} | {s['tokens/s/GPU']} | {s['model TFLOP/s/GPU']} | {s.get('MFU', '')} "
              f"| {s['peak memory (GiB)']} |")
    commit = (out / "commit.txt").read_text().strip() if (out / "commit.txt").exists() else "?"
    print(f"\n{device}, commit {commit}.")


if __name__ == "__main__":
    main()
