"""Attention dropout's cost on a CUDA GPU, one process: diyfa with ``dropout_p`` on the
Hopper forward ("auto") and on the portable kernels, diyfa without dropout, and PyTorch's
SDPA with the same rate on its flash and cuDNN backends (where they take it), forward and
forward + backward (``torch.autograd.grad``), timed by do_bench (median), the best of
``--rounds`` interleaved rounds. TFLOPS by the problem's FLOPs (dropout adds none); each
diyfa output is first checked against the float64 reference with diyfa's own mask
(``reference.dropout_mask``), and the kept fraction is reported.

    python3 benchmarks/dropout_ab.py OUT.jsonl [--rounds 2] [--p 0.1]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")

import diyfa  # noqa: E402
from diyfa.flops import attention_flops  # noqa: E402
from diyfa.reference import attention_ref, dropout_mask  # noqa: E402

SHAPES = [  # (batch, heads, seqlen, head dim, causal)
    (2, 16, 4096, 128, False), (2, 16, 4096, 128, True), (1, 16, 8192, 128, True),
    (4, 32, 2048, 64, False), (4, 32, 2048, 64, True), (2, 8, 4096, 256, True),
]


def _seed(s: int) -> int:
    return int(torch.randint(0, 2**62, (), generator=torch.Generator().manual_seed(s)))


def check(b, h, s, d, causal, p) -> dict:
    """The Hopper forward's dropout against float64 with the documented mask, on the first
    (batch, head) pairs of a short version of the shape: largest error, and the kept
    fraction."""
    sq = min(s, 1024)
    q, k, v = (torch.randn(1, 2, sq, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = diyfa.flash_attention(q, k, v, causal=causal, dropout_p=p,
                                generator=torch.Generator().manual_seed(5))  # fmt: skip
    mask = torch.stack([dropout_mask(_seed(5), i, sq, sq, p) for i in range(2)])[None]
    ref = attention_ref(q.double(), k.double(), v.double(), causal=causal, dropout_p=p,
                        dropout_mask=mask.cuda())  # fmt: skip
    return dict(max_err=(out.double() - ref).abs().max().item(),
                kept=mask.float().mean().item())


def run_shape(b, h, s, d, causal, p, rounds) -> dict:
    """Every provider on one shape: the best of ``rounds`` interleaved rounds."""
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))  # fmt: skip
    do = torch.randn_like(q)
    flops = attention_flops(b, h, s, s, d, causal=causal)
    flops_fb = attention_flops(b, h, s, s, d, causal=causal, mode="fwd_bwd")

    def diyfa_call(backend, rate):
        return lambda: diyfa.flash_attention(q, k, v, causal=causal, dropout_p=rate,
                                             backend=backend)  # fmt: skip

    def sdpa_call(backend):
        def f():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=causal, dropout_p=p)
        return f

    providers = {"diyfa": diyfa_call("auto", p),
                 "diyfa-portable": diyfa_call("portable", p),
                 "diyfa-no-dropout": diyfa_call("auto", 0.0),
                 "sdpa-flash": sdpa_call(SDPBackend.FLASH_ATTENTION),
                 "sdpa-cudnn": sdpa_call(SDPBackend.CUDNN_ATTENTION)}
    best: dict = {}
    for _ in range(rounds):
        for name, f in providers.items():
            try:
                with torch.no_grad():
                    fwd = do_bench(f, warmup=25, rep=100)
                bwd = do_bench(lambda f=f: torch.autograd.grad(f(), (q, k, v), do),
                               warmup=25, rep=100)  # fmt: skip
            except Exception as e:  # noqa: BLE001 (a backend that refuses the call)
                best[name] = dict(error=f"{type(e).__name__}: {str(e)[:120]}")
                continue
            old = best.get(name, {})
            best[name] = dict(fwd_ms=min(fwd, old.get("fwd_ms", fwd)),
                              fwd_bwd_ms=min(bwd, old.get("fwd_bwd_ms", bwd)))  # fmt: skip
    for r in best.values():
        if "fwd_ms" in r:
            r["fwd_tflops"] = round(flops / r["fwd_ms"] / 1e9, 1)
            r["fwd_bwd_tflops"] = round(flops_fb / r["fwd_bwd_ms"] / 1e9, 1)
    return dict(shape=f"{b}x{h}x{s} d{d}", causal=causal, p=p,
                check=check(b, h, s, d, causal, p), providers=best)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--p", type=float, default=0.1)
    a = ap.parse_args()
    rows = []
    for b, h, s, d, causal in SHAPES:
        rows.append(run_shape(b, h, s, d, causal, a.p, a.rounds))
        print(json.dumps(rows[-1]), flush=True)
    with open(a.out, "w") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{'shape':22s} {'provider':18s} {'fwd TFLOPS':>10s} {'fwd+bwd':>8s}")
    for r in rows:
        for name, t in r["providers"].items():
            print(f"{r['shape'] + (' causal' if r['causal'] else ''):22s} {name:18s} "
                  f"{t.get('fwd_tflops', 'n/a'):>10} {t.get('fwd_bwd_tflops', 'n/a'):>8}")
        print(f"{'':22s} check: {r['check']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
