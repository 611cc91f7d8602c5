"""MLA decode on a CUDA GPU: DeepSeek's decode form through ``flash_attention_with_kvcache``
(q/k head dim 576 = 512 latent + 64 rope columns, values the latent's first 512 columns, one
kv head shared by 16 or 128 query heads), one new token per sequence, bf16.

Providers, in one process, interleaved rounds (median of each round's ``do_bench``, the
best round kept): ``latent`` (one cache, v_cache = k_cache[..., :512]: the split kernel reads
each cache byte once, decode's V_IN_K), ``two-caches`` (a separate 512-wide v cache, read
too), and PyTorch's SDPA on the same cache (q (b, h, 1, 576), k / v (b, 1, n, d) with
``enable_gqa``; whichever backend it picks for these head dims, or the error; 16 heads
only). Launch variants of the split kernel (BLOCK_N, warps, query rows a program, programs
per SM, stages; decode.WIDE_HEAD / WIDE_HEAD_ROWS / split_stages). Every diyfa output is
checked against float64 attention of sequence 0 first (max |diff| printed, failures
marked).

Reported: microseconds, GB/s (cache bytes read + q + out over the time), % of the measured
copy bandwidth, TFLOPS (2 * b * h * n * (576 + 512) per call).

Usage (device): python3 benchmarks/mla_decode.py [--out mla.jsonl] [--rounds 2]
  [--variants "32,4,16,2;reload/32,4,16,2;two/32,8,64,1,2"]
     ([reload/|two/]BLOCK_N,warps,rows,programs per SM[,stages]: every wide-head launch
     set so, at most ``rows`` query rows a program; reload = the latent cache's values loaded
     again through v_cache (decode.LATENT_REUSE off), two = two caches; "latent" and
     "two-caches" are the defaults, 32,8,32,1,3 the launch before 2026-11-25's tuning)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")

from decode_ab import run_record  # noqa: E402  (benchmarks/, this script's folder)

import diyfa  # noqa: E402
from diyfa.attention import decode  # noqa: E402

D, DV = 576, 512
# (batch, q heads, cached tokens, page size or None)
SHAPES = [(64, 16, 4096, None), (128, 16, 8192, None), (16, 16, 32768, None),
          (64, 128, 4096, None), (16, 128, 16384, None), (64, 16, 4096, 64),
          (64, 128, 4096, 64)]  # fmt: skip
DEFAULT_VARIANTS = "32,8,32,1,3;32,4,16,2,3;64,8,64,1,2;two/32,8,64,1,2"


def parse(spec: str):
    """"[reload/|two/]BLOCK_N,warps,rows,programs per SM[,stages]" -> (kind, launch):
    reload: the latent cache with decode.LATENT_REUSE off; two: two caches."""
    kind, _, nums = spec.rpartition("/")
    return kind or "latent", tuple(int(x) for x in nums.split(","))


_KNOBS = ("WIDE_HEAD", "WIDE_HEAD_GROUP", "WIDE_HEAD_GROUP_TWO", "WIDE_HEAD_FP32",
          "WIDE_HEAD_ROWS", "LATENT_REUSE", "split_stages")  # fmt: skip


@contextlib.contextmanager
def variant(kind, launch):
    """Every wide-head launch of decode set to (BLOCK_N, warps, programs per SM), at most
    ``rows`` query rows a program, ``stages`` if given."""
    block_n, warps, rows, per_sm, *stages = launch
    saved = {name: getattr(decode, name) for name in _KNOBS}
    decode.WIDE_HEAD = decode.WIDE_HEAD_GROUP = decode.WIDE_HEAD_GROUP_TWO = (
        block_n, warps, per_sm)
    decode.WIDE_HEAD_ROWS = rows
    decode.LATENT_REUSE = kind != "reload"
    if stages:
        decode.split_stages = lambda *_, **__: stages[0]
    decode._PREPARED.clear()
    try:
        yield
    finally:
        decode._PREPARED.clear()
        for name, value in saved.items():
            setattr(decode, name, value)


def inputs(b, h, n, page):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, 1, h, D, device="cuda", dtype=torch.bfloat16, generator=g)
    seqlens = torch.full((b,), n, dtype=torch.int32, device="cuda")
    if page is None:
        kv = torch.randn(b, n, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
        return q, kv, seqlens, None
    per_seq = -(-n // page)
    table = torch.randperm(b * per_seq, device="cuda", generator=g).view(b, per_seq).int()
    kv = torch.randn(b * per_seq, page, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, kv, seqlens, table


def reference0(q, kv, table, n):
    """float64 attention of sequence 0 (every head)."""
    rows = kv[0, :n, 0] if table is None else kv[table[0].long()].reshape(-1, D)[:n]
    k = rows.double()
    s = q[0, 0].double() @ k.T / D**0.5
    return torch.softmax(s, -1) @ k[:, :DV]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="mla_decode.jsonl")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    a = ap.parse_args()
    from triton.testing import do_bench

    variants = [v for v in a.variants.split(";") if v]
    env, copy = run_record()
    table = []
    with open(a.out, "w") as out:
        out.write(json.dumps({"record": "run", **env, "copy_gbps": round(copy)}) + "\n")
        for b, h, n, page in SHAPES:
            q, kv, seqlens, tbl = inputs(b, h, n, page)
            v_sep = kv[..., :DV].clone()  # a second, separate value cache
            ref = reference0(q, kv, tbl, n)
            flops = 2 * b * h * n * (D + DV)
            io = 2 * (q.numel() + b * h * DV)

            def call(vc, kv=kv, q=q, seqlens=seqlens, tbl=tbl, n=n):
                return diyfa.flash_attention_with_kvcache(q, kv, vc, cache_seqlens=seqlens,
                                                          block_table=tbl, max_seqlen_k=n)

            cases = {"latent": (None, functools.partial(call, kv[..., :DV]), b * n * D * 2),
                     "two-caches": (None, functools.partial(call, v_sep),
                                    b * n * (D + DV) * 2)}  # fmt: skip
            for spec in variants:
                kind, launch = parse(spec)
                v_cache, nbytes = ((v_sep, b * n * (D + DV) * 2) if kind == "two"
                                   else (kv[..., :DV], b * n * D * 2))  # fmt: skip
                cases[spec] = ((kind, launch), functools.partial(call, v_cache), nbytes)
            if page is None and h <= 16:  # (SDPA expands k and v to every head: 72 GB at h128)
                qs = q.transpose(1, 2)
                ks, vs = kv.transpose(1, 2), kv[..., :DV].transpose(1, 2)
                cases["sdpa"] = (None, lambda qs=qs, ks=ks, vs=vs: (
                    torch.nn.functional.scaled_dot_product_attention(
                        qs, ks, vs, enable_gqa=True)), b * n * (D + DV) * 2)
            row = {"b": b, "h": h, "n": n, "page": page}
            best = {}
            for rnd in range(a.rounds):
                for name, (var, fn, _) in cases.items():
                    if isinstance(row.get(name), str):
                        continue  # failed in an earlier round
                    try:
                        with variant(*var) if var else contextlib.nullcontext():
                            with torch.no_grad():
                                o = fn()
                                if rnd == 0 and name != "sdpa":
                                    diff = (o[0, 0].double() - ref).abs().max().item()
                                    row[name + "_err"] = float(f"{diff:.2e}")
                                ms = do_bench(fn, warmup=10, rep=50, return_mode="median")
                        best[name] = min(best.get(name, ms), ms)
                        row[name] = None
                    except Exception as e:  # noqa: BLE001 - a failing provider is a note
                        row[name] = f"{type(e).__name__}: {str(e)[:80]}"
            for name, ms in best.items():
                nbytes = cases[name][2]
                row[name] = dict(us=round(ms * 1e3, 1), gbps=round((nbytes + io) / ms / 1e6),
                                 copy_pct=round(100 * (nbytes + io) / ms / 1e6 / copy, 1),
                                 tflops=round(flops / ms / 1e9, 1))  # fmt: skip
            out.write(json.dumps({"record": "measurement", **env, **row}) + "\n")
            out.flush()
            print(json.dumps(row), flush=True)
            table.append(row)
            del q, kv, v_sep
            torch.cuda.empty_cache()
    print(f"\nMLA decode (576 / 512, one kv head, bf16, 1 new token); copy {copy:.0f} GB/s")
    print("us / GB/s / % copy / TFLOPS; variants [reload/|two/]BLOCK_N,warps,rows,per SM"
          "[,stages]")
    for r in table:
        head = f"b{r['b']} h{r['h']} n{r['n']} page{r['page']}"
        cells = []
        for k, v in r.items():
            if isinstance(v, dict):
                cells.append(f"{k}={v['us']}/{v['gbps']}/{v['copy_pct']}%/{v['tflops']}")
            elif isinstance(v, str):
                cells.append(f"{k}=FAIL")
        print(f"{head:28s}", "  ".join(cells))
        errs = {k: v for k, v in r.items() if k.endswith("_err")}
        if any(v > 0.02 for v in errs.values()):
            print("   ERROR above 0.02:", errs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
