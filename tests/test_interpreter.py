"""diyfa._interpreter: the two fixes to Triton 3.6's CPU interpreter that bf16 needs.

Each test fails without its patch (checked by running them with apply() commented out).
"""

import pytest
import torch

from .conftest import HAS_CUDA

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="checks the CPU interpreter only")


def _kernels():
    import triton
    import triton.language as tl

    import diyfa.attention.portable  # noqa: F401  (importing a kernel module applies the fixes)

    @triton.jit
    def dot16(A, B, C):
        o = tl.arange(0, 16)
        a = tl.load(A + o[:, None] * 16 + o[None, :])
        b = tl.load(B + o[:, None] * 16 + o[None, :])
        tl.store(C + o[:, None] * 16 + o[None, :], tl.dot(a, b))

    @triton.jit
    def to_bf16(X, Y):
        o = tl.arange(0, 16)
        tl.store(Y + o, tl.load(X + o).to(tl.bfloat16))

    return dot16, to_bf16


def test_bf16_dot_multiplies_values_not_bit_patterns():
    dot16, _ = _kernels()
    a, b = (torch.randn(16, 16, dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty(16, 16)
    dot16[(1,)](a, b, c)
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-5, atol=1e-5)


def test_fp32_to_bf16_rounds_to_nearest_even_like_the_gpu():
    _, to_bf16 = _kernels()
    x = torch.randn(16) * 10
    x[0], x[1] = float("nan"), float("inf")
    y = torch.empty(16, dtype=torch.bfloat16)
    to_bf16[(1,)](x, y)
    expected = x.to(torch.bfloat16)  # PyTorch rounds to nearest even, as the GPU does
    assert torch.isnan(y[0]) and torch.equal(y[1:], expected[1:])
