"""One attention call of diyfa or FlashAttention-4 under Nsight Compute, to compare kernels.

Runs ``--provider`` (``diyfa``: ``flash_attention(..., backend="hopper")``; ``fa4``:
``flash_attn.cute.flash_attn_func``) forward, or forward + backward with ``--bwd``, four
times (compiling on the first). Profile the fourth launch of the kernel of interest by name
(diyfa: ``_attn_fwd_hopper`` / ``_attn_bwd_hopper``; FA4: ``FlashAttentionForwardSm90`` /
``FlashAttentionBackwardSm90``; autograd launches the backward from its own thread, so an
NVTX range of this thread would not hold it), e.g. (device):

  ncu --clock-control none --kernel-name regex:FlashAttentionBackwardSm90 --launch-skip 3 \
      --launch-count 1 --section SpeedOfLight --section WarpStateStats \
      --section SourceCounters -o fa4_bwd python3 benchmarks/ncu_compare.py --provider fa4 --bwd
  ncu --import fa4_bwd.ncu-rep --page source --csv --print-source sass > fa4_bwd_sass.csv

Inputs: bf16, (batch, seqlen, heads, head_dim) as both libraries take them.
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provider", choices=("diyfa", "fa4"), required=True)
    ap.add_argument("--bwd", action="store_true", help="forward + backward (default: forward)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--head-dim", type=int, default=128)
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (a.batch, a.seqlen, a.heads, a.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
               .requires_grad_(a.bwd) for _ in range(3))  # fmt: skip
    if a.provider == "diyfa":
        import diyfa

        def attend():
            return diyfa.flash_attention(q, k, v, causal=a.causal, layout="bshd",
                                         backend="hopper")  # fmt: skip
    else:
        from flash_attn.cute import flash_attn_func

        def attend():
            out = flash_attn_func(q, k, v, causal=a.causal)
            return out[0] if isinstance(out, tuple) else out

    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
    for _ in range(4):
        out = attend()
        if a.bwd:
            out.backward(grad)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
