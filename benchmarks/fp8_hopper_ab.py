"""A/B of the Hopper fp8 forward's sums (``hopper_fwd.FP8_PROMOTION``): speed and error, in one
process on an sm90 GPU.

Modes: 1 promotes Q K^T's fp8 sums into fp32 every 32 products and P V's once per key block
(the portable kernel's recipe), 2 only P V's, 3 only Q K^T's, 4 neither (the tensor cores'
reduced-precision sums throughout), 5 Q K^T as two halves of the head dim added in fp32;
0 the default (4 at d64, 5 at d128, 3 at d256, each with its config: ``hopper_fwd.fp8_config``).
For each shape: TFLOPS (``triton.testing.do_bench``
median, causal halved) of each mode next to diyfa's bf16 forward, and each mode's largest
output error and LSE error against float64 attention of the dequantised inputs, on random
normal data with outlier channels (q's first d/16 channels x20, as LLM activations have).

``--config D=consumers,block_n,stages[,pin[,q_bufs[,pingpong]]]`` (repeatable) times that
launch config of padded head dim D too, next to the mode's own (``hopper_fwd.fp8_config``),
in every mode: columns "mode@label". ``vt_us`` is the V^T copy alone
(``hopper_fwd.transpose_v``, part of every fp8 call).

Usage (device): python3 benchmarks/fp8_hopper_ab.py [--out fp8_hopper_ab.jsonl]
    [--modes 4,5] [--shapes 4x16x4096x128,...] [--config 128=2,128,3,1 ...]
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
MODES = (0, 1, 2, 3, 4, 5)  # 0: "auto", the default (hopper_fwd.fp8_mode)


def parse_config(text: str) -> tuple[int, str, hopper_fwd.Config]:
    """"128=2,128,3,1,2,1" -> (128, "2x128x3p1q2pp1", the 16-bit config of d128 with
    consumers, block_n, stages, pin, q_bufs, pingpong replaced; unchained, as fp8 runs)."""
    d, fields = text.split("=")
    vals = [int(x) for x in fields.split(",")]
    names = ("consumers", "block_n", "stages", "pin", "q_bufs", "pingpong")
    fields = dict(zip(names[: len(vals)], vals, strict=True))
    cfg = hopper_fwd.HOPPER_CONFIGS[int(d)]._replace(chain=0, **fields)
    if cfg.consumers == 3:
        cfg = cfg._replace(consumer_regs=160)
    label = f"{cfg.consumers}x{cfg.block_n}x{cfg.stages}p{cfg.pin}q{cfg.q_bufs}pp{cfg.pingpong}"
    return int(d), label, cfg


def measure(b, h, s, d, causal, rep, modes=MODES, configs=()) -> dict:
    """One shape: bf16 TFLOPS, then each mode's (and config's) TFLOPS and errors."""
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

    # the V^T copy alone (hopper_fwd._fp8_operands; part of every fp8 call)
    row["vt_us"] = round(do_bench(lambda: hopper_fwd.transpose_v(v8), rep=rep,
                                  return_mode="median") * 1e3, 1)  # fmt: skip
    before = hopper_fwd.FP8_PROMOTION, hopper_fwd.fp8_config
    dpad = hopper_fwd.head_dim_pad(d)
    variants = [("", None)] + [(label, cfg) for cd, label, cfg in configs if cd == dpad]
    for mode in modes:
        hopper_fwd.FP8_PROMOTION = mode
        for label, cfg in variants:
            hopper_fwd.fp8_config = before[1] if cfg is None else (lambda _d, c=cfg: c)
            key = f"{mode}@{label}" if label else str(mode)
            try:
                out, lse = fp8()
                ms = do_bench(fp8, rep=rep, return_mode="median")
            except Exception as e:  # e.g. out of shared memory: recorded, not fatal
                row[f"mode{key}"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
                continue
            finally:
                hopper_fwd.fp8_config = before[1]
            row[f"err{key}"] = (out[sl, :, rows].double() - ref).abs().max().item()
            row[f"lse_err{key}"] = (lse[sl, :, rows].double() - ref_lse).abs().max().item()
            row[f"mode{key}"] = round(flops / (ms * 1e-3) / 1e12, 1)
    hopper_fwd.FP8_PROMOTION = before[0]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fp8_hopper_ab.jsonl")
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--modes", default=",".join(map(str, MODES)))
    ap.add_argument("--shapes", default=",".join("x".join(map(str, t)) for t in SHAPES),
                    help="b x h x s x d, comma-separated")  # fmt: skip
    ap.add_argument("--causal", default="0,1", help="0 and / or 1")
    ap.add_argument("--config", action="append", default=[],
                    help="D=consumers,block_n,stages[,pin[,q_bufs[,pingpong]]], repeatable")
    a = ap.parse_args()
    modes = tuple(int(m) for m in a.modes.split(","))
    shapes = [tuple(int(x) for x in t.split("x")) for t in a.shapes.split(",")]
    configs = [parse_config(c) for c in a.config]
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=__import__("triton").__version__)  # fmt: skip
    rows = []
    with open(a.out, "w") as f:
        for b, h, s, d in shapes:
            for causal in (bool(int(c)) for c in a.causal.split(",")):
                row = measure(b, h, s, d, causal, a.rep, modes, configs)
                rows.append(row)
                f.write(json.dumps({**env, **row}) + "\n")
                print(json.dumps(row), flush=True)
                torch.cuda.empty_cache()
    print(f"\nfp8 Hopper forward by mode, TFLOPS / max output error / max LSE error "
          f"({env['gpu']}, triton {env['triton']})")
    for r in rows:
        cells = []
        for key in (k[4:] for k in r if k.startswith("mode")):
            t = r[f"mode{key}"]
            cells.append(f"{key}: {t}" if isinstance(t, str) else
                         f"{key}: {t:5.1f} {r[f'err{key}']:.1e} {r[f'lse_err{key}']:.1e}")
        print(f"b{r['b']} h{r['h']} s{r['s']} d{r['d']}{' causal' if r['causal'] else '':7s} "
              f"bf16 {r['bf16']:5.1f} vt {r['vt_us']} us  " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
