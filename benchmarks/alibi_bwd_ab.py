"""ALiBi's causal Gluon backward with its bias split on every tile (ALIBI 4) against the
distances (ALIBI 1), in one process (sm90): ``hopper_fwd.ALIBI_CAUSAL_BWD_DIMS`` toggled per
round, both dQ modes, CUDA events around ``hopper_backward`` (medians, as
``benchmarks/oldnew_ab.py``), TFLOPS by the published convention (causal halved, backward 2.5x
the forward); the two builds' largest gradient difference in each row.

    python3 benchmarks/alibi_bwd_ab.py [--shapes 1x32x8192x64,...] [--dims 64] [--out F.jsonl]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from oldnew_ab import LN2, event_ms  # noqa: E402

import diyfa  # noqa: E402
from diyfa.attention import hopper_bwd, hopper_fwd  # noqa: E402
from diyfa.attention.checks import check_inputs  # noqa: E402
from diyfa.bench.suites import alibi_slopes  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x32x8192x64,4x32x4096x64,16x32x1024x64")
    ap.add_argument("--dims", type=int, default=64, help="the padded head dim toggled")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "alibi_bwd_ab.jsonl"))
    a = ap.parse_args()
    keep = hopper_fwd.ALIBI_CAUSAL_BWD_DIMS
    builds = {"split4": tuple(sorted(set(keep) | {a.dims})),
              "dist1": tuple(d for d in keep if d != a.dims)}  # fmt: skip
    rows = []
    with open(a.out, "w") as out:
        for shape in a.shapes.split(","):
            b, h, s, d = (int(x) for x in shape.split("x"))
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))  # fmt: skip
            slopes = alibi_slopes(h, "cuda")
            p = check_inputs(q, k, v, causal=True, softmax_scale=None, layout="bhsd",
                             align="bottom_right", alibi_slopes=slopes)  # fmt: skip
            o, lse = diyfa.flash_attention(q, k, v, causal=True, return_lse=True,
                                           alibi_slopes=slopes)  # fmt: skip
            do = torch.randn_like(o)
            flops = 2.5 * 4 * b * h * s * s * d / 2
            for atomic in (True, False):
                run = functools.partial(hopper_bwd.hopper_backward, do, q, k, v, o, lse / LN2,
                                        p, atomic_dq=atomic)  # fmt: skip

                res, times = {}, {n: [] for n in builds}
                for n, dims in builds.items():
                    hopper_fwd.ALIBI_CAUSAL_BWD_DIMS = dims
                    res[n] = run()
                diff = max((x.float() - y.float()).abs().max().item()
                           for x, y in zip(res["split4"], res["dist1"], strict=True))  # fmt: skip
                for _ in range(a.rounds):
                    for n, dims in builds.items():
                        hopper_fwd.ALIBI_CAUSAL_BWD_DIMS = dims
                        run()
                        times[n].append(statistics.median(event_ms(run, 10)))
                rec = dict(shape=shape, atomic=atomic, max_diff=diff,
                           **{n: flops / statistics.median(t) / 1e9 for n, t in times.items()})
                out.write(json.dumps(rec) + "\n")
                out.flush()
                rows.append(rec)
                print(rec, flush=True)
    hopper_fwd.ALIBI_CAUSAL_BWD_DIMS = keep
    print("\nALiBi causal bwd: shape atomic | distances (1) | split (4) TFLOPS | ratio")
    for r in rows:
        print(f"{r['shape']} {r['atomic']} | {r['dist1']:.0f} | {r['split4']:.0f} | "
              f"{r['split4'] / r['dist1']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
