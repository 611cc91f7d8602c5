"""A fix for Triton's CPU interpreter, applied only when ``TRITON_INTERPRET=1``.

Triton 3.6's interpreter stores bfloat16 tensors as their raw ``uint16`` bit patterns (numpy
has no bfloat16), and its ``tl.dot`` hands those bit patterns straight to ``np.matmul``: a
bf16 1.0 (0x3F80) enters the product as 16256.0, so every bf16 dot is garbage (values ~1e10;
upstream triton-lang/triton#11584, declined as "not supported yet"). Loads, stores and the
bf16 <-> fp32 casts are right. On the GPU a bf16 dot multiplies the bf16 *values* and
accumulates in fp32, so converting bf16 operands to fp32 before the matmul reproduces exactly
what the GPU computes. That is all this patch does; fp16/fp32/fp8 dots are untouched.
"""

from __future__ import annotations

import numpy as np

_applied = False


def _bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def apply() -> None:
    """Patch the interpreter's dot once (idempotent)."""
    global _applied
    if _applied:
        return
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            a_data = _bf16_bits_to_fp32(a.data) if a.dtype.scalar == tl.bfloat16 else a.data
            b_data = _bf16_bits_to_fp32(b.data) if b.dtype.scalar == tl.bfloat16 else b.data
            out = np.matmul(a_data, b_data, dtype=d.data.dtype) + d.data
            return interpreter.TensorHandle(out, d.dtype.scalar)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    _applied = True
