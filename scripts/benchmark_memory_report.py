#!/usr/bin/env python3
"""BENCHMARKS.md's memory-estimate section from a scripts/benchmark_memory.sh results folder.

Each NAME.log ends with nibble's line "memory check: estimate E GiB (nibble N + libraries L), allocator peak
P GiB, device peak D GiB"; NAME.dry.log is the same configuration's --dry-run, whose table's total must equal
E. The acceptance rule: the estimate of nibble's allocations is within 3% or 1 GiB of the allocator's peak,
and never below it by more than 1 GiB.
Usage: benchmark_memory_report.py OUT [--merge-into BENCHMARKS.md]
Standard library only.
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from md_sections import read_result, write_report  # noqa: E402

CHECK = re.compile(r"memory check: estimate ([\d.]+) GiB \(nibble ([\d.]+) \+ libraries ([\d.]+)\), "
                   r"allocator peak ([\d.]+) GiB, device peak ([\d.]+) GiB")
DRY_TOTAL = re.compile(r"^  total\s+([\d.]+) GiB", re.M)


def verdict(est, peak):
    """'ok' when est is within 3% or 1 GiB of peak and not below it by more than 1 GiB."""
    close = abs(est - peak) <= max(0.03 * peak, 1.0)
    return "ok" if close and est >= peak - 1.0 else "MISSED"


def rows(out):
    names = sorted(f[:-4] for f in os.listdir(out) if f.endswith(".log") and not f.endswith(".dry.log"))
    for name in names:
        log = read_result(out, name + ".log")
        m = CHECK.search(log)
        dry = DRY_TOTAL.search(read_result(out, name + ".dry.log"))
        if not m:
            tail = log.strip().splitlines()[-1] if log.strip() else "no log"
            yield f"| {name} | failed: {tail[:80]} | | | | | | |", False
            continue
        est, nib, lib, peak, dev = (float(x) for x in m.groups())
        same = "yes" if dry and abs(float(dry.group(1)) - est) < 0.0051 else "NO"  # the table prints 2 decimals
        yield (f"| {name} | {nib:.2f} | {peak:.2f} | {100 * (nib - peak) / peak:+.1f}% | {verdict(nib, peak)} | "
               f"{est:.2f} | {dev:.2f} | {same} |"), verdict(nib, peak) == "ok"


def main():
    out = sys.argv[1]
    merge = sys.argv[sys.argv.index("--merge-into") + 1] if "--merge-into" in sys.argv else None
    table = list(rows(out))
    commit = read_result(out, "commit.txt").strip() or "unknown"
    gpu = re.search(r"NVIDIA [^\n,]*", read_result(out, "info.txt"))
    ok = sum(1 for _, good in table if good)
    text = (
        "## Memory estimate vs measured peak\n\n"
        f"`scripts/benchmark_memory.sh` on {gpu.group(0) if gpu else 'the GPU machine'} (commit {commit}): each "
        "configuration trains 3 steps on mock data with an evaluation (and, where marked in the script, a "
        "checkpoint save); nibble's estimate of its own allocations is compared with its allocator's high-water "
        "mark over the whole run (core/memory_ledger.h), and the device estimate (with the CUDA libraries' measured "
        "constant) with the device memory in use at its peak. Rule: within 3% or 1 GiB, never below by more than "
        f"1 GiB. **{ok} of {len(table)} configurations meet it.** `dry run` says whether `--dry-run` printed the same "
        "total for the configuration.\n\n"
        "| configuration | estimate, nibble (GiB) | allocator peak (GiB) | error | rule | estimate with libraries "
        "(GiB) | device peak (GiB) | dry run |\n|---|---|---|---|---|---|---|---|\n"
        + "\n".join(r for r, _ in table) + "\n")
    write_report([(text, bool(table))], merge, out, commit)


if __name__ == "__main__":
    main()
