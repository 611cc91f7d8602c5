"""A/B of the host path of calls with attention sinks on a CUDA GPU, in one process: as
before 2026-11-25 (no replayed launches and no remembered checks for calls with sinks, ALiBi
slopes, a window or softcap; the sinks' gradient by six PyTorch ops) against now
(``portable.replay_key`` / ``own_roles``, ``checks.checked_before`` with the variants'
options, ``portable.sink_grad``). Cases: gpt-oss's layers (bf16, bshd, causal, 64 query /
8 kv heads, d64, sinks), the sliding one with a (127, 0) window at 8192 and 1024 tokens and
the full one at 8192. Per case and path: host us per forward and per backward (50 calls
queued without a sync, best of 5), and do_bench medians (ms) of each, best of ``--rounds``
interleaved rounds; the sinks' gradients of the two paths compared.

    python3 benchmarks/sinks_host_ab.py [--rounds 3] [--out $OUT/sinks_host_ab.jsonl]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")

import diyfa  # noqa: E402
import diyfa.attention as attention  # noqa: E402
from diyfa._launcher import forget_replays  # noqa: E402
from diyfa.attention import hopper_fwd, portable  # noqa: E402

REAL = (portable.replay_key, attention.checked_before, portable.sink_grad)
VARIANT_DEFAULTS = ((-1, -1), 0.0, None, None)


def old_replay_key(kind, q, problem, *extra):
    if problem.sinks is not None or problem.alibi_slopes is not None:
        return None
    return REAL[0](kind, q, problem, *extra)


def old_checked_before(q, k, v, causal, scale, layout, det, *variants):
    if tuple(variants) != VARIANT_DEFAULTS[: len(variants)]:
        return None, None
    return REAL[1](q, k, v, causal, scale, layout, det)


def old_sink_grad(lse2, delta, sinks):
    s2 = sinks.float() * 1.4426950408889634
    if lse2.dim() == 2:
        return -(torch.exp2(s2[:, None] - lse2) * delta).sum(1).to(sinks.dtype)
    return -(torch.exp2(s2[None, :, None] - lse2) * delta).sum((0, 2)).to(sinks.dtype)


def set_path(old: bool) -> None:
    portable.replay_key = hopper_fwd.replay_key = old_replay_key if old else REAL[0]
    attention.checked_before = old_checked_before if old else REAL[1]
    portable.sink_grad = old_sink_grad if old else REAL[2]
    forget_replays()


def host_us(fn, calls: int = 50, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "sinks_host_ab.jsonl"))  # fmt: skip
    a = ap.parse_args()
    torch.manual_seed(0)
    hq, hk, d = 64, 8, 64
    cases = []
    for s, window in ((8192, (127, 0)), (1024, (127, 0)), (8192, None)):
        q = torch.randn(1, s, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, s, hk, d, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True) for _ in range(2))  # fmt: skip
        sinks = torch.randn(hq, device="cuda", requires_grad=True)
        do = torch.randn_like(q)
        kw = dict(sinks=sinks) | ({} if window is None else dict(window_size=window))
        fwd = functools.partial(diyfa.flash_attention, q, k, v, causal=True, layout="bshd", **kw)
        name = f"b1 {s} h{hq}/{hk} d{d} causal sinks" + (f" win{window[0]}" if window else "")
        cases.append((name, fwd, (q, k, v, sinks), do))
    best: dict = {}
    grads: dict = {}
    for _ in range(a.rounds):
        for name, fwd, inputs, do in cases:
            for old in (True, False):
                set_path(old)
                out = fwd()
                bwd = functools.partial(torch.autograd.grad, out, inputs, do, retain_graph=True)
                grads.setdefault((name, old), bwd()[3])
                row = dict(host_fwd=host_us(fwd), host_bwd=host_us(bwd),
                           fwd_ms=do_bench(fwd, warmup=10, rep=50, return_mode="median"),
                           bwd_ms=do_bench(bwd, warmup=10, rep=50, return_mode="median"))
                kept = best.setdefault((name, old), row)
                for key, value in row.items():
                    kept[key] = min(kept[key], value)
    set_path(False)
    with open(a.out, "w") as f:
        for name, *_ in cases:
            diff = (grads[name, True] - grads[name, False]).abs().max().item()
            for old in (True, False):
                row = {"case": name, "path": "before" if old else "now",
                       **{k: round(v, 4) for k, v in best[name, old].items()},
                       "dsinks_max_diff": diff}  # fmt: skip
                f.write(json.dumps(row) + "\n")
                print(f"{name:38s} {row['path']:6s} host us fwd {row['host_fwd']:7.1f} "
                      f"bwd {row['host_bwd']:7.1f}  ms fwd {row['fwd_ms']:.4f} "
                      f"bwd {row['bwd_ms']:.4f}  dsinks diff {diff:.1e}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
