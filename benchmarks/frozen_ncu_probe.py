"""One d128 forward call shape for Nsight Compute, running or frozen max: b4 h16, seqlen_q from
the command line, 4096 keys, bf16, four calls (profile the fourth's kernel; with the frozen max
each call launches twice). Device, e.g.:

  DIYFA_FROZEN_MAX=0 ncu --clock-control none --kernel-name regex:_attn_fwd_hopper \
      --launch-skip 3 --launch-count 1 --section SpeedOfLight \
      python3 benchmarks/frozen_ncu_probe.py 1024
  DIYFA_FROZEN_MAX=always ncu ... --launch-skip 6 ... python3 benchmarks/frozen_ncu_probe.py 1024
"""

import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")

import diyfa  # noqa: E402

b, h, sq, sk, d = 4, 16, int(sys.argv[1]), 4096, 128
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
k, v = (torch.randn(b, sk, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in range(2))  # fmt: skip
for _ in range(4):
    diyfa.flash_attention(q, k, v, layout="bshd", backend="hopper")
torch.cuda.synchronize()
