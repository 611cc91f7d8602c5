"""fp8 attention forward's speed (issue 18), side by side in one process on a CUDA GPU:
diyfa on float8_e4m3fn q, k, v with per-tensor descales (bf16 out) through the portable
kernel ("auto") and, on sm90, the Hopper kernel (backend="hopper"), diyfa on bf16 ("auto":
the Hopper kernel on sm90), and cuDNN bf16 through SDPA. TFLOPS by the published convention
(causal halved), ``triton.testing.do_bench`` medians (the best of ``--rounds`` interleaved
rounds). Every fp8 output is first checked against float64 attention of the dequantised
values (its error printed next to bf16's). "diyfa-fp8-hopper-kmv": the Hopper kernel given V
stored with its keys contiguous (``diyfa.key_major_values``, made once before timing, as
where V is quantised once): no V^T copy in the call.

Usage (device): python3 benchmarks/fp8_speed.py [--out fp8_speed.jsonl] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")

from fp8_accuracy import quantise  # noqa: E402 (this folder, on sys.path as the script's)

import diyfa  # noqa: E402
from diyfa.flops import attention_flops  # noqa: E402
from diyfa.reference import attention_ref  # noqa: E402

SHAPES = [(4, 16, 4096, 128), (1, 16, 16384, 128), (4, 32, 4096, 64), (4, 8, 4096, 256),
          (1, 8, 16384, 256)]


def measure(b, h, s, d, causal, warmup, rep, rounds=1) -> dict:
    """One shape: the fp8 check, then TFLOPS of fp8, bf16 and cuDNN bf16."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))  # fmt: skip
    (q8, qs), (k8, ks), (v8, vs) = (quantise(t.float(), per_head=False)
                                    for t in (q, k, v))  # fmt: skip

    def fp8(backend="portable"):
        return diyfa.flash_attention(q8, k8, v8, causal=causal, q_descale=qs,
                                     k_descale=ks, v_descale=vs, backend=backend)  # fmt: skip

    def fp8_hopper():
        return fp8("hopper")

    v8_kmv = diyfa.key_major_values(v8)

    def fp8_hopper_kmv():
        return diyfa.flash_attention(q8, k8, v8_kmv, causal=causal, q_descale=qs,
                                     k_descale=ks, v_descale=vs, backend="hopper")  # fmt: skip

    def bf16():
        return diyfa.flash_attention(q, k, v, causal=causal)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal)  # fmt: skip

    row = {"b": b, "h": h, "s": s, "d": d, "causal": causal}
    hopper = torch.cuda.get_device_capability()[0] == 9
    if s <= 4096 and h * b <= 64:  # the float64 check (a few GB) on the smaller ones
        sl = slice(0, 1)
        qd, kd, vd = (x[sl].double() * sc.double() for x, sc in
                      ((q8, qs), (k8, ks), (v8, vs)))  # fmt: skip
        ref = attention_ref(qd, kd, vd, causal=causal, compute_dtype=torch.float64)
        row["fp8_err"] = (fp8()[sl].double() - ref).abs().max().item()
        if hopper:
            row["fp8_hopper_err"] = (fp8_hopper()[sl].double() - ref).abs().max().item()
        bref = diyfa.flash_attention(*(x.to(torch.bfloat16) for x in (qd, kd, vd)),
                                     causal=causal)  # fmt: skip
        row["bf16_err_same_values"] = (bref.double() - ref).abs().max().item()
        del qd, kd, vd, ref, bref
    fns = [("diyfa-fp8", fp8), ("diyfa-bf16", bf16), ("cudnn-bf16", cudnn)]
    if hopper:
        assert torch.equal(fp8_hopper(), fp8_hopper_kmv())
        fns[1:1] = [("diyfa-fp8-hopper", fp8_hopper), ("diyfa-fp8-hopper-kmv", fp8_hopper_kmv)]
    flops = attention_flops(b, h, s, s, d, causal=causal, convention="published")
    for _ in range(rounds):
        for name, fn in fns:
            ms = do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
            row[name] = max(row.get(name, 0.0), round(flops / (ms * 1e-3) / 1e12, 1))
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fp8_speed.jsonl")
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()

    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=__import__("triton").__version__)  # fmt: skip
    rows = []
    with open(a.out, "w") as out:
        for b, h, s, d in SHAPES:
            for causal in (False, True):
                row = measure(b, h, s, d, causal, a.warmup, a.rep, a.rounds)
                best = max(row["diyfa-fp8"], row.get("diyfa-fp8-hopper", 0.0))
                row["fp8/bf16"] = round(best / row["diyfa-bf16"], 2)
                row["fp8-kmv/bf16"] = round(row.get("diyfa-fp8-hopper-kmv", 0.0)
                                            / row["diyfa-bf16"], 2)  # fmt: skip
                out.write(json.dumps({**env, **row}) + "\n")
                rows.append(row)
                print(row, flush=True)
                torch.cuda.empty_cache()
    print(f"\nfp8 forward, TFLOPS ({env['gpu']}, torch {env['torch']}, triton {env['triton']})")
    for r in rows:
        print(f"b{r['b']} h{r['h']} s{r['s']} d{r['d']}{' causal' if r['causal'] else '':7s} "
              f"fp8 {r['diyfa-fp8']:6.1f}  fp8 hopper {r.get('diyfa-fp8-hopper', 0.0):6.1f}  "
              f"key-major V {r.get('diyfa-fp8-hopper-kmv', 0.0):6.1f}  "
              f"bf16 {r['diyfa-bf16']:6.1f}  "
              f"cuDNN {r['cudnn-bf16']:6.1f}"
              f"  fp8/bf16 {r['fp8/bf16']}  key-major V / bf16 {r['fp8-kmv/bf16']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
