"""A/B runs of the Hopper forward's configs, side by side with cuDNN (and FlashAttention-4 when
importable), in one process on an sm90 GPU.

Each config (``hopper_fwd.HOPPER_CONFIGS``' tuple: consumers, BLOCK_N, stages, programs per
SM, consumer / loader registers, pin, Q buffers, dynamic, pingpong, lazy; the trailing
ones may be left out) first runs an odd shape
(seqlen_q != seqlen_k, causal bottom-right with rows that see no key, GQA) against float64,
by the 2x rule (its error at most twice PyTorch's own in the same dtype); a config that
fails is reported and not timed. Then every shape is timed with
``triton.testing.do_bench`` (median), TFLOPS by the published convention (causal halved).
Rows go to ``--out`` (JSON lines), a table to stdout.

Usage (device): python3 benchmarks/hopper_fwd_ab.py --out $OUT/ab.jsonl
  [--configs "64:2,128,4,1,240,24;64:3,128,4,1,160,24"] [--dims 64,128,256] [--causal 0,1]
  [--seqlens 2048,8192] [--rounds 5] [--softcap 30]

``--softcap``: every call (checks, timings, FlashAttention-4) with that softcap; cuDNN has
none and is left out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")

from diyfa.attention import checks  # noqa: E402
from diyfa.attention import hopper_fwd as hf  # noqa: E402
from diyfa.flops import attention_flops  # noqa: E402
from diyfa.reference import attention_ref  # noqa: E402

# (batch, heads, seqlen) per head dim: FlashAttention's sweep (16k tokens) at 4k and 16k
SHAPES = {
    64: [(4, 32, 4096), (1, 32, 16384), (16, 32, 1024)],
    128: [(4, 16, 4096), (1, 16, 16384), (16, 16, 1024)],
    256: [(4, 8, 4096), (1, 8, 16384)],
}
# the defaults, and each as it was before two Q buffers and the dynamic causal schedule
DEFAULT_CONFIGS = {
    d: list(dict.fromkeys(c for cfg in (hf.HOPPER_CONFIGS[d], hf.HOPPER_CONFIGS_LONG.get(d))
                          if cfg for c in (cfg, cfg._replace(q_bufs=1, dynamic=0))))
    for d in (64, 128, 256)
}


def parse_configs(text: str) -> dict[int, list[tuple]]:
    out: dict[int, list[tuple]] = {}
    for item in filter(None, text.split(";")):
        d, cfg = item.split(":")
        out.setdefault(int(d), []).append(tuple(int(x) for x in cfg.split(",")))
    return out


VARIANTS: dict = {}  # the options every call runs with (--softcap)


def run(q, k, v, causal, config):
    p = checks.check_inputs(q, k, v, causal=causal, softmax_scale=None, layout="bhsd",
                            align="bottom_right", **VARIANTS)  # fmt: skip
    return hf.hopper_forward(q, k, v, p, config)[0]


def check(d: int, dtype, config) -> float:
    """The config's error over PyTorch's (same dtype) against float64, worst of four cases:
    a small odd one, and one with more tiles than the GPU has SMs (persistent programs run
    several tiles: the Q buffers' turns and the causal schedule)."""
    worst = 0.0
    for causal, (b, h, hk, sq, sk) in itertools.product(
            (False, True), ((2, 6, 2, 777, 333), (1, 8, 2, 5000, 4100))):
        g = torch.Generator(device="cuda").manual_seed(d)
        q = torch.randn(b, h, sq, d, device="cuda", generator=g, dtype=dtype)
        k = torch.randn(b, hk, sk, d, device="cuda", generator=g, dtype=dtype)
        v = torch.randn(b, hk, sk, d, device="cuda", generator=g, dtype=dtype)
        ours = run(q, k, v, causal, config).double()
        ref = attention_ref(q.double(), k.double(), v.double(), causal=causal,
                            compute_dtype=torch.float64, **VARIANTS)  # fmt: skip
        pt = attention_ref(q, k, v, causal=causal, compute_dtype=dtype, **VARIANTS).double()
        err, pt_err = (ours - ref).abs().max().item(), (pt - ref).abs().max().item()
        worst = max(worst, err / max(pt_err, 1e-30))
    return worst


def tflops(b, h, s, d, causal, ms, sk=None):
    """By the published convention (causal halved), as ``diyfa bench`` reports."""
    flops = attention_flops(b, h, s, sk or s, d, causal=causal, convention="published")
    return flops / (ms * 1e-3) / 1e12


KEYS = ("d", "b", "h", "s", "sk", "causal")


def time_shape(d, b, h, s, causal, dtype, configs, fa4, warmup, rep, rounds, sk=None) -> dict:
    """TFLOPS of each config, cuDNN and FA4 (if given) on one (b, h, s, d) problem (``sk``
    keys, default s)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    q = torch.randn(b, h, s, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, h, sk or s, d, device="cuda", dtype=dtype) for _ in range(2))
    fns = {f"hopper{list(c)}": (lambda c=c: run(q, k, v, causal, c)) for c in configs}

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    if not VARIANTS:
        fns["cudnn"] = cudnn
    if fa4 is not None:
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        fns["fa4"] = lambda: fa4(qt, kt, vt, causal=causal, **VARIANTS)
    row = {"d": d, "b": b, "h": h, "s": s, "sk": sk or s, "causal": causal}
    # Rounds: every provider once per round, in turn, and the median over the rounds: the
    # GPU's clocks drift with its temperature and power (the same kernel timed 10% apart
    # within one run, 2026-11-24), and a drift then reaches every provider alike.
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if isinstance(row.get(name), str):
                continue  # it failed once: a note, not a time
            try:
                times[name].append(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
            except Exception as e:  # noqa: BLE001 - a provider that fails is a note in its row
                row[name] = type(e).__name__
    for name, ms in times.items():
        if ms and not isinstance(row.get(name), str):
            row[name] = round(tflops(b, h, s, d, causal, statistics.median(ms), sk), 1)
            if len(ms) > 1:  # the rounds' range, slowest to fastest
                row[name + "~"] = [round(tflops(b, h, s, d, causal, x, sk), 1)
                                   for x in (max(ms), min(ms))]  # fmt: skip
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="hopper_fwd_ab.jsonl")
    ap.add_argument("--configs", default="",
                    help='"d:c,n,s,p,cr,lr;..." (default: HOPPER_CONFIGS)')  # fmt: skip
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--seqlens", default="", help="e.g. 2048,8192 (default: SHAPES)")
    ap.add_argument("--shapes", default="",
                    help='"BxHxS[xSK],..." at every head dim (instead of SHAPES / --seqlens)')
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every provider once per round, in turn; report the median")
    ap.add_argument("--softcap", type=float, default=0.0)
    a = ap.parse_args()
    if a.softcap:
        VARIANTS["softcap"] = a.softcap
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    configs = parse_configs(a.configs) if a.configs else DEFAULT_CONFIGS
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except Exception:  # noqa: BLE001 - optional competitor
        fa4 = None
    table, failed = [], []
    out = open(a.out, "w")
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=__import__("triton").__version__)  # fmt: skip
    out.write(json.dumps({"record": "run", **env}) + "\n")
    for d in (int(x) for x in a.dims.split(",")):
        ok = {}
        for cfg in configs.get(d, []):
            try:
                ratio = check(d, dtype, cfg)
                ok[cfg] = ratio <= 2.0
                if not ok[cfg]:
                    failed.append((d, cfg))
                print(f"check d{d} {cfg}: error {ratio:.2f}x PyTorch's "
                      f"{'ok' if ok[cfg] else 'FAILED'}", flush=True)  # fmt: skip
            except Exception as e:  # noqa: BLE001 - report, do not time
                ok[cfg] = False
                failed.append((d, cfg))
                print(f"check d{d} {cfg}: {type(e).__name__}: {e}", flush=True)
        shapes = [(b, h, s, None) for b, h, s in SHAPES[d]]
        if a.seqlens:  # FlashAttention's sweep at these lengths: 16k tokens, 2048 // d heads
            shapes = [(16384 // int(n), 2048 // d, int(n), None) for n in a.seqlens.split(",")]
        if a.shapes:
            shapes = [tuple(int(x) for x in item.split("x")) + (None,) * (4 - item.count("x") - 1)
                      for item in a.shapes.split(",")]  # fmt: skip
        for b, h, s, sk in shapes:
            for causal in (bool(int(c)) for c in a.causal.split(",")):
                good = [c for c in configs.get(d, []) if ok[c]]
                row = time_shape(d, b, h, s, causal, dtype, good, fa4, a.warmup, a.rep, a.rounds,
                                 sk)  # fmt: skip
                out.write(json.dumps({"record": "measurement", **env, **row}) + "\n")
                out.flush()
                table.append(row)
                print(row, flush=True)
                torch.cuda.empty_cache()
    print("\nTFLOPS (bf16)" if dtype == torch.bfloat16 else "\nTFLOPS (fp16)")
    for row in table:
        head = (f"d{row['d']} b{row['b']} h{row['h']} s{row['s']}"
                + (f"x{row['sk']}" if row["sk"] != row["s"] else "") + (" causal" * row["causal"]))
        vals = "  ".join(f"{k}={v}" for k, v in row.items()
                         if k not in KEYS and not k.endswith("~"))  # fmt: skip
        print(f"{head:32s} {vals}")
    return 0 if not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
