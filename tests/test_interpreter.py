"""diyfa._interpreter: the fixes to Triton 3.6's CPU interpreter that bf16 and fp8 need.

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


@pytest.mark.parametrize("dtype_b", [torch.float8_e5m2, torch.float8_e4m3fn],
                         ids=["e5m2xe5m2", "e5m2xe4m3"])  # fmt: skip
def test_fp8_e5m2_dot_keeps_subnormals(dtype_b):
    """float8_e5m2 subnormals (2^-16 .. 2^-15 * 0.75) enter the dot with their values: every
    product here is exact in fp32, so the sum must be too (fuzzing found a fp32-output
    product off by 2^-15 without the patch)."""
    import triton
    import triton.language as tl

    import diyfa.ops.matmul  # noqa: F401  (importing a kernel module applies the fixes)

    @triton.jit
    def dot_fp8(A, B, C):
        o = tl.arange(0, 16)
        a = tl.load(A + o[:, None] * 16 + o[None, :])
        b = tl.load(B + o[:, None] * 16 + o[None, :])
        tl.store(C + o[:, None] * 16 + o[None, :], tl.dot(a, b))

    g = torch.Generator().manual_seed(0)
    a = (torch.randn(16, 16, generator=g) * 2.0**-15).to(torch.float8_e5m2)
    assert (a.view(torch.uint8) & 0x7C == 0).sum() > 50  # many subnormals
    b = torch.randn(16, 16, generator=g).to(dtype_b)
    c = torch.empty(16, 16)
    dot_fp8[(1,)](a, b, c)
    assert torch.equal(c.double(), a.double() @ b.double())


def test_fp32_to_e4m3_rounds_to_nearest_and_saturates_like_the_gpu():
    """fp8 attention's P (times 2^8) is cast to float8_e4m3fn in the kernel: the interpreter's
    own cast was up to 64 off for values in [0, 300]; the GPU rounds to nearest even and
    saturates at +-448 (cvt.rn.satfinite)."""
    import triton
    import triton.language as tl

    import diyfa.attention.portable  # noqa: F401  (importing a kernel module applies the fixes)

    @triton.jit
    def to_e4m3(X, Y):
        o = tl.arange(0, 64)
        tl.store(Y + o, tl.load(X + o).to(tl.float8e4nv).to(tl.float32))

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(56, generator=g) * 300, torch.tensor(
        [0.0, -1.0e-3, 2.0**-10, 17.0, 448.0, 460.0, 1000.0, -1000.0])])  # fmt: skip
    y = torch.empty(64)
    to_e4m3[(1,)](x, y)
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    assert torch.equal(y, want), (y - want).abs().max()
