"""A/B of one module flag of the Hopper forward or backward, in one process on an sm90 GPU.

``--kind fwd`` flips a ``hopper_fwd`` attribute (e.g. ``DEFER_O_STORE``), ``--kind bwd`` a
``hopper_bwd`` one; ``--module checks`` one of ``checks`` (e.g. ``REMEMBER_LENGTHS``). Each
case runs through the public entry points (``diyfa.flash_attention``
/ ``flash_attention_varlen``, ``backend="hopper"``, bf16 (``--dtype float16``); the backward as
``torch.autograd.grad`` of one forward's output, atomic dQ) with the flag at each value in
turn (the kept launches forgotten at every switch, ``_launcher.forget_replays``): the outputs
(the backward: dQ, dK, dV) are compared first (max |diff|), then timed
(``triton.testing.do_bench`` medians, rounds interleaved: TFLOPS of the best round, and the
median of the rounds' medians in ms, which the H200's power-capped clock moves less). TFLOPS:
exact FLOPs for windows (the window's pairs), the published convention otherwise (causal halved;
packed sequences per sequence; the backward 2.5x the forward).

Cases (``--cases``, ``;``-separated): ``BxHxSxD[c]`` (the ``c``: causal), ``BxHxSxDwL`` (causal
with a (L, 0) window), ``BxHxSQ:SKxD[c]`` (seqlen_q SQ, seqlen_k SK), any of them followed by
``sC`` (softcap C), ``a`` (ALiBi, the standard slopes of H heads) or ``k`` (attention sinks,
random logits); ``varlenD`` (the varlen suite's mix, 64k tokens: d128 16 / 4 heads, d64 32 /
32; ``varlenDc`` causal).

A tuple-valued flag (e.g. ``FROZEN_MIN_KEYS``), one that is None, or any ``--values`` with a
``|`` takes Python literals separated by ``|``.

Usage (device): python3 benchmarks/hopper_flag_ab.py --flag DEFER_O_STORE [--values 1,0]
    [--kind bwd] [--cases "1x16x8192x128w1023;varlen64"] [--rounds 3]
    [--set OTHER_FLAG=1] [--out $OUT/hopper_flag_ab.jsonl]
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")

import diyfa  # noqa: E402
from diyfa._launcher import forget_replays  # noqa: E402
from diyfa.attention import checks, hopper_bwd, hopper_fwd  # noqa: E402
from diyfa.bench.results import environment  # noqa: E402
from diyfa.bench.suites import varlen_mix  # noqa: E402
from diyfa.flops import attention_flops  # noqa: E402

CASES = ("1x16x8192x128w1023;1x16x8192x128c;1x16x8192x64w1023;32x16x512x128;32x16x512x128c;"
         "16x16x1024x128;16x16x1024x128c;16x32x1024x64;4x16x4096x128;4x32x4096x64c;"
         "1x16x16384x128;varlen128;varlen128c;varlen64;varlen64c")


def backward(fn, q, k, v):
    """The backward of ``fn``'s output as a function (one forward, its graph kept; of a
    tuple's first tensor, as FlashAttention-4 returns (out, lse))."""
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out = out[0] if isinstance(out, tuple) else out
    grad = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)


def case(spec: str, kind: str = "fwd", dtype: torch.dtype = torch.bfloat16):
    """(label, function, FLOPs) of one case; ``kind`` "bwd": its backward."""
    g = torch.Generator(device="cuda").manual_seed(0)
    if spec.startswith("varlen"):
        causal = spec.endswith("c")
        d = int(spec[6:].rstrip("c"))
        h, hk = (16, 4) if d == 128 else (32, 32)
        lengths, cu, total, longest = varlen_mix()
        q, k, v = (torch.randn(total, n, d, device="cuda", dtype=dtype, generator=g)
                   for n in (h, hk, hk))  # fmt: skip
        flops = sum(attention_flops(1, h, n, n, d, causal=causal, convention="published",
                                    mode=kind) for n in lengths)  # fmt: skip
        fn = functools.partial(diyfa.flash_attention_varlen, cu_seqlens_q=cu, cu_seqlens_k=cu,
                               max_seqlen_q=longest, max_seqlen_k=longest, causal=causal,
                               backend="hopper")  # fmt: skip
        return spec, (backward(fn, q, k, v) if kind == "bwd" else
                      functools.partial(fn, q, k, v)), flops  # fmt: skip
    label, window, extra = spec, None, {}
    suffix = spec[len(spec.rstrip("ak")):]
    alibi, sinks, spec = "a" in suffix, "k" in suffix, spec.rstrip("ak")
    if "s" in spec:
        spec, cap = spec.split("s")
        extra["softcap"] = float(cap)
    causal = spec.endswith("c")
    if "w" in spec:
        spec_shape, left = spec.split("w")
        window, causal = (int(left), 0), True
    else:
        spec_shape = spec.rstrip("c")
    b, h, s, d = spec_shape.split("x")
    b, h, d = int(b), int(h), int(d)
    sq, sk = (int(x) for x in s.split(":")) if ":" in s else (int(s), int(s))
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(b, sk, h, d, device="cuda", dtype=dtype, generator=g)
            for _ in range(2))  # fmt: skip
    flops = attention_flops(b, h, sq, sk, d, causal=causal, window=window, mode=kind,
                            convention="exact" if window else "published")  # fmt: skip
    if window is not None:
        extra["window_size"] = window
    if alibi:  # (ALiBi's slopes for h heads: 2^(-8 i / h), i = 1..h)
        extra["alibi_slopes"] = torch.tensor([2.0 ** (-8.0 * i / h) for i in range(1, h + 1)],
                                             device="cuda")  # fmt: skip
    if sinks:
        extra["sinks"] = torch.randn(h, device="cuda", generator=g)
    fn = functools.partial(diyfa.flash_attention, causal=causal, layout="bshd",
                           backend="hopper", **extra)  # fmt: skip
    return label, (backward(fn, q, k, v) if kind == "bwd" else
                   functools.partial(fn, q, k, v)), flops  # fmt: skip


def _show(value) -> str:
    """A flag value in a column name."""
    return f"{value:g}" if isinstance(value, (int, float)) else str(value).replace(" ", "")


def main() -> int:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("fwd", "bwd"), default="fwd")
    ap.add_argument("--flag", required=True, help="a hopper_fwd (hopper_bwd) module attribute")
    ap.add_argument("--module", choices=("hopper_fwd", "hopper_bwd", "checks"), default=None,
                    help="the flag's module (default: hopper_fwd, or hopper_bwd for --kind bwd)")
    ap.add_argument("--values", default="1,0",
                    help="integers (numbers for a float attribute), the first the reference")
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="another module attribute held at an integer for the whole run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--rep", type=int, default=60)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "hopper_flag_ab.jsonl"))  # fmt: skip
    a = ap.parse_args()
    module = {"hopper_fwd": hopper_fwd, "hopper_bwd": hopper_bwd, "checks": checks}[
        a.module or ("hopper_fwd" if a.kind == "fwd" else "hopper_bwd")]
    held = dict(item.split("=") for item in a.set)
    for name, value in held.items():
        setattr(module, name, type(getattr(module, name))(int(value)))
    before = getattr(module, a.flag)
    kind = type(before)
    if kind is tuple or before is None or "|" in a.values:  # (Python literals)
        values = [ast.literal_eval(x) for x in a.values.split("|")]
    else:
        values = [kind(float(x) if kind is float else int(x)) for x in a.values.split(",")]

    def use(value):
        setattr(module, a.flag, value)
        forget_replays()

    env = environment()
    rows = []
    with open(a.out, "w") as f:
        f.write(json.dumps({"record": "run", **env, "kind": a.kind, "dtype": a.dtype,
                            "flag": a.flag, "held": held}) + "\n")
        for spec in a.cases.split(";"):
            label, fn, flops = case(spec, a.kind, getattr(torch, a.dtype))
            outs = []
            for value in values:
                use(value)
                outs.append(fn())
            diff = max((x.float() - y.float()).abs().max().item() for o in outs
                       for x, y in zip(o if a.kind == "bwd" else [o],
                                       outs[0] if a.kind == "bwd" else [outs[0]],
                                       strict=True))  # fmt: skip
            times = {value: [] for value in values}
            for _ in range(a.rounds):
                for value in values:
                    use(value)
                    times[value].append(do_bench(fn, rep=a.rep, return_mode="median"))
            row = {"record": "measurement", "case": label, "max_diff": diff,
                   **{f"{a.flag}={_show(v)}": round(flops / min(t) / 1e9, 1)
                      for v, t in times.items()},
                   **{f"{a.flag}={_show(v)}_ms_median": round(statistics.median(t), 4)
                      for v, t in times.items()}}  # fmt: skip
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(json.dumps(row), flush=True)
    use(before)
    names = [f"{a.flag}={_show(v)}" for v in values]
    print(f"\n{a.kind} {a.flag} A/B, TFLOPS (best of {a.rounds}; {env['gpu']}, "
          f"triton {env['triton']})")
    print("case | " + " | ".join(names) + " | ratio to the first")
    for r in rows:
        cells = " | ".join(f"{r[n]:.1f}" for n in names)
        ratios = " ".join(f"{r[n] / r[names[0]]:.3f}" for n in names[1:])
        medians = " / ".join(f"{r[n + '_ms_median']:.4g}" for n in names)
        print(f"{r['case']} | {cells} | {ratios}  (median ms {medians}; diff "
              f"{r['max_diff']:.2g})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
