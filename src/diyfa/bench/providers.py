"""Providers: the implementations a benchmark compares, registered by decorator.

A provider is a function ``fn(case, *inputs) -> output`` for one op (``attention`` or
``matmul``), with the layout it wants its inputs in. Optional providers (flash-attn 2,
FlashAttention-4's CuTe kernels, cuBLAS fp8) declare what they need; when it is absent the
provider reports itself unavailable with the reason, and the run goes on without it.
``check(case)`` returns why a provider cannot run a case (None when it can).

Attention inputs: (batch, heads, seqlen, dim) for layout "bhsd", (batch, seqlen, heads, dim)
for "bshd"; k/v carry ``kv_heads``. Causal masks align bottom-right (FlashAttention's
convention); PyTorch's ``is_causal`` aligns top-left, so for seqlen_q != seqlen_k the SDPA
providers pass ``torch.nn.attention.bias.causal_lower_right`` instead.

Matmul inputs: A (m, k) and B as (k, n), or B stored (n, k) and passed transposed when the
case says ``trans_b`` (nn.Linear's weight layout). fp8 cases carry e4m3 tensors.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Provider:
    name: str
    op: str
    fn: Callable
    layout: str = "bhsd"
    requires: tuple[str, ...] = ()
    baseline: bool = False
    backward: bool = True
    check: Callable | None = None
    description: str = ""
    _unavailable: str | None = field(default=None, repr=False)
    _probed: bool = field(default=False, repr=False)

    def unavailable(self) -> str | None:
        """Why this provider cannot run at all here (None when it can)."""
        if not self._probed:
            self._probed = True
            for need in self.requires:  # "module" or "module:attribute"
                module, _, attr = need.partition(":")
                try:
                    mod = importlib.import_module(module)
                    if attr:
                        getattr(mod, attr)
                except Exception as e:  # ImportError, or a broken install raising anything
                    self._unavailable = f"{need} is not importable ({type(e).__name__}: {e})"
                    break
        return self._unavailable

    def cannot_run(self, case) -> str | None:
        return self.check(case) if self.check is not None else None


REGISTRY: dict[tuple[str, str], Provider] = {}


def register(op: str, name: str, **kwargs) -> Callable:
    """Decorator: register ``fn(case, *inputs) -> output`` as provider ``name`` for ``op``."""

    def wrap(fn: Callable) -> Callable:
        doc = (fn.__doc__ or "").strip().splitlines()
        REGISTRY[(op, name)] = Provider(name=name, op=op, fn=fn,
                                        description=doc[0] if doc else "", **kwargs)  # fmt: skip
        return fn

    return wrap


def get(op: str, name: str) -> Provider:
    if (op, name) not in REGISTRY:
        raise ValueError(f"unknown {op} provider {name!r}; known: {names(op)}")
    return REGISTRY[(op, name)]


def names(op: str) -> list[str]:
    return [n for (o, n) in REGISTRY if o == op]


# ------------------------------------------------------------------------------ attention
def _sdpa(backend_name: str, case, q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    kwargs = {}
    if case.hk != case.heads:
        kwargs["enable_gqa"] = True
    if case.causal and case.seqlen_q != case.seqlen_k:
        from torch.nn.attention.bias import causal_lower_right

        kwargs["attn_mask"] = causal_lower_right(case.seqlen_q, case.seqlen_k)
    elif case.causal:
        kwargs["is_causal"] = True
    with sdpa_kernel(backend):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)


def _sdpa_check(case) -> str | None:
    if getattr(case, "variant", False):
        return "SDPA's fused kernels take no window, softcap, ALiBi or sinks"
    if case.causal and case.seqlen_q != case.seqlen_k and case.hk != case.heads:
        return "SDPA takes no lower-right causal bias together with enable_gqa"
    return None


def _diyfa_check(case) -> str | None:
    from diyfa.device import interpreter_enabled

    if not torch.cuda.is_available() and not interpreter_enabled():
        return "needs a CUDA GPU, or TRITON_INTERPRET=1 (set before diyfa is imported)"
    return None


@register("attention", "diyfa", layout="bhsd", check=_diyfa_check)
def _diyfa_attention(case, q, k, v):
    """diyfa.flash_attention, layout bhsd, backend "auto" (the Hopper forward on sm90)."""
    from diyfa.attention import flash_attention

    return flash_attention(q, k, v, causal=case.causal, **case.kernel_options(q.device))


@register("attention", "diyfa-portable", layout="bhsd", check=_diyfa_check)
def _diyfa_portable(case, q, k, v):
    """diyfa.flash_attention forced onto the portable Triton kernels (every run shows what
    the Hopper family gains over them)."""
    from diyfa.attention import flash_attention

    return flash_attention(q, k, v, causal=case.causal, backend="portable",
                           **case.kernel_options(q.device))  # fmt: skip


def _hopper_check(case) -> str | None:
    """Why the Hopper family cannot run ``case`` (None when it can), from its own supports()
    on a problem of the case's shape (uninitialised tensors: only shapes, strides and the
    alignment are read)."""
    if not torch.cuda.is_available():
        return "needs an sm90 GPU (H100/H200)"
    from diyfa.attention import dispatch
    from diyfa.attention.checks import check_inputs

    def view(heads, seqlen):
        shape = (case.batch, heads, seqlen, case.head_dim)
        return torch.empty(shape, dtype=torch_dtype(case.dtype), device="cuda")

    kv = view(case.hk, case.seqlen_k)
    problem = check_inputs(view(case.heads, case.seqlen_q), kv, kv, causal=case.causal,
                           softmax_scale=None, layout="bhsd", align="bottom_right")  # fmt: skip
    return next(f for f in dispatch.families() if f.name == "hopper").supports(problem)


@register("attention", "diyfa-hopper", layout="bhsd", check=_hopper_check)
def _diyfa_hopper(case, q, k, v):
    """diyfa.flash_attention forced onto the Hopper family: the Gluon forward and, where it
    applies (head dims up to 128), the Gluon backward with its atomic dQ."""
    from diyfa.attention import flash_attention

    return flash_attention(q, k, v, causal=case.causal, backend="hopper",
                           **case.kernel_options(q.device))  # fmt: skip


@register("attention", "diyfa-hopper-det", layout="bhsd", check=_hopper_check)
def _diyfa_hopper_det(case, q, k, v):
    """The same with deterministic=True: the portable dQ kernel, then the Gluon dK/dV kernel
    (bitwise-reproducible gradients); the cost of determinism is this against diyfa-hopper."""
    from diyfa.attention import flash_attention

    return flash_attention(q, k, v, causal=case.causal, backend="hopper", deterministic=True,
                           **case.kernel_options(q.device))  # fmt: skip


@register("attention", "sdpa-flash", layout="bhsd", baseline=True, check=_sdpa_check)
def _sdpa_flash(case, q, k, v):
    """PyTorch SDPA, FlashAttention-2 backend."""
    return _sdpa("FLASH_ATTENTION", case, q, k, v)


@register("attention", "sdpa-cudnn", layout="bhsd", baseline=True, check=_sdpa_check)
def _sdpa_cudnn(case, q, k, v):
    """PyTorch SDPA, cuDNN backend."""
    return _sdpa("CUDNN_ATTENTION", case, q, k, v)


@register("attention", "sdpa-efficient", layout="bhsd", check=_sdpa_check)
def _sdpa_efficient(case, q, k, v):
    """PyTorch SDPA, memory-efficient (xformers-style) backend."""
    return _sdpa("EFFICIENT_ATTENTION", case, q, k, v)


@register("attention", "sdpa-math", layout="bhsd", check=_sdpa_check)
def _sdpa_math(case, q, k, v):
    """PyTorch SDPA, math backend: standard attention, materialises the score matrix."""
    return _sdpa("MATH", case, q, k, v)


def _needs_cuda(case) -> str | None:
    return None if torch.cuda.is_available() else "needs a CUDA GPU"


def _fa2_check(case) -> str | None:
    if getattr(case, "sinks", False):
        return "FA2 has no attention sinks"
    return _needs_cuda(case)


@register(
    "attention",
    "flash-attn-2",
    layout="bshd",
    requires=("flash_attn:flash_attn_func",),
    baseline=True,
    check=_fa2_check,
)
def _flash_attn_2(case, q, k, v):
    """flash_attn.flash_attn_func (FlashAttention-2 package), layout bshd."""
    from flash_attn import flash_attn_func

    opts = case.kernel_options(q.device)
    return flash_attn_func(q, k, v, causal=case.causal,
                           window_size=opts.get("window_size", (-1, -1)),
                           softcap=opts.get("softcap", 0.0),
                           alibi_slopes=opts.get("alibi_slopes"))  # fmt: skip


def _fa4_options(case, device) -> dict:
    """FA4's keyword arguments for the case's variants, by the names its installed
    ``flash_attn_func`` takes (window_size with None for an unbounded side, softcap,
    learnable_sink); ALiBi it has none of."""
    opts = case.kernel_options(device)
    kw = {}
    if "window_size" in opts:
        kw["window_size"] = tuple(None if w < 0 else w for w in opts["window_size"])
    if "softcap" in opts:
        kw["softcap"] = opts["softcap"]
    if "sinks" in opts:
        kw["learnable_sink"] = opts["sinks"]
    return kw


def _fa4_check(case) -> str | None:
    why = _needs_cuda(case)
    if why or not getattr(case, "variant", False):
        return why
    if case.alibi:
        return "FA4 has no ALiBi"
    import inspect

    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # reported by the provider's own availability check
        return f"flash_attn.cute is not importable ({type(e).__name__})"
    params = inspect.signature(flash_attn_func).parameters
    missing = [n for n in _fa4_options(case, "cpu") if n not in params]
    return f"its flash_attn_func takes no {', '.join(missing)}" if missing else None


@register(
    "attention",
    "fa4-cute",
    layout="bshd",
    requires=("flash_attn.cute:flash_attn_func",),
    baseline=True,
    check=_fa4_check,
)
def _fa4_cute(case, q, k, v):
    """flash_attn.cute.flash_attn_func (FlashAttention-4, CuTe DSL), layout bshd."""
    from flash_attn.cute import flash_attn_func

    out = flash_attn_func(q, k, v, causal=case.causal, **_fa4_options(case, q.device))
    return out[0] if isinstance(out, tuple) else out


# --------------------------------------------------------------------------------- decode
# Inputs: q (batch, seqlen_q, heads, d), k_cache, v_cache (contiguous (batch, len, kv_heads,
# d) or pages), cache_seqlens (int32), block_table (None for a contiguous cache).
@register("decode", "diyfa", layout="bshd", backward=False, check=_diyfa_check)
def _diyfa_decode(case, q, k_cache, v_cache, seqlens, table):
    """diyfa.flash_attention_with_kvcache (split-KV Triton kernel)."""
    from diyfa.attention import flash_attention_with_kvcache

    return flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                        block_table=table)  # fmt: skip


@register("decode", "diyfa-nosync", layout="bshd", backward=False, check=_diyfa_check)
def _diyfa_decode_nosync(case, q, k_cache, v_cache, seqlens, table):
    """diyfa.flash_attention_with_kvcache with max_seqlen_k given: lengths and pages checked
    on the device, nothing read back (how a serving loop or a CUDA graph calls it)."""
    from diyfa.attention import flash_attention_with_kvcache

    return flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                        block_table=table,
                                        max_seqlen_k=case.cache_len)  # fmt: skip


@register("decode", "fa4-cute", layout="bshd", backward=False, baseline=True,
          requires=("flash_attn.cute:flash_attn_varlen_func",), check=_needs_cuda)  # fmt: skip
def _fa4_decode(case, q, k_cache, v_cache, seqlens, table):
    """flash_attn.cute.flash_attn_varlen_func with seqused_k (and page_table): FlashAttention-4's
    cache path (one split: its sm90 kernel has no split-KV)."""
    from flash_attn.cute import flash_attn_varlen_func

    out = flash_attn_varlen_func(q, k_cache, v_cache, seqused_k=seqlens, page_table=table,
                                 causal=True, num_splits=1)  # fmt: skip
    return out[0] if isinstance(out, tuple) else out


def _sdpa_decode_check(case) -> str | None:
    if case.page_size is not None:
        return "SDPA reads no paged cache"
    return None


def _sdpa_decode(backend_name: str, case, q, k_cache, v_cache, seqlens, table):
    """SDPA over views of the contiguous cache (bhsd), bottom-right causal for several new
    tokens, GQA through enable_gqa."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k = k_cache[:, : case.cache_len].transpose(1, 2)
    v = v_cache[:, : case.cache_len].transpose(1, 2)
    kwargs = {"enable_gqa": case.kv_heads != case.heads}
    if case.seqlen_q > 1:
        from torch.nn.attention.bias import causal_lower_right

        kwargs["attn_mask"] = causal_lower_right(case.seqlen_q, case.cache_len)
    with sdpa_kernel(getattr(SDPBackend, backend_name)):
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k, v,
                                                               **kwargs)  # fmt: skip
    return out.transpose(1, 2)


@register("decode", "sdpa-cudnn", layout="bshd", backward=False, baseline=True,
          check=_sdpa_decode_check)  # fmt: skip
def _sdpa_cudnn_decode(case, *inputs):
    """PyTorch SDPA, cuDNN backend, over the contiguous cache."""
    return _sdpa_decode("CUDNN_ATTENTION", case, *inputs)


@register("decode", "sdpa-flash", layout="bshd", backward=False, baseline=True,
          check=_sdpa_decode_check)  # fmt: skip
def _sdpa_flash_decode(case, *inputs):
    """PyTorch SDPA, FlashAttention-2 backend, over the contiguous cache."""
    return _sdpa_decode("FLASH_ATTENTION", case, *inputs)


@register("decode", "sdpa-math", layout="bshd", backward=False, check=_sdpa_decode_check)
def _sdpa_math_decode(case, *inputs):
    """PyTorch SDPA, math backend (standard attention), over the contiguous cache."""
    return _sdpa_decode("MATH", case, *inputs)


# --------------------------------------------------------------------------------- varlen
# Inputs: packed q (total, heads, d), k, v (total, kv_heads, d), int32 cu_seqlens, max length.
@register("varlen", "diyfa", layout="thd", check=_diyfa_check)
def _diyfa_varlen(case, q, k, v, cu, max_len):
    """diyfa.flash_attention_varlen (packed, no padding work)."""
    from diyfa.attention import flash_attention_varlen

    return flash_attention_varlen(q, k, v, cu, cu, max_len, max_len, causal=case.causal)


@register("varlen", "diyfa-portable", layout="thd", check=_diyfa_check)
def _diyfa_portable_varlen(case, q, k, v, cu, max_len):
    """The same forced onto the portable Triton kernels, forward and backward."""
    from diyfa.attention import flash_attention_varlen

    return flash_attention_varlen(q, k, v, cu, cu, max_len, max_len, causal=case.causal,
                                  backend="portable")  # fmt: skip


def _hopper_varlen_check(case) -> str | None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return "needs an sm90 GPU (H100/H200)"
    return None


@register("varlen", "diyfa-hopper", layout="thd", check=_hopper_varlen_check)
def _diyfa_hopper_varlen(case, q, k, v, cu, max_len):
    """The same forced onto the Hopper family: its packed-sequence forward and Gluon backward
    (atomic dQ); against "diyfa" this is what "auto" would gain by taking them."""
    from diyfa.attention import flash_attention_varlen

    return flash_attention_varlen(q, k, v, cu, cu, max_len, max_len, causal=case.causal,
                                  backend="hopper")  # fmt: skip


@register("varlen", "diyfa-hopper-det", layout="thd", check=_hopper_varlen_check)
def _diyfa_hopper_det_varlen(case, q, k, v, cu, max_len):
    """The same with deterministic=True: the portable dQ kernel, then the Gluon dK/dV kernel."""
    from diyfa.attention import flash_attention_varlen

    return flash_attention_varlen(q, k, v, cu, cu, max_len, max_len, causal=case.causal,
                                  backend="hopper", deterministic=True)  # fmt: skip


@register("varlen", "sdpa-cudnn-padded", layout="thd", baseline=True, check=_needs_cuda)
def _sdpa_cudnn_padded(case, q, k, v, cu, max_len):
    """What a user without varlen does: pad every sequence to the longest (bhsd), PyTorch
    SDPA's cuDNN backend, unpad. The padded keys are masked out (a boolean key mask), and
    the pad/unpad copies count."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, lens = len(case.lengths), torch.tensor(case.lengths, device=q.device)
    rows = torch.arange(max_len, device=q.device)
    valid = rows[None, :] < lens[:, None]  # (batch, max_len)

    def pad(t):
        out = t.new_zeros(b, max_len, t.shape[1], t.shape[2])
        out[valid] = t
        return out.transpose(1, 2)

    # Padded query rows (dropped at the end) see every key: no fully masked row, whose NaN
    # would reach the valid rows' gradients.
    mask = valid[:, None, None, :] | ~valid[:, None, :, None]
    if case.causal:
        mask = mask & torch.ones(max_len, max_len, dtype=torch.bool, device=q.device).tril()
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(
            pad(q), pad(k), pad(v), attn_mask=mask, enable_gqa=case.kv_heads != case.heads)
    return out.transpose(1, 2)[valid]


# --------------------------------------------------------------------------------- matmul
def _not_fp8(case) -> str | None:
    if case.dtype.startswith("fp8"):
        return "torch.matmul has no fp8 path (see provider cublas-fp8)"
    return None


def _fp8_only(case) -> str | None:
    if not case.dtype.startswith("fp8"):
        return "cublas-fp8 runs fp8 cases only"
    if not torch.cuda.is_available():
        return "torch._scaled_mm needs a CUDA GPU"
    if not case.trans_b:
        return "torch._scaled_mm needs B column-major (trans_b=True)"
    return None


@register("matmul", "diyfa", backward=False, requires=("diyfa.ops.matmul:triton_matmul",),
          check=_diyfa_check)  # fmt: skip
def _diyfa_matmul(case, a, b):
    """diyfa.triton_matmul (Triton)."""
    from diyfa.ops.matmul import triton_matmul

    if case.dtype.startswith("fp8"):  # fp8 needs scales: unit per-tensor scales, bf16 out
        one = torch.ones((), device=a.device, dtype=torch.float32)
        return triton_matmul(a, b, scale_a=one, scale_b=one)
    return triton_matmul(a, b)


@register("matmul", "diyfa-fp8-acc32", backward=False,
          requires=("diyfa.ops.matmul:triton_matmul",), check=_fp8_only)  # fmt: skip
def _diyfa_matmul_fp8_acc32(case, a, b):
    """diyfa.triton_matmul with fp8 partial sums promoted to fp32 every 32 products
    (``DIYFA_FP8_ACC=32``: the accuracy of cuBLAS's default, use_fast_accum=False)."""
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, {"DIYFA_FP8_ACC": "32"}):
        return _diyfa_matmul(case, a, b)


@register("matmul", "cublas", backward=False, baseline=True, check=_not_fp8)
def _cublas(case, a, b):
    """torch.matmul (cuBLAS on the GPU)."""
    return torch.matmul(a, b)


@register("matmul", "cublas-fp8", backward=False, baseline=True, check=_fp8_only)
def _cublas_fp8(case, a, b):
    """torch._scaled_mm, e4m3 inputs with unit scales, bf16 output (cuBLASLt fp8)."""
    one = torch.ones((), device=a.device, dtype=torch.float32)
    return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


@register("matmul", "cublas-fp8-fast", backward=False, check=_fp8_only)
def _cublas_fp8_fast(case, a, b):
    """torch._scaled_mm with use_fast_accum=True: fp8 sums kept in the tensor cores'
    reduced-precision accumulator (what diyfa's fp8 matmul does by default on Hopper)."""
    one = torch.ones((), device=a.device, dtype=torch.float32)
    return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                            use_fast_accum=True)  # fmt: skip


TORCH_DTYPES = {
    "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
    "fp8_e4m3": getattr(torch, "float8_e4m3fn", None),
    "fp8_e5m2": getattr(torch, "float8_e5m2", None),
}  # fmt: skip


def torch_dtype(name: str) -> torch.dtype:
    dt = TORCH_DTYPES.get(name)
    if dt is None:
        raise ValueError(f"dtype {name!r} is not available here; accepted: {sorted(TORCH_DTYPES)}")
    return dt
