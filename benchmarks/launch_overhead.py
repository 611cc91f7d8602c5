"""Host-side cost of one diyfa attention call (forward, and forward+backward), in microseconds.

Small shapes, so the GPU finishes first and the wall clock measures the Python launch path.
"""

import time

import torch

import diyfa

q, k, v = (torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.float16, requires_grad=True)
           for _ in range(3))  # fmt: skip
for label, fn in [("fwd", lambda: diyfa.flash_attention(q, k, v)),
                  ("fwd+bwd", lambda: diyfa.flash_attention(q, k, v).sum().backward()),
                  ("sdpa fwd", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))]:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    print(f"host time per call, {label}: {(time.perf_counter() - t0) / 200 * 1e6:.1f} us")
