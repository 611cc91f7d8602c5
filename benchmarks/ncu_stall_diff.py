"""Where two runs of one kernel stall differently: ncu's stall samples per SASS instruction.

Reads the source pages of two Nsight Compute reports of the same kernel build (exported with
``ncu --import R.ncu-rep --page source --csv --print-source sass > R.csv``, gzipped or not),
lines the instructions up by their offset from the kernel's first one (branch targets
rewritten as offsets, so two launches at different addresses compare), and prints each
instruction's share of its run's "Warp Stall Sampling (All Samples)", the largest increases
from B to A, and A's shares by opcode. Used on 2026-11-26 for d128's forward at 2048 against
16384 tokens (benchmarks/results/2026-11-26_h200_ncu-fwd-d128-2k-vs-16k_ca7920f.txt), with
reports taken on the GPU machine as:

    ncu --clock-control none --kernel-name regex:_attn_fwd_hopper --launch-skip 3 \\
        --launch-count 1 --section SpeedOfLight --section WarpStateStats \\
        --section SchedulerStats --section SourceCounters -o A \\
        python3 benchmarks/ncu_compare.py --provider diyfa --batch 8 --seqlen 2048

(DIYFA_FROZEN_MAX=0 there: the frozen max's second launch would be the fourth launch.)

    python3 benchmarks/ncu_stall_diff.py A.csv.gz B.csv.gz [--top 16]
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re

SAMPLES = "Warp Stall Sampling (All Samples)"


def read(path: str) -> list[tuple[int, str, float]]:
    """(offset, instruction, share of the run's samples) per SASS instruction of a source
    page's CSV (the table starts at the row that names the Source and sampling columns)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if "Source" in r and SAMPLES in r)
    head = rows[start]
    at, src, n = head.index("Address"), head.index("Source"), head.index(SAMPLES)
    found = []
    for r in rows[start + 1:]:
        try:
            found.append((int(r[at], 16), r[src].strip(), float(r[n].replace(",", "") or 0)))
        except (ValueError, IndexError):
            continue
    base = found[0][0]
    total = sum(c for _, _, c in found) or 1.0

    def relative(ins: str) -> str:
        return re.sub(r"0x[0-9a-f]{9,}", lambda m: hex(int(m.group(0), 16) - base), ins)

    return [(a - base, relative(ins), c / total) for a, ins, c in found]


def opcode(ins: str) -> str:
    """The opcode of an instruction, without its predicate."""
    words = ins.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else "?"


def compare(a: list, b: list, top: int = 16) -> list[str]:
    """Report lines: A's and B's shares where they differ most (A - B, largest first), then
    A's shares by opcode. The two runs must be of the same build (same instructions)."""
    if [ins for _, ins, _ in a] != [ins for _, ins, _ in b]:
        raise ValueError("the two reports hold different code (not one kernel build)")
    diff = sorted(((x[2] - y[2], x[0], x[1], x[2], y[2]) for x, y in zip(a, b, strict=True)),
                  reverse=True)
    lines = ["share A - B (points) | offset | A % | B % | instruction"]
    lines += [f"{100 * d:+.2f} {off:#07x} {100 * x:.2f} {100 * y:.2f} {ins[:80]}"
              for d, off, ins, x, y in diff[:top]]  # fmt: skip
    ops = collections.Counter()
    for _, ins, share in a:
        ops[opcode(ins)] += share
    lines.append("A by opcode: " + ", ".join(f"{o} {100 * v:.1f}%" for o, v in ops.most_common(12)))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--top", type=int, default=16)
    args = ap.parse_args()
    print("\n".join(compare(read(args.a), read(args.b), args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
