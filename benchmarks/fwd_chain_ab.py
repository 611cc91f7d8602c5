"""A/B of the Hopper forward's chained tiles (``Config.chain``: a tile's first block run
with the program's tile before's last P V) in one process on an sm90 GPU: every d64 / d128
config with chain 0 and 1 on FlashAttention's sweep shapes (16k tokens, 1024..16384 keys,
causal or not), the seed table (fp16 b4 h8 d64), a cross shape, the variants suite (8k d128
causal: plain, window 1023, softcap 30, ALiBi, sinks) and the varlen suite;
``triton.testing.do_bench`` medians over interleaved rounds, TFLOPS by ``diyfa.flops``; the
outputs of the two compared (largest difference; 0 expected). ``hopper_args`` chains only
the static round robin, so the rows with the causal band or packed sequences run the same
kernel twice (their A/B, with chaining forced there, is in docs/attention.md).

    python3 benchmarks/fwd_chain_ab.py --out $OUT/chain_ab.jsonl [--rounds 3] [--only d128]
"""

import argparse
import json
import statistics
import sys

import torch
import triton

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")

import diyfa  # noqa: E402
from diyfa.attention import hopper_fwd as hf  # noqa: E402
from diyfa.bench.suites import alibi_slopes, varlen_mix  # noqa: E402
from diyfa.flops import attention_flops  # noqa: E402


def set_chain(chain: int) -> None:
    """Every d64 / d128 config with ``chain``; launches kept from the other setting dropped."""
    for d in (64, 128):
        hf.HOPPER_CONFIGS[d] = hf.HOPPER_CONFIGS[d]._replace(chain=chain)
    hf.HOPPER_CONFIGS_LONG[64] = hf.HOPPER_CONFIGS_LONG[64]._replace(chain=chain)
    hf._REPLAYS.clear()
    hf._PACKED_REPLAYS.clear()


def build_cases(dev: str = "cuda") -> list[tuple]:
    """(name, call, FLOPs) of every case."""

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=dev, dtype=dtype)

    def call(q, k, v, **kw):
        return lambda: diyfa.flash_attention(q, k, v, backend="hopper", **kw)

    cases = []
    for d in (64, 128):
        h = 2048 // d
        for s in (1024, 2048, 4096, 16384):
            b = 16384 // s
            q, k, v = rnd(b, h, s, d), rnd(b, h, s, d), rnd(b, h, s, d)
            for causal in (False, True):
                cases.append((f"sweep d{d} s{s} c{int(causal)}", call(q, k, v, causal=causal),
                              attention_flops(b, h, s, s, d, causal=causal)))  # fmt: skip
    for s in (1024, 2048, 4096):
        q, k, v = (rnd(4, 8, s, 64, dtype=torch.float16) for _ in range(3))
        cases.append((f"seed fp16 b4h8 s{s}", call(q, k, v), attention_flops(4, 8, s, s, 64)))
    q, k, v = rnd(1, 16, 4096, 64), rnd(1, 16, 15360, 64), rnd(1, 16, 15360, 64)
    cases.append(("cross d64 q4096 k15360", call(q, k, v),
                  attention_flops(1, 16, 4096, 15360, 64)))  # fmt: skip
    q, k, v = rnd(1, 16, 8192, 128), rnd(1, 16, 8192, 128), rnd(1, 16, 8192, 128)
    base = attention_flops(1, 16, 8192, 8192, 128, causal=True)
    window = attention_flops(1, 16, 8192, 8192, 128, causal=True, window=(1023, 0))
    for name, kw, flops in [("plain", {}, base),
                            ("window1023", dict(window_size=(1023, 0)), window),
                            ("softcap30", dict(softcap=30.0), base),
                            ("alibi", dict(alibi_slopes=alibi_slopes(16, dev)), base),
                            ("sinks", dict(sinks=torch.randn(16, device=dev)), base)]:
        cases.append((f"variants {name}", call(q, k, v, causal=True, **kw), flops))
    lengths, cu, total, longest = varlen_mix(dev)
    for d, h, hk in ((128, 16, 4), (64, 32, 32)):
        q, k, v = rnd(total, h, d), rnd(total, hk, d), rnd(total, hk, d)
        for causal in (False, True):
            flops = sum(attention_flops(1, h, n, n, d, causal=causal) for n in lengths)
            cases.append((f"varlen d{d} c{int(causal)}", (
                lambda q=q, k=k, v=v, c=causal: diyfa.flash_attention_varlen(
                    q, k, v, cu, cu, longest, longest, causal=c)), flops))  # fmt: skip
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="chain_ab.jsonl")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="", help="cases whose name contains this")
    a = ap.parse_args()
    cases = [c for c in build_cases() if a.only in c[0]]
    times = {(name, c): [] for name, _, _ in cases for c in (0, 1)}
    first, diffs = {}, {}
    for r in range(a.rounds):
        for chain in ((0, 1) if r % 2 == 0 else (1, 0)):
            set_chain(chain)
            for name, fn, _ in cases:
                out = fn()
                if r == 0:  # the two settings' outputs, compared below
                    if name in first:
                        diffs[name] = (out.float() - first[name]).abs().max().item()
                    else:
                        first[name] = out.float().clone()
                times[(name, chain)].append(triton.testing.do_bench(fn, warmup=25, rep=100))
    with open(a.out, "w") as f:
        print(f"{'case':32s} {'chain0':>8s} {'chain1':>8s} {'ratio':>6s} maxdiff")
        for name, _, flops in cases:
            t0, t1 = statistics.median(times[(name, 0)]), statistics.median(times[(name, 1)])
            row = dict(case=name, ms0=t0, ms1=t1, tflops0=flops / t0 / 1e9,
                       tflops1=flops / t1 / 1e9, all0=times[(name, 0)], all1=times[(name, 1)],
                       maxdiff=diffs.get(name))  # fmt: skip
            f.write(json.dumps(row) + "\n")
            print(f"{name:32s} {row['tflops0']:8.1f} {row['tflops1']:8.1f} {t0 / t1:6.3f} "
                  f"{row['maxdiff']}")


if __name__ == "__main__":
    main()
