"""A/B runs of the split-KV decode kernel's launch parameters (diyfa/attention/decode.py:
BLOCK_N, NUM_WARPS, pipeline stages, PROGRAMS_PER_SM), contiguous and paged caches, in one
process on a CUDA GPU. GB/s = (K and V cache bytes read + q + out) / time, next to the
measured copy bandwidth (a 2 GB ``clone``: bytes read + written / time). Every variant's
output is first compared with the default's (the same math, max |diff| printed).

Usage (device): python3 benchmarks/decode_ab.py [--out decode_ab.jsonl]
  [--variants "default;64,4,3,2;128,8,3,2"]   (BLOCK_N, warps, stages, programs per SM;
                 "default": what decode.launch_config picks)
  [--rounds N]  (the variants measured in turn N times per shape, the best kept)
  [--checked]   (without max_seqlen_k: the lengths read back every call, as before
                 2026-11-24, when that synchronisation hid every launch choice)
  [--tokens N]  (N new query tokens per sequence, causal, as in speculative decoding;
                 with --multi: the b16 32/8 16k shapes, contiguous and pages of 16 / 256)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")

import diyfa  # noqa: E402
from diyfa.attention import decode  # noqa: E402

# (batch, q heads, kv heads, cached tokens, page size or None), d 128, one new token
SHAPES = [(16, 32, 8, 16384, None), (64, 32, 8, 4096, None), (1, 32, 8, 131072, None),
          (128, 32, 8, 512, None), (16, 32, 32, 16384, None),
          (16, 32, 8, 16384, 16), (16, 32, 8, 16384, 256), (64, 32, 8, 4096, 16)]  # fmt: skip
PAGED_SHAPES = [(16, 32, 8, 16384, 16), (16, 32, 8, 16384, 256), (64, 32, 8, 4096, 16),
                (4, 32, 8, 65536, 16), (1, 32, 8, 131072, 256), (16, 32, 32, 16384, 16),
                (128, 32, 8, 512, 16)]  # fmt: skip
MULTI_SHAPES = [(16, 32, 8, 16384, None), (16, 32, 8, 16384, 16), (16, 32, 8, 16384, 256)]
DEFAULT_VARIANTS = "64,4,3,2;64,4,3,4;64,4,3,8;64,4,4,8;128,4,3,4;128,8,3,4;64,8,3,8"


@contextlib.contextmanager
def variant(block_n, warps, stages, per_sm):
    saved = (decode.BLOCK_N, decode.NUM_WARPS, decode.PROGRAMS_PER_SM, decode.split_stages,
             decode.WIDE, decode.PAGED_WAVES)  # fmt: skip
    decode.BLOCK_N, decode.NUM_WARPS, decode.PROGRAMS_PER_SM = block_n, warps, per_sm
    decode.split_stages = lambda *_: stages
    decode.WIDE = decode.PAGED_WAVES = None  # every cache takes the variant
    decode._PREPARED.clear()  # launches kept from another variant's calls would be reused
    try:
        yield
    finally:
        decode._PREPARED.clear()
        (decode.BLOCK_N, decode.NUM_WARPS, decode.PROGRAMS_PER_SM, decode.split_stages,
         decode.WIDE, decode.PAGED_WAVES) = saved  # fmt: skip


def inputs(b, h, hk, n, page, d=128, dtype=torch.bfloat16, tokens=1):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, tokens, h, d, device="cuda", dtype=dtype, generator=g)
    seqlens = torch.full((b,), n, dtype=torch.int32, device="cuda")
    if page is None:
        k = torch.randn(b, n, hk, d, device="cuda", dtype=dtype, generator=g)
        return q, k, torch.randn_like(k), seqlens, None
    per_seq = -(-n // page)
    table = torch.randperm(b * per_seq, device="cuda", generator=g).view(b, per_seq).int()
    k = torch.randn(b * per_seq, page, hk, d, device="cuda", dtype=dtype, generator=g)
    return q, k, torch.randn_like(k), seqlens, table


def decode_bytes(q: torch.Tensor, cached: int, kv_heads: int) -> int:
    """What a decode call moves: its K and V cache rows (``cached`` tokens of ``kv_heads``
    heads per sequence, q's head dim and dtype) plus q and the output."""
    b, _, _, d = q.shape
    return 2 * b * cached * kv_heads * d * q.element_size() + 2 * q.numel() * q.element_size()


def gbps(nbytes: int, ms: float) -> int:
    """GB/s of ``nbytes`` moved in ``ms`` milliseconds, rounded."""
    return round(nbytes / (ms * 1e-3) / 1e9)


def parse_items(text: str) -> list[tuple[int, ...]]:
    """"16,8,16384;4,8,65536" -> [(16, 8, 16384), (4, 8, 65536)] (the scripts' --shapes,
    --variants)."""
    return [tuple(int(x) for x in item.split(",")) for item in text.split(";") if item]


def run_record() -> tuple[dict, float]:
    """The run's environment (GPU, torch, triton) and the measured copy bandwidth (GB/s),
    printed, for the decode scripts' first JSON line."""
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=__import__("triton").__version__)  # fmt: skip
    copy = copy_bandwidth()
    print(f"copy bandwidth: {copy:.0f} GB/s", flush=True)
    return env, copy


def copy_bandwidth() -> float:
    from triton.testing import do_bench

    x = torch.empty(2**30, dtype=torch.int16, device="cuda")
    ms = do_bench(lambda: x.clone(), warmup=25, rep=100, return_mode="median")
    return 2 * x.numel() * 2 / (ms * 1e-3) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="decode_ab.jsonl")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--paged", action="store_true",
                    help="paged caches only, at more shapes (PAGED_SHAPES)")
    ap.add_argument("--tokens", type=int, default=1, help="new query tokens per sequence")
    ap.add_argument("--multi", action="store_true", help="MULTI_SHAPES (b16 32/8 16k)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="the variants measured in turn this many times, the best kept")
    ap.add_argument("--checked", action="store_true",
                    help="read the lengths back (no max_seqlen_k): host-bound, see docs")
    a = ap.parse_args()
    from triton.testing import do_bench

    # ("default": the launch decode.launch_config picks, WIDE / PAGED_WAVES included)
    variants = [v if v == "default" else tuple(int(x) for x in v.split(","))
                for v in a.variants.split(";") if v]  # fmt: skip
    env, copy = run_record()
    table = []
    with open(a.out, "w") as out:
        out.write(json.dumps({"record": "run", **env, "copy_gbps": round(copy)}) + "\n")
        shapes = MULTI_SHAPES if a.multi else PAGED_SHAPES if a.paged else SHAPES
        for b, h, hk, n, page in shapes:
            q, k, v, seqlens, tbl = inputs(b, h, hk, n, page, tokens=a.tokens)
            nbytes = decode_bytes(q, n, hk)
            row = {"b": b, "h": h, "hk": hk, "n": n, "page": page, "tokens": a.tokens}
            ref = None
            for var in [v for _ in range(a.rounds) for v in variants]:
                name = var if var == "default" else "v" + "-".join(map(str, var))
                try:
                    bound = {} if a.checked else {"max_seqlen_k": n}
                    fn = functools.partial(diyfa.flash_attention_with_kvcache, q, k, v,
                                           cache_seqlens=seqlens, block_table=tbl,
                                           **bound)  # fmt: skip
                    with contextlib.nullcontext() if var == "default" else variant(*var):
                        o = fn()
                        ref = o if ref is None else ref
                        diff = (o.float() - ref.float()).abs().max().item()
                        ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                    row[name] = max(gbps(nbytes, ms), row.get(name, 0))  # (the best round)
                    if diff > 0.02:
                        row[name + "_diff"] = diff
                except Exception as e:  # noqa: BLE001 - a variant that fails is a note
                    row[name] = type(e).__name__
            out.write(json.dumps({"record": "measurement", **env, **row}) + "\n")
            out.flush()
            print(row, flush=True)
            table.append(row)
            torch.cuda.empty_cache()
    print(f"\ndecode GB/s (copy {copy:.0f}); variants BLOCK_N-warps-stages-programs/SM")
    for r in table:
        head = f"b{r['b']} h{r['h']}/{r['hk']} n{r['n']} page{r['page']} t{r['tokens']}"
        print(f"{head:38s}", "  ".join(f"{k}={v}" for k, v in r.items()
                                       if k not in ("b", "h", "hk", "n", "page", "tokens")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
