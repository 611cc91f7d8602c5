"""fp8 attention's accuracy, made visible (issue 18): the forward on float8_e4m3fn q, k, v with
descales against float64 attention of the same (dequantised) values, next to bf16 attention
of those values (diyfa's bf16 kernel) and per-tensor vs per-(batch, kv head) descales, on
random normal data and on data with outlier channels (a few head-dim channels of q and k 20x
larger, as LLM activations have).

    python benchmarks/fp8_accuracy.py [--seqlen 256] [--heads 4]

Runs on the GPU, or on the CPU under the Triton interpreter (small shapes; the same
arithmetic as the GPU kernel but for the order of its sums). Prints a table; one JSON line
per row goes to $OUT/fp8_accuracy.jsonl (or ./fp8_accuracy.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import diyfa  # noqa: E402
from diyfa.reference import attention_ref  # noqa: E402

E4M3 = torch.float8_e4m3fn


def quantise(x: torch.Tensor, per_head: bool):
    """(e4m3 values, fp32 descale) of a (batch, heads, s, d) tensor by amax scaling."""
    if per_head:
        sc = (x.abs().amax(dim=(2, 3)) / 448).clamp_min(1e-12)
        return (x / sc[:, :, None, None]).to(E4M3), sc.float().contiguous()
    sc = (x.abs().amax() / 448).clamp_min(1e-12)
    return (x / sc).to(E4M3), sc.reshape(1).float()


def dequant(x8, sc):
    return x8.double() * (sc.double() if sc.numel() == 1 else sc.double()[:, :, None, None])


def run(seqlen: int, heads: int, d: int, data: str, per_head: bool, causal: bool, dev: str):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, seqlen, d, generator=g) for _ in range(3))
    if data == "outliers":
        q[..., : max(1, d // 16)] *= 20
        k[..., : max(1, d // 16)] *= 20
    (q8, qs), (k8, ks), (v8, vs) = (quantise(t, per_head) for t in (q, k, v))
    q8, k8, v8, qs, ks, vs = (t.to(dev) for t in (q8, k8, v8, qs, ks, vs))
    with torch.no_grad():
        out = diyfa.flash_attention(q8, k8, v8, causal=causal, q_descale=qs, k_descale=ks,
                                    v_descale=vs)  # fmt: skip
        qd, kd, vd = dequant(q8, qs), dequant(k8, ks), dequant(v8, vs)
        ref = attention_ref(qd, kd, vd, causal=causal, compute_dtype=torch.float64)
        bf16 = diyfa.flash_attention(qd.bfloat16(), kd.bfloat16(), vd.bfloat16(), causal=causal)
    err = (out.double() - ref).abs()
    err16 = (bf16.double() - ref).abs()
    return dict(seqlen=seqlen, heads=heads, head_dim=d, data=data, causal=causal,
                descale="per (batch, kv head)" if per_head else "per tensor",
                fp8_max=err.max().item(), fp8_mean=err.mean().item(),
                bf16_max=err16.max().item(), bf16_mean=err16.mean().item(),
                ref_rms=ref.pow(2).mean().sqrt().item(), device=dev,
                gpu=torch.cuda.get_device_name() if dev == "cuda" else None,
                torch=torch.__version__)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, default=None)
    ap.add_argument("--heads", type=int, default=4)
    args = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    seqlen = args.seqlen or (4096 if dev == "cuda" else 256)
    rows = [run(seqlen, args.heads, d, data, per_head, causal, dev)
            for d in (64, 128) for data in ("normal", "outliers") for per_head in (False, True)
            for causal in (False, True)]  # fmt: skip
    with open(os.path.join(os.environ.get("OUT", "."), "fp8_accuracy.jsonl"), "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"fp8 (e4m3) vs bf16 attention against float64, seqlen {seqlen}, {args.heads} heads, "
          f"{dev}")  # fmt: skip
    print("| d | data | descale | causal | fp8 max | fp8 mean | bf16 max | bf16 mean | out rms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['head_dim']} | {r['data']} | {r['descale']} | {r['causal']} | "
              f"{r['fp8_max']:.2e} | {r['fp8_mean']:.2e} | {r['bf16_max']:.2e} | "
              f"{r['bf16_mean']:.2e} | {r['ref_rms']:.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
