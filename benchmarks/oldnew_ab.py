"""A/B of a Hopper kernel module against an older version of itself, in one process (sm90).

For code changes that no config switches: the old ``hopper_fwd.py`` or ``hopper_bwd.py`` is
loaded from a file (``--old``; make it on the CPU machine with ``git show
HEAD:src/diyfa/attention/hopper_bwd.py > scratch/hopper_bwd_old.py`` and carry ``scratch``)
or from git (``--rev``, where the checkout has its history) as a second module, and both run
the same problems: the forward by ``triton.testing.do_bench`` (median), the backward by CUDA
events around ``hopper_backward`` (atomic dQ unless ``--deterministic``, median), each
provider once per round in turn (``--rounds``), TFLOPS by the published convention (causal
halved; backward 2.5x the forward). The outputs (forward: O and the LSE; backward: dQ, dK,
dV) are compared between the two first; the largest difference goes in the row.

    python3 benchmarks/oldnew_ab.py --kind bwd --old scratch/hopper_bwd_old.py \\
        --shapes 1x16x16384x128,4x32x4096x64 [--rounds 3] [--out $OUT/oldnew.jsonl]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")

import diyfa  # noqa: E402
from diyfa.attention import hopper_bwd, hopper_fwd  # noqa: E402
from diyfa.attention.checks import check_inputs  # noqa: E402
from diyfa.bench.results import environment  # noqa: E402
from diyfa.bench.suites import alibi_slopes  # noqa: E402

LN2 = 0.6931471805599453


def load_old(kind: str, path: str | None, rev: str | None):
    """The old module, from a file or from ``git show rev:path``."""
    name = f"hopper_{kind}"
    if path is None:
        src = subprocess.run(["git", "show", f"{rev}:src/diyfa/attention/{name}.py"],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(src)
        path = f.name
    spec = importlib.util.spec_from_file_location(f"diyfa.attention._old_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def event_ms(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("fwd", "bwd"), required=True)
    ap.add_argument("--old", help="the old module's source file")
    ap.add_argument("--softcap", type=float, default=0.0, help="the problems' softcap")
    ap.add_argument("--alibi", action="store_true",
                    help="ALiBi, slopes 2^(-8 (i + 1) / heads) as the variants suite's")
    ap.add_argument("--rev", default="HEAD", help="else: git show REV:src/diyfa/attention/...")
    ap.add_argument("--shapes", default="1x16x16384x128,4x16x4096x128,1x32x16384x64,4x32x4096x64")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--deterministic", action="store_true", help="bwd: the deterministic dQ")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "oldnew_ab.jsonl"))
    a = ap.parse_args()
    old = load_old(a.kind, a.old, a.rev)
    new = hopper_fwd if a.kind == "fwd" else hopper_bwd
    rows = []
    with open(a.out, "w") as out:
        out.write(json.dumps({"record": "run", **environment(), "kind": a.kind,
                              "old": a.old or a.rev}) + "\n")  # fmt: skip
        for shape in a.shapes.split(","):
            b, h, s, d = (int(x) for x in shape.split("x"))
            for causal in (bool(int(c)) for c in a.causal.split(",")):
                q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))  # fmt: skip
                extra = dict(softcap=a.softcap)
                if a.alibi:
                    extra["alibi_slopes"] = alibi_slopes(h, "cuda")
                p = check_inputs(q, k, v, causal=causal, softmax_scale=None, layout="bhsd",
                                 align="bottom_right", **extra)  # fmt: skip
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                mods = (("old", old), ("new", new))
                if a.kind == "fwd":
                    runs = {n: functools.partial(m.hopper_forward, q, k, v, p) for n, m in mods}
                else:
                    flops *= 2.5
                    o, lse = diyfa.flash_attention(q, k, v, causal=causal, return_lse=True,
                                                   layout="bhsd", **extra)  # fmt: skip
                    args = (torch.randn_like(o), q, k, v, o, lse / LN2, p)
                    runs = {n: functools.partial(m.hopper_backward, *args,
                                                 atomic_dq=not a.deterministic)
                            for n, m in mods}  # fmt: skip
                res = {n: f() for n, f in runs.items()}
                diff = max((x.float() - y.float()).abs().max().item()
                           for x, y in zip(res["old"], res["new"], strict=True))  # fmt: skip
                times: dict[str, list[float]] = {n: [] for n in runs}
                for _ in range(a.rounds):
                    for n, f in runs.items():
                        if a.kind == "fwd":
                            from triton.testing import do_bench

                            times[n].append(do_bench(f, warmup=10, rep=60))
                        else:
                            f()
                            times[n].append(statistics.median(event_ms(f, 10)))
                rec = {"record": "measurement", "shape": shape, "causal": causal,
                       "max_diff": diff,
                       **{n: flops / statistics.median(t) / 1e9 for n, t in times.items()}}
                out.write(json.dumps(rec) + "\n")
                out.flush()
                rows.append(rec)
                print(rec, flush=True)
    print(f"\n{a.kind}: shape causal | old | new (TFLOPS) | new / old")
    for r in rows:
        print(f"{r['shape']} {r['causal']} | {r['old']:.0f} | {r['new']:.0f} | "
              f"{r['new'] / r['old']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
