"""fp8 KV cache against a bf16 one in decode (issue 18's second target), in one process on a
CUDA GPU: one new bf16 query token per sequence against a cache of e4m3 keys and values with
per-kv-head descales, and against the same cache in bf16; tokens per second (batch / time,
``triton.testing.do_bench`` median, ``max_seqlen_k`` given: no read back) and GB/s of cache
read, with the fp8 output's largest error against float64 attention over the dequantised
cache next to the bf16 output's against the bf16 cache's.

Usage (device): python3 benchmarks/fp8_decode.py [--out fp8_decode.jsonl]
  [--launches "256,8,4/128,4,3;128,8,4/64,4,3"]   (fp8 launches to compare, each
  decode.WIDE_FP8 / decode.PAGED_WAVES_FP8: BLOCK_N, warps, programs per SM, "-" for None:
  the generic launch; the first is the one the table's fp8/bf16 ratio uses)
  [--ab-flag WIDEN_ASM --rounds 3]   (a decode flag's A/B on the fp8 calls; a flag of
  another attention module as module.NAME, e.g. hopper_decode.ENABLED)
  [--configs "64,4,2;128,3,1;m64,4,3"]   (hopper_decode.CONFIG values to time too: keys per
  block, stages, programs per SM of the warpgroup split kernel; "m": hopper_decode.MMA_CONFIG
  values of the mma.sync kernel)
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")

import diyfa  # noqa: E402
from diyfa.attention import decode  # noqa: E402
from diyfa.reference import attention_ref  # noqa: E402

# (batch, q heads, kv heads, cached tokens, page size or None), d 128
SHAPES = [(16, 32, 8, 16384, None), (64, 32, 8, 4096, None), (1, 32, 8, 131072, None),
          (128, 32, 8, 512, None), (16, 32, 32, 16384, None), (16, 32, 8, 16384, 16),
          (16, 32, 8, 16384, 256), (64, 32, 8, 4096, 16), (64, 32, 8, 4096, 256)]  # fmt: skip
E4M3 = torch.float8_e4m3fn


def _flag(name: str):
    """(module, attribute) of an --ab-flag: decode's, or module.NAME of diyfa.attention."""
    import importlib

    if "." in name:
        mod, attr = name.rsplit(".", 1)
        return importlib.import_module(f"diyfa.attention.{mod}"), attr
    return decode, name


def measure(b, h, hk, n, page, rep, launches, d=128, ab_flag=None, rounds=3,
            configs=()) -> dict:
    from triton.testing import do_bench

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, 1, h, d, device="cuda", generator=g).bfloat16()
    seqlens = torch.full((b,), n, dtype=torch.int32, device="cuda")
    table = None
    if page is None:
        shape = (b, n, hk, d)
    else:
        per_seq = -(-n // page)
        table = torch.randperm(b * per_seq, device="cuda", generator=g).view(b, per_seq).int()
        shape = (b * per_seq, page, hk, d)
    k, v = (torch.randn(shape, device="cuda", generator=g) for _ in range(2))
    ks, vs = ((t.abs().amax(dim=(0, 1, 3)) / 448).clamp_min(1e-12) for t in (k, v))  # per head
    k8, v8 = (t / s[None, None, :, None] for t, s in ((k, ks), (v, vs)))
    k8, v8 = k8.to(E4M3), v8.to(E4M3)
    kb, vb = k.bfloat16(), v.bfloat16()
    del k, v

    def fp8():
        return diyfa.flash_attention_with_kvcache(q, k8, v8, cache_seqlens=seqlens,
                                                  block_table=table, k_descale=ks,
                                                  v_descale=vs, max_seqlen_k=n)  # fmt: skip

    def bf16():
        return diyfa.flash_attention_with_kvcache(q, kb, vb, cache_seqlens=seqlens,
                                                  block_table=table, max_seqlen_k=n)  # fmt: skip

    row = dict(b=b, h=h, hk=hk, n=n, page=page)
    with torch.no_grad():
        # errors on the first sequence, against float64 over what each cache holds
        def first(kc, vc, scale=None):
            if table is not None:
                pages = table[0].long()
                kc, vc = kc[pages].flatten(0, 1)[:n], vc[pages].flatten(0, 1)[:n]
            else:
                kc, vc = kc[0], vc[0]
            kc, vc = kc.double(), vc.double()
            if scale is not None:
                kc, vc = kc * scale[0][None, :, None], vc * scale[1][None, :, None]
            return attention_ref(q[:1].double(), kc[None], vc[None], causal=True,
                                 layout="bshd", compute_dtype=torch.float64)  # fmt: skip

        row["fp8_err"] = (fp8()[:1].double() - first(k8, v8, (ks, vs))).abs().max().item()
        row["bf16_err"] = (bf16()[:1].double() - first(kb, vb)).abs().max().item()
        ms = do_bench(bf16, rep=rep, return_mode="median")
        row["bf16_tok_s"] = round(b / (ms * 1e-3))
        row["bf16_gbps"] = round(2 * b * n * hk * d * 2 / (ms * 1e-3) / 1e9)
        saved = decode.WIDE_FP8, decode.PAGED_WAVES_FP8
        for i, (wide, paged) in enumerate(launches):
            decode.WIDE_FP8, decode.PAGED_WAVES_FP8 = wide, paged
            decode._PREPARED.clear()  # launches kept from another setting would be reused
            ms = do_bench(fp8, rep=rep, return_mode="median")
            tag = "" if i == 0 else f"@{wide if page is None else paged}"
            row[f"fp8{tag}_tok_s"] = round(b / (ms * 1e-3))
            row[f"fp8{tag}_gbps"] = round(2 * b * n * hk * d / (ms * 1e-3) / 1e9)
        decode.WIDE_FP8, decode.PAGED_WAVES_FP8 = saved
        decode._PREPARED.clear()
        from diyfa.attention import hopper_decode

        saved = hopper_decode.CONFIG, hopper_decode.MMA_CONFIG, hopper_decode.MMA
        for mma, config in configs:
            hopper_decode.MMA = mma
            if mma:
                hopper_decode.MMA_CONFIG = config
            else:
                hopper_decode.CONFIG = config
            decode._PREPARED.clear()
            ms = do_bench(fp8, rep=rep, return_mode="median")
            tag = "m" * mma + "-".join(map(str, config))
            row[f"fp8@{tag}_tok_s"] = round(b / (ms * 1e-3))
            row[f"fp8@{tag}_gbps"] = round(2 * b * n * hk * d / (ms * 1e-3) / 1e9)
        hopper_decode.CONFIG, hopper_decode.MMA_CONFIG, hopper_decode.MMA = saved
        decode._PREPARED.clear()
        if ab_flag:  # the fp8 call with a flag off and on, rounds interleaved
            module, attr = _flag(ab_flag)
            before = getattr(module, attr)

            def use(value):
                setattr(module, attr, bool(value))
                decode._PREPARED.clear()

            outs, times = {}, {0: [], 1: []}
            for value in (0, 1):
                use(value)
                outs[value] = fp8()
            for _ in range(rounds):
                for value in (0, 1):
                    use(value)
                    times[value].append(do_bench(fp8, rep=rep, return_mode="median"))
            setattr(module, attr, before)
            decode._PREPARED.clear()
            row[f"{ab_flag}_bitwise_equal"] = bool(torch.equal(outs[0], outs[1]))
            for value in (0, 1):
                ms = sorted(times[value])[len(times[value]) // 2]
                row[f"fp8@{ab_flag}={value}_tok_s"] = round(b / (ms * 1e-3))
                row[f"fp8@{ab_flag}={value}_gbps"] = round(2 * b * n * hk * d / (ms * 1e-3) / 1e9)
    row["fp8/bf16"] = round(row["fp8_tok_s"] / row["bf16_tok_s"], 2)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fp8_decode.jsonl")
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--launches", default=None)
    ap.add_argument("--ab-flag", default=None,
                    help="a bool attribute of decode: the fp8 calls timed with it off and on "
                         "(median of --rounds interleaved rounds), outputs compared")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default="")
    a = ap.parse_args()
    configs = [(c.startswith("m"), tuple(int(x) for x in c.removeprefix("m").split(",")))
               for c in a.configs.split(";") if c]  # fmt: skip
    launches = [(decode.WIDE_FP8, decode.PAGED_WAVES_FP8)]
    if a.launches:
        launches = [tuple(None if part == "-" else tuple(int(x) for x in part.split(","))
                          for part in pair.split("/"))
                    for pair in a.launches.split(";")]  # fmt: skip
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=__import__("triton").__version__)  # fmt: skip
    rows = []
    with open(a.out, "w") as f:
        for shape in SHAPES:
            row = measure(*shape, a.rep, launches, ab_flag=a.ab_flag, rounds=a.rounds,
                          configs=configs)  # fmt: skip
            rows.append(row)
            f.write(json.dumps({**env, **row}) + "\n")
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    print(f"\nfp8 against bf16 KV cache, decode, tokens/s and GB/s ({env['gpu']})")
    for r in rows:
        print(f"b{r['b']} h{r['h']}/{r['hk']} cache{r['n']} page{r['page']}: bf16 "
              f"{r['bf16_tok_s']} tok/s {r['bf16_gbps']} GB/s, fp8 {r['fp8_tok_s']} tok/s "
              f"{r['fp8_gbps']} GB/s, fp8/bf16 {r['fp8/bf16']} (err {r['fp8_err']:.1e} / "
              f"{r['bf16_err']:.1e})"
              + "".join(f", {k.removesuffix('_tok_s')} {v / r['bf16_tok_s']:.2f}"
                        for k, v in r.items() if k.startswith("fp8@") and k.endswith("_tok_s")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
