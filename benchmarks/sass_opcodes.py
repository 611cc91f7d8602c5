"""Executed SASS instructions by opcode, for two kernels side by side (the ncu comparison in
docs/attention.md).

Reads the CSVs that ``ncu --import REPORT --page source --csv --print-source sass`` writes
for a report with the SourceCounters section (``benchmarks/ncu_compare.py`` has the ncu
lines), sums "Instructions Executed" (warp instructions) and the warp stall samples by
opcode (predicates and modifiers dropped: ``@!P0 HGMMA.64x128x16...`` counts as HGMMA), and
prints millions of instructions for A, B and their difference, the largest first.

    python3 benchmarks/sass_opcodes.py diyfa_sass.csv fa4_sass.csv [--rows 30]
"""

from __future__ import annotations

import argparse
import collections
import csv
import re


def opcode_counts(path: str) -> tuple[collections.Counter, collections.Counter]:
    """(instructions executed, stall samples) per opcode of one SASS CSV."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = next(r for r in rows if "Source" in r and "Instructions Executed" in r)
    src = header.index("Source")
    executed = header.index("Instructions Executed")
    samples = header.index("Warp Stall Sampling (All Samples)")
    counts, stalls = collections.Counter(), collections.Counter()
    for row in rows[rows.index(header) + 1:]:
        if len(row) <= max(executed, samples) or not row[executed].strip().isdigit():
            continue
        words = re.sub(r"^@!?U?P\w+\s+", "", row[src].strip()).split()
        if not words:
            continue
        op = words[0].split(".")[0]
        counts[op] += int(row[executed])
        stalls[op] += int(row[samples] or 0)
    return counts, stalls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--rows", type=int, default=30)
    args = ap.parse_args()
    (ca, sa), (cb, sb) = opcode_counts(args.a), opcode_counts(args.b)
    ops = sorted(set(ca) | set(cb), key=lambda o: -(ca[o] + cb[o]))
    print(f"{'op':12s} {'A M':>8s} {'B M':>8s} {'diff M':>8s} | stall samples A B")
    for o in ops[: args.rows]:
        print(f"{o:12s} {ca[o] / 1e6:8.2f} {cb[o] / 1e6:8.2f} {(ca[o] - cb[o]) / 1e6:8.2f}"
              f" | {sa[o]:7d} {sb[o]:7d}")
    print(f"total        {sum(ca.values()) / 1e6:8.2f} {sum(cb.values()) / 1e6:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
