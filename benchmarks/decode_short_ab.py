"""Short contiguous caches on a CUDA GPU: the decode step with SHORT's launch (``decode.SHORT``:
64-key blocks, 4 warps, ``SHORT_STAGES`` stages, whole waves of 2 programs per SM) against
WIDE's (``decode.WIDE``), cuDNN through SDPA alongside, one process, each the best of 2
interleaved do_bench medians. bf16, 32 query heads / 8 kv heads, d128, one new token,
``max_seqlen_k`` given (nothing read back). GB/s = (K and V bytes + q + out) / time. Each
output is checked against cuDNN's first. "rule takes SHORT": what ``decode.short_cache``
picks for the shape on a 132-SM GPU.

    python3 benchmarks/decode_short_ab.py OUT.jsonl
"""

from __future__ import annotations

import functools
import json
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")

from decode_ab import decode_bytes, gbps, inputs  # noqa: E402 (this folder, on sys.path as the script's)

import diyfa  # noqa: E402
from diyfa.attention import decode  # noqa: E402

SHAPES = [(128, 512), (128, 768), (128, 1024), (64, 512), (64, 1024), (32, 1024), (16, 1024),
          (128, 2048)]  # fmt: skip


def main(path: str) -> None:
    rule = decode.short_cache
    rows = []
    with open(path, "w") as out:
        for b, n in SHAPES:
            q, k, v, lens, _ = inputs(b, 32, 8, n, None)
            nbytes = decode_bytes(q, n, 8)
            kt, vt = k.transpose(1, 2), v.transpose(1, 2)

            def cudnn(q=q, kt=kt, vt=vt):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(
                        q.transpose(1, 2), kt, vt, enable_gqa=True)  # fmt: skip

            ref = cudnn().transpose(1, 2)
            fn = functools.partial(diyfa.flash_attention_with_kvcache, q, k, v,
                                   cache_seqlens=lens, max_seqlen_k=n)  # fmt: skip
            row = {"b": b, "n": n, "cudnn": 0, "short": 0, "wide": 0}
            for _ in range(2):
                ms = do_bench(cudnn, warmup=25, rep=100, return_mode="median")
                row["cudnn"] = max(row["cudnn"], gbps(nbytes, ms))
                for name in ("short", "wide"):
                    decode.short_cache = rule if name == "short" else (lambda *a, **kw: False)
                    decode._PREPARED.clear()  # (a kept launch would be replayed)
                    try:
                        diff = (fn().float() - ref.float()).abs().max().item()
                        assert diff < 0.03, (name, diff)
                        ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                    finally:
                        decode.short_cache = rule
                        decode._PREPARED.clear()
                    row[name] = max(row[name], gbps(nbytes, ms))
            row["takes_short"] = rule(n, b * 8, 132)
            print(row, flush=True)
            out.write(json.dumps(row) + "\n")
            rows.append(row)
            del q, k, v, kt, vt
            torch.cuda.empty_cache()
    print("\nGB/s (best of 2 interleaved): SHORT / WIDE / cuDNN")
    for r in rows:
        print(f"b{r['b']} x {r['n']} (rule takes SHORT: {r['takes_short']}): "
              f"{r['short']} / {r['wide']} / {r['cudnn']}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
