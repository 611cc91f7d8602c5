"""The backward at head dims above 128 on a CUDA GPU (sm90), one process: the portable
backward against the Gluon one (``hopper_bwd256``: atomic dQ, and deterministic: the portable
dQ kernel, then the Gluon kernel for dK / dV), on FlashAttention's sweep (16k tokens, hidden
2048: 8 heads at d256) causal and not, bf16, bhsd. Backward TFLOPS (``torch.autograd.grad``
timed by do_bench, median; 2.5x the forward's FLOPs, halved when causal), the best of
``--rounds`` interleaved rounds, and each path's largest gradient difference from the
portable one's.

    python3 benchmarks/wide_bwd_ab.py [--dims 256,192] [--rounds 2] OUT.jsonl

``--variants``: instead, 8k tokens causal (1 x 8 heads, the first of --dims) plain, with a
1023-key window, softcap 30, ALiBi and sinks, portable against the Gluon deterministic
path (FLOPs of full causal attention for every row: compare rows within a variant).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")

import diyfa  # noqa: E402
from diyfa._launcher import ReplayCache  # noqa: E402
from diyfa.attention import hopper_bwd  # noqa: E402
from diyfa.bench.suites import alibi_slopes  # noqa: E402

# (the atomic dQ is not backend="hopper"'s default above d128: hopper_bwd.WIDE_DQ_ATOMIC;
# "-do2": with two dO stages, hopper_bwd.BWD_CONFIGS[256]'s fifth field. The atomic dQ by
# register reductions was measured with this script at commit 9f375c4 and dropped.)
PATHS = {"portable": dict(backend="portable"), "hopper-atomic": dict(backend="hopper"),
         "hopper-det": dict(backend="hopper", deterministic=True),
         "hopper-det-do2": dict(backend="hopper", deterministic=True)}
CONFIG = hopper_bwd.BWD_CONFIGS[256]


def setup(name: str) -> None:
    """The module switches a path runs with."""
    hopper_bwd.WIDE_DQ_ATOMIC = name.startswith("hopper-atomic")
    do2 = name.endswith("-do2")
    hopper_bwd._REPLAYS = ReplayCache()  # (its keys do not name these switches)
    hopper_bwd.BWD_CONFIGS[256] = (*CONFIG[:4], 2) if do2 else CONFIG


def time_paths(paths: dict, q, k, v, do, rounds: int, **opts) -> tuple[dict, dict]:
    """Each path's best backward milliseconds over ``rounds`` interleaved rounds
    (``torch.autograd.grad`` after ``flash_attention(q, k, v, **opts, **path options)``,
    do_bench medians) and its last gradients."""
    best, grads = {}, {}
    for _ in range(rounds):
        for name, popts in paths.items():
            setup(name)
            out = diyfa.flash_attention(q, k, v, **opts, **popts)
            fn = functools.partial(torch.autograd.grad, out, (q, k, v), do, retain_graph=True)
            grads[name] = fn()
            ms = do_bench(fn, warmup=10, rep=60, return_mode="median")
            best[name] = min(best.get(name, ms), ms)
    return best, grads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--dims", default="256")
    ap.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", action="store_true")
    a = ap.parse_args()
    if a.variants:
        return variants(a)
    rows = []
    for d in (int(x) for x in a.dims.split(",")):
        for s in (int(x) for x in a.seqlens.split(",")):
            b, h = 16384 // s, 2048 // d
            for causal in (False, True):
                torch.manual_seed(0)
                q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16,
                                       requires_grad=True) for _ in range(3))  # fmt: skip
                do = torch.randn_like(q)
                flops = 4 * b * h * s * s * d * 2.5 / (2 if causal else 1)
                best, grads = time_paths(PATHS, q, k, v, do, a.rounds, causal=causal)
                rec = dict(d=d, b=b, h=h, s=s, causal=causal,
                           tflops={n: round(flops / ms / 1e9, 1) for n, ms in best.items()},
                           max_diff={n: max((x.float() - y.float()).abs().max().item()
                                            for x, y in zip(g, grads["portable"], strict=True))
                                     for n, g in grads.items()})  # fmt: skip
                rows.append(rec)
                print(json.dumps(rec), flush=True)
    with open(a.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print("\nd b h s causal | " + " | ".join(PATHS))
    for r in rows:
        print(f"d{r['d']} {r['b']}x{r['h']}x{r['s']} {r['causal']} | "
              + " | ".join(f"{r['tflops'][n]:.0f}" for n in PATHS))
    return 0


def variants(a) -> int:
    d = int(a.dims.split(",")[0])
    b, h, s = 1, 8, 8192
    flops = 4 * b * h * s * s * d * 2.5 / 2
    slopes = alibi_slopes(h, "cuda")
    cases = {"plain": {}, "window1023": dict(window_size=(1023, 0)),
             "softcap30": dict(softcap=30.0), "alibi": dict(alibi_slopes=slopes),
             "sinks": dict(sinks=torch.zeros(h, device="cuda"))}
    paths = {"portable": dict(backend="portable"), "hopper-det": dict(backend="hopper")}
    rows = []
    for name, opts in cases.items():
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))  # fmt: skip
        do = torch.randn_like(q)
        best, grads = time_paths(paths, q, k, v, do, a.rounds, causal=True, **opts)
        rec = dict(d=d, b=b, h=h, s=s, causal=True, variant=name,
                   tflops={n: round(flops / ms / 1e9, 1) for n, ms in best.items()},
                   max_diff=max((x.float() - y.float()).abs().max().item() for x, y in
                                zip(grads["hopper-det"], grads["portable"], strict=True)))
        rows.append(rec)
        print(json.dumps(rec), flush=True)
    with open(a.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"\nd{d} {b}x{h}x{s} causal variant | " + " | ".join(paths))
    for r in rows:
        print(f"{r['variant']} | " + " | ".join(f"{r['tflops'][n]:.0f}" for n in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
