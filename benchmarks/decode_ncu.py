"""One KV-cache decode call under Nsight Compute, for issue 13's question: why a paged cache
(pages of 16) decodes at about a third of a contiguous one's speed.

Runs ``flash_attention_with_kvcache`` on one shape (b16, 32 q heads / 8 kv heads, d128, 16k
cached tokens, bf16, one new token) with a contiguous cache or pages of ``--page`` tokens
(shuffled block table), three times: the first compiles, and ncu profiles the third
``_decode_split`` launch. Run it under ncu, e.g. (device):

  ncu --clock-control none --kernel-name regex:_decode_split --launch-skip 2 \
      --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section SourceCounters \
      python3 benchmarks/decode_ncu.py --page 16
(``--fp8``: the cache in e4m3, issue 18's fp8 cache; ``--tokens N``: N new query tokens
per sequence, causal.)
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")
sys.path.insert(0, __file__.rsplit("/", 1)[0])

from decode_ab import inputs  # noqa: E402

import diyfa  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page", type=int, default=0, help="page size (0: contiguous cache)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--cached", type=int, default=16384)
    ap.add_argument("--fp8", action="store_true", help="an e4m3 cache (unit descales)")
    ap.add_argument("--tokens", type=int, default=1, help="new query tokens per sequence")
    ap.add_argument("--config", default=None,
                    help="hopper_decode.CONFIG for an fp8 cache (e.g. 64,2,4,1; the "
                         "warpgroup kernel), or MMA_CONFIG prefixed m (e.g. m128,2,2)")
    a = ap.parse_args()
    if a.config:
        from diyfa.attention import hopper_decode

        config = tuple(int(x) for x in a.config.removeprefix("m").split(","))
        hopper_decode.MMA = a.config.startswith("m")
        if hopper_decode.MMA:
            hopper_decode.MMA_CONFIG = config
        else:
            hopper_decode.CONFIG = config
    q, k, v, seqlens, table = inputs(a.batch, 32, 8, a.cached, a.page or None,
                                     tokens=a.tokens)  # fmt: skip
    extra = {}
    if a.fp8:
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        one = torch.ones(8, device="cuda")
        extra = dict(k_descale=one, v_descale=one)
    for _ in range(3):
        out = diyfa.flash_attention_with_kvcache(q, k, v, cache_seqlens=seqlens,
                                                 block_table=table, **extra)  # fmt: skip
    torch.cuda.synchronize()
    print("page", a.page, "tokens", a.tokens, "out", tuple(out.shape),
          float(out.float().abs().mean()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
