"""The Hopper kernels' inner loops in SASS, compiled for sm90a on the CPU (no GPU needed).

Compiles the Gluon forward (``hopper_fwd.compile_for_hopper``) or backward
(``hopper_bwd.compile_bwd_for_hopper``) with Triton's bundled ptxas, disassembles the cubin
with its cuobjdump and lists every loop whose body (a backward branch to its start) holds
``--min``..``--max`` instructions: its address range, instruction count, uniform-datapath
instructions and the counts of the opcodes that mattered in the docs/attention.md
reading (PRMT, BAR, SYNCS, HGMMA, MUFU, spills, ...). The consumers' K/V loops of the forward
hold 500-600 instructions; the session of 2026-11-24 read them this way before each GPU A/B.

    PYTHONPATH=src python3 benchmarks/sass_loops.py fwd --head-dim 64 \\
        --config 3,128,4,1,160,24,0,2,1,1 [--causal] [--sass /tmp/fwd.sass]

Run it in a fresh process (kernels run under the interpreter leave Triton patched).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")

from diyfa._compile import sass  # noqa: E402
from diyfa.attention import hopper_bwd, hopper_fwd  # noqa: E402

OPCODES = ("HGMMA", "MUFU", "F2FP", "PRMT", "SHFL", "BAR", "SYNCS", "IMAD", "R2UR", "STL", "LDL")
_LINE = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*)")


def sass_of(kind: str, head_dim: int, causal: bool, config: tuple | None) -> str:
    """The kernel's SASS (:func:`diyfa._compile.sass`)."""
    if kind == "fwd":
        cfg = hopper_fwd.Config(*config) if config else None
        kernel = hopper_fwd.compile_for_hopper(head_dim, torch.bfloat16, causal, config=cfg)
    else:
        kernel = hopper_bwd.compile_bwd_for_hopper(head_dim, torch.bfloat16, causal, True,
                                                   config=config)  # fmt: skip
    return sass(kernel)


def loops(sass: str, shortest: int, longest: int) -> list[dict]:
    """Every loop (a branch back to an earlier address) of ``shortest``..``longest``
    instructions, in address order, with its opcode counts."""
    ins = []
    for line in sass.splitlines():
        m = _LINE.match(line)
        if m:
            ins.append((int(m.group(1), 16), m.group(3).split(".")[0], m.group(4)))
    found = []
    for addr, op, rest in ins:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target is None or int(target.group(1), 16) >= addr:
            continue
        start = int(target.group(1), 16)
        body = [o for a, o, _ in ins if start <= a <= addr]
        if shortest <= len(body) <= longest:
            counts = collections.Counter(body)
            found.append(dict(start=start, end=addr, n=len(body),
                              uniform=sum(v for k, v in counts.items() if k.startswith("U")),
                              **{o: counts[o] for o in OPCODES}))  # fmt: skip
    return sorted(found, key=lambda r: r["start"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=("fwd", "bwd"))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--config", default="", help="the config tuple, comma-separated")
    ap.add_argument("--min", type=int, default=300, help="shortest loop body listed")
    ap.add_argument("--max", type=int, default=800, help="longest loop body listed")
    ap.add_argument("--sass", default="", help="also write the whole SASS here")
    a = ap.parse_args()
    config = tuple(int(x) for x in a.config.split(",")) if a.config else None
    sass = sass_of(a.kind, a.head_dim, a.causal, config)
    if a.sass:
        with open(a.sass, "w") as f:
            f.write(sass)
    print("loop              instr  uniform  " + "  ".join(OPCODES))
    for r in loops(sass, a.min, a.max):
        print(f"{r['start']:#07x}-{r['end']:#07x} {r['n']:5d} {r['uniform']:8d}  "
              + "  ".join(f"{r[o]:{len(o)}d}" for o in OPCODES))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
