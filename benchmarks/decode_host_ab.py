"""Decode host A/B in one process (GPU machine): an older decode.py (its path the first
argument, e.g. from `git show REV:src/diyfa/attention/decode.py > scratch/decode_old.py`)
against the working tree's, one decode step with and without an append: host microseconds
per call (min and median of 7 x 200, GPU idle), outputs compared bitwise, SDPA alongside."""
import importlib.util
import sys

import torch

from diyfa.attention import decode as new
from diyfa.bench.harness import host_us_per_call

OLD = sys.argv[1] if len(sys.argv) > 1 else "scratch/decode_old.py"
spec = importlib.util.spec_from_file_location("decode_old", OLD)
old = importlib.util.module_from_spec(spec)
sys.modules["decode_old"] = old
spec.loader.exec_module(old)

dq = torch.randn(4, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
kc, vc = (torch.randn(4, 1024, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
kn, vn = (torch.randn(4, 1, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
lens = torch.full((4,), 500, dtype=torch.int32, device="cuda")


def call(mod, append):
    k, v = (kn, vn) if append else (None, None)
    return lambda: mod.append_and_attend(dq, kc, vc, k, v, lens, None, True, None, 0,
                                         max_seqlen_k=1000)


def host(fn, n=200):
    return host_us_per_call(fn, n, warmup=20)


res = {}
with torch.no_grad():
    for append in (False, True):
        a, b = call(old, append)(), call(new, append)()
        assert torch.equal(a[0], b[0]), "outputs differ"
    for _ in range(7):
        for append in (False, True):
            for name, mod in (("old", old), ("new", new)):
                res.setdefault((name, append), []).append(host(call(mod, append)))
            ref = host(lambda: torch.nn.functional.scaled_dot_product_attention(
                dq.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), enable_gqa=True))
            res.setdefault(("sdpa", append), []).append(ref)
for (name, append), ts in sorted(res.items()):
    ts.sort()
    print(f"{name:5s} append={append!s:5s} min {ts[0]:7.1f} median {ts[3]:7.1f} us per call")
