"""A/B of the Hopper backward's configs (``hopper_bwd.BWD_CONFIGS``: BLOCK_M, STAGES, consumer
and loader registers) in one process on an sm90 GPU: the kernel's time per backward
(CUDA-event timing of ``hopper_backward`` after the forward, median of ``--reps``) and
TFLOPS (2.5x the forward's FLOPs, halved when causal), every config's gradients compared
with the first one's first.

    python3 benchmarks/hopper_bwd_ab.py [--shapes 2x16x8192x64,...] [--atomic 1]
        [--configs "64,2,240,24;64,3,240,24"] [--out hopper_bwd_ab.jsonl]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")

import diyfa  # noqa: E402
from diyfa.attention import hopper_bwd  # noqa: E402
from diyfa.attention.checks import check_inputs  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="2x16x8192x64,4x16x4096x64")
    ap.add_argument("--configs", default="64,2,240,24;64,3,240,24;64,4,240,24")
    ap.add_argument("--atomic", type=int, default=1)
    ap.add_argument("--dq-rows", default="", help="e.g. 0,1: each config with the atomic dQ's "
                    "rows permuted (1) or not (0) (hopper_bwd.DQ_ROWS_PERMUTED)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "hopper_bwd_ab.jsonl"))  # fmt: skip
    a = ap.parse_args()
    configs = [tuple(int(x) for x in c.split(",")) for c in a.configs.split(";") if c]
    rows_flags = [bool(int(x)) for x in a.dq_rows.split(",") if x] or [None]
    configs = [(c, f) for c in configs for f in rows_flags]
    rows = []
    with open(a.out, "w") as out:
        for shape_s in a.shapes.split(","):
            b, h, s, d = (int(x) for x in shape_s.split("x"))
            for causal in (False, True):
                q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))  # fmt: skip
                o, lse = diyfa.flash_attention(q, k, v, causal=causal, return_lse=True)
                do = torch.randn_like(o)
                problem = check_inputs(q, k, v, causal=causal, softmax_scale=None,
                                       layout="bhsd", align="bottom_right")
                lse2 = lse / 0.6931471805599453
                flops = 4 * b * h * s * s * d * 2.5 / (2 if causal else 1)
                ref = None
                for cfg, rows_flag in configs:
                    name = "-".join(map(str, cfg))
                    if rows_flag is not None:
                        hopper_bwd.DQ_ROWS_PERMUTED = rows_flag
                        name += f"-rows{int(rows_flag)}"
                    run = functools.partial(hopper_bwd.hopper_backward, do, q, k, v, o, lse2,
                                            problem, config=cfg, atomic_dq=bool(a.atomic))
                    try:
                        grads = run()
                        if ref is None:
                            ref = grads
                        diff = max((g.float() - r.float()).abs().max().item()
                                   for g, r in zip(grads, ref, strict=True))  # fmt: skip
                        times = []
                        for _ in range(3):
                            run()
                        for _ in range(a.reps):
                            e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
                            e0.record()
                            run()
                            e1.record()
                            e1.synchronize()
                            times.append(e0.elapsed_time(e1))
                        ms = sorted(times)[len(times) // 2]
                        rec = dict(shape=shape_s, causal=causal, config=name, ms=ms,
                                   tflops=flops / ms / 1e9, max_diff=diff)  # fmt: skip
                    except Exception as e:  # noqa: BLE001 - a config that fails is a row
                        rec = dict(shape=shape_s, causal=causal, config=name,
                                   error=f"{type(e).__name__}: {str(e)[:200]}")  # fmt: skip
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
                    rows.append(rec)
                    print(rec, flush=True)
    print("\nshape causal | " + " | ".join(
        "-".join(map(str, c)) + ("" if f is None else f"-rows{int(f)}") for c, f in configs))
    for shape_s in a.shapes.split(","):
        for causal in (False, True):
            line = [f"{r['tflops']:.0f}" if "tflops" in r else "err" for r in rows
                    if r["shape"] == shape_s and r["causal"] == causal]  # fmt: skip
            print(f"{shape_s} {causal} | " + " | ".join(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
