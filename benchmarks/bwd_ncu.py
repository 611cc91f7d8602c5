"""One Gluon backward under Nsight Compute: where its warps stall (issue 12).

Runs ``flash_attention`` forward + backward three times on b1 h16 8192 d128 bf16 (``--shape``,
``--head-dim``) through
``backend="hopper"`` (atomic dQ, or the deterministic path with ``--deterministic``); ncu
profiles the third ``_attn_bwd_hopper`` launch. Run it under ncu, e.g. (device):

  ncu --clock-control none --kernel-name regex:_attn_bwd_hopper --launch-skip 2 \
      --launch-count 1 --section SourceCounters --section WarpStateStats \
      --import-source yes -o bwd -f python3 benchmarks/bwd_ncu.py --causal
  ncu --import bwd.ncu-rep --page source --csv --print-source sass > bwd_sass.csv

(the CSV has each SASS instruction's stall samples by reason; docs/attention.md, "The Hopper
backward", reads them.)

``--mix packed`` runs the varlen suite's mix instead (diyfa.bench.suites.varlen_mix: 64k
tokens of packed sequences, 16 query / 4 kv heads) through ``flash_attention_varlen``;
``--mix equal`` the varlen-equal suite's batches of the same tokens (issue 13's yardstick).
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")

import diyfa  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--mix", choices=("packed", "equal"), default=None)
    ap.add_argument("--shape", default="1x16x8192", help="batch x heads x seqlen (not --mix)")
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    if a.mix:
        from diyfa.bench.suites import varlen_mix

        lengths, cu, total, longest = varlen_mix()
        h, hk, d = 2048 // a.head_dim, 4 if a.head_dim == 128 else 2048 // a.head_dim, a.head_dim
        if a.mix == "equal":
            seq = max(128, round(sum(n * n for n in lengths) / total / 128) * 128)
            shape = lambda heads: (max(1, round(total / seq)), seq, heads, d)  # noqa: E731
        else:
            shape = lambda heads: (total, heads, d)  # noqa: E731
        q = torch.randn(shape(h), device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(shape(hk), device="cuda", dtype=torch.bfloat16, generator=g)
                for _ in range(2))  # fmt: skip
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        for _ in range(3):
            if a.mix == "equal":
                out = diyfa.flash_attention(q, k, v, causal=a.causal, layout="bshd",
                                            backend="hopper", deterministic=a.deterministic)
            else:
                out = diyfa.flash_attention_varlen(q, k, v, cu, cu, longest, longest,
                                                   causal=a.causal, backend="hopper",
                                                   deterministic=a.deterministic)
            out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        return 0
    b, h, n = (int(x) for x in a.shape.split("x"))
    q, k, v = (torch.randn(b, h, n, a.head_dim, device="cuda", dtype=torch.bfloat16,
                           generator=g).requires_grad_() for _ in range(3))  # fmt: skip
    for _ in range(3):
        out = diyfa.flash_attention(q, k, v, causal=a.causal, backend="hopper",
                                    deterministic=a.deterministic)  # fmt: skip
        out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
