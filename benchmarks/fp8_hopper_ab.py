"""A/B of the Hopper fp8 forward's sums (``hopper_fwd.FP8_PROMOTION``): speed and error, in one
process on an sm90 GPU.

Modes: 1 promotes Q K^T's fp8 sums into fp32 every 32 products and P V's once per key block
(the portable kernel's recipe), 2 only P V's, 3 only Q K^T's, 4 neither (the tensor cores'
reduced-precision sums throughout), 5 Q K^T as two halves of the head dim added in fp32.
For each shape: TFLOPS (``triton.testing.do_bench``
median, causal halved) of each mode next to diyfa's bf16 forward, and each mode's largest
output error and LSE error against float64 attention of the dequantised inputs, on random
normal data with outlier channels (q's first d/16 channels x20, as LLM activations have).

Usage (device): python3 benchmarks/fp8_hopper_ab.py [--out fp8_hopper_ab.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")

from fp8_accuracy import quantise  # noqa: E402 (this folder, on sys.path as the script's)

import diyfa  # noqa: E402
from diyfa.attention import hopper_fwd  # noqa: E402
from diyfa.flops import attention_flops  # noqa: E402
from diyfa.reference import attention_ref  # noqa: E402

SHAPES = [(4, 16, 4096, 128), (1, 16, 16384, 128), (4, 32, 4096, 64), (4, 8, 4096, 256)]
MODES = (1, 2, 3, 4, 5)


def measure(b, h, s, d, causal, rep, modes=MODES) -> dict:
    """One shape: bf16 TFLOPS, then each mode's TFLOPS and errors."""
    from triton.testing import do_bench

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=g) for _ in range(3))
    q[..., : max(1, d // 16)] *= 20
    (q8, qs), (k8, ks), (v8, vs) = (quantise(t, per_head=False) for t in (q, k, v))
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    sl = slice(0, 1)  # the float64 reference on the first batch entry's last 2048 rows
    n = min(s, 2048)
    rows = slice(s - n, s)
    qd, kd, vd = (x[sl].double() * sc.double() for x, sc in ((q8, qs), (k8, ks), (v8, vs)))
    ref, ref_lse = attention_ref(qd, kd, vd, causal=causal, compute_dtype=torch.float64,
                                 return_lse=True)  # fmt: skip
    ref, ref_lse = ref[:, :, rows], ref_lse[:, :, rows]
    flops = attention_flops(b, h, s, s, d, causal=causal, convention="published")
    row = dict(b=b, h=h, s=s, d=d, causal=causal)
    ms = do_bench(lambda: diyfa.flash_attention(qb, kb, vb, causal=causal), rep=rep,
                  return_mode="median")  # fmt: skip
    row["bf16"] = round(flops / (ms * 1e-3) / 1e12, 1)

    def fp8():
        return diyfa.flash_attention(q8, k8, v8, causal=causal, q_descale=qs, k_descale=ks,
                                     v_descale=vs, backend="hopper", return_lse=True)  # fmt: skip

    before = hopper_fwd.FP8_PROMOTION
    for mode in modes:
        hopper_fwd.FP8_PROMOTION = mode
        out, lse = fp8()
        row[f"err{mode}"] = (out[sl, :, rows].double() - ref).abs().max().item()
        row[f"lse_err{mode}"] = (lse[sl, :, rows].double() - ref_lse).abs().max().item()
        ms = do_bench(fp8, rep=rep, return_mode="median")
        row[f"mode{mode}"] = round(flops / (ms * 1e-3) / 1e12, 1)
    hopper_fwd.FP8_PROMOTION = before
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fp8_hopper_ab.jsonl")
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--modes", default=",".join(map(str, MODES)))
    a = ap.parse_args()
    modes = tuple(int(m) for m in a.modes.split(","))
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=__import__("triton").__version__)  # fmt: skip
    rows = []
    with open(a.out, "w") as f:
        for b, h, s, d in SHAPES:
            for causal in (False, True):
                row = measure(b, h, s, d, causal, a.rep, modes)
                rows.append(row)
                f.write(json.dumps({**env, **row}) + "\n")
                print(json.dumps(row), flush=True)
                torch.cuda.empty_cache()
    print(f"\nfp8 Hopper forward by mode, TFLOPS / max output error / max LSE error "
          f"({env['gpu']}, triton {env['triton']})")
    for r in rows:
        cells = "  ".join(f"{m}: {r[f'mode{m}']:5.1f} {r[f'err{m}']:.1e} {r[f'lse_err{m}']:.1e}"
                          for m in modes)  # fmt: skip
        print(f"b{r['b']} h{r['h']} s{r['s']} d{r['d']}{' causal' if r['causal'] else '':7s} "
              f"bf16 {r['bf16']:5.1f}  {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
