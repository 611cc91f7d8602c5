"""A fix for Triton's CPU interpreter, applied only when ``TRITON_INTERPRET=1``.

Triton 3.6's interpreter stores bfloat16 tensors as their raw ``uint16`` bit patterns (numpy
has no bfloat16), and its ``tl.dot`` hands those bit patterns straight to ``np.matmul``: a
bf16 1.0 (0x3F80) enters the product as 16256.0, so every bf16 dot is garbage (values ~1e10;
upstream triton-lang/triton#11584, declined as "not supported yet"). Loads, stores and the
bf16 <-> fp32 casts are right. On the GPU a bf16 dot multiplies the bf16 *values* and
accumulates in fp32, so converting bf16 operands to fp32 before the matmul reproduces exactly
what the GPU computes; fp16/fp32/fp8 dots are untouched.

Second, its fp32 -> bf16 cast truncates the mantissa where the GPU rounds to nearest even,
which doubles the rounding error of every bf16 result (P before P @ V, every bf16 output).
The patched cast rounds to nearest even, NaN stays NaN.

Third, its ``tl.dot`` on fp8 converts the operands to fp16 with a routine that mishandles
float8_e5m2 subnormals (exponent field 0: values down to 2^-16), which come out wrong, so
products of small e5m2 values went missing (a fp32-output product off by 2^-15). e5m2 is the
top byte of fp16: the patched dot widens its bit patterns exactly (e4m3 operands keep the
interpreter's conversion, which is exact for them).

Fourth, its cast to float8_e4m3fn (``x.to(tl.float8e4nv)``, fp8 attention's P) rounds wrong:
fp32 values in [0, 300] came out up to 64 away from the nearest e4m3 value (the GPU's
``cvt.rn.satfinite`` rounds to nearest even and saturates at +-448). The patched cast does
exactly that, through torch's float8_e4m3fn (NaN stays NaN).
"""

from __future__ import annotations

import numpy as np

_applied = False


def _bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _fp32_to_bf16_bits_rne(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def _fp8e5_bits_to_fp16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint16) << 8).view(np.float16)


def apply() -> None:
    """Patch the interpreter's dot and fp32 -> bf16 cast once (idempotent)."""
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
        if a.dtype.scalar == tl.float8e5 or b.dtype.scalar == tl.float8e5:
            a_data, b_data = (_fp8e5_bits_to_fp16(x.data) if x.dtype.scalar == tl.float8e5
                              else interpreter._convert_float(x.data, x.dtype.scalar, tl.float16,
                                                              None).view(np.float16)
                              for x in (a, b))  # fmt: skip
            out = np.matmul(a_data, b_data, dtype=d.data.dtype) + d.data
            return interpreter.TensorHandle(out, d.dtype.scalar)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    original_cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_fp32_to_bf16_bits_rne(src.data), tl.bfloat16)
        return original_cast(self, src, dst_type)

    original_fp_to_fp = builder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar == tl.float8e4nv and src.dtype.scalar in (tl.float32, tl.float16):
            import torch

            x = torch.from_numpy(np.ascontiguousarray(src.data).astype(np.float32))
            bits = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return interpreter.TensorHandle(bits, tl.float8e4nv)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    builder.create_dot = create_dot
    builder.cast_impl = cast_impl
    builder.create_fp_to_fp = create_fp_to_fp
    _applied = True
