"""Every input check of the attention functions, in one place: :func:`check_inputs`.

What passes here is what the portable kernel family runs (any kernel family may accept less:
it says so in its ``supports``). Errors are TypeError for a wrong kind of value (not a tensor,
a dtype, a flag that is not a bool) and ValueError for a wrong value (shapes, layout, device).
"""

from __future__ import annotations

import dataclasses
import math
import os
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor  # (loaded by torch itself)

from diyfa.attention.problem import (
    ALIGNS,
    LAYOUTS,
    Problem,
    bhsd_shape,
    bhsd_strides,
    device_capability,
)
from diyfa.device import require_kernel_device

MAX_HEAD_DIM = 256
# The KV-cache path also takes MLA's decode form: q / k head dims up to 576, values up to 512.
MAX_CACHE_HEAD_DIM = 576
MAX_CACHE_HEAD_DIM_V = 512
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_flag(name: str, value) -> None:
    """TypeError unless ``value`` is a bool (a flag given as 1, "yes" or None is refused, not
    read as truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


_E4M3 = torch.float8_e4m3fn
_SCALE_MAX = 2.0**126  # times log2(e), still within fp32's range (3.4e38)
_FP32_TINY = 2.0**-126  # fp32's smallest normal number


def _resolved_scale(softmax_scale, head_dim: int) -> float:
    """The softmax scale as a float: the one given, or 1/sqrt(head_dim). The kernels take it
    in fp32 (times log2(e)): a scale above 2^126 is refused; one below its smallest normal number
    (2^-126) is 0, as the GPU's fp32 arithmetic would make it (and the Triton interpreter
    would otherwise type it float64 and fail inside the kernel)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None, got {softmax_scale!r}")
    if not math.isfinite(softmax_scale) or softmax_scale < 0:
        raise ValueError(f"softmax_scale must be finite and >= 0, got {softmax_scale} (the "
                         "kernels take a row's maximum score before scaling)")  # fmt: skip
    if softmax_scale > _SCALE_MAX:
        raise ValueError(f"softmax_scale must be at most 2^126 ({_SCALE_MAX:.3g}: the kernels "
                         f"scale in fp32), got {softmax_scale}")  # fmt: skip
    return float(softmax_scale) if softmax_scale >= _FP32_TINY else 0.0


def check_tanh_scale(scale: float, softcap: float) -> None:
    """With a softcap the kernels scale the scores by scale / softcap in fp32: refused when
    that ratio passes 2^126 (each bounded alone, 2^100 / 2^-100 would still overflow)."""
    if softcap and scale / softcap > _SCALE_MAX:
        raise ValueError(f"softmax_scale / softcap must be at most 2^126 (the kernels take it "
                         f"in fp32), got {scale} / {softcap}")  # fmt: skip


def check_variants(window_size, softcap, causal) -> tuple[int, int, float]:
    """(window_left, window_right, softcap) of the options, checked: FlashAttention's
    ``window_size=(left, right)``, -1 = unbounded (causal=True makes right 0 and forbids a
    positive one); ``softcap`` >= 0, 0 = off."""
    if window_size == (-1, -1) and type(softcap) is float and softcap == 0.0:  # the defaults
        return -1, (0 if causal else -1), 0.0
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size must be a (left, right) pair of ints, got {window_size!r}")
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(f"window_size sides must be >= 0 or -1 (unbounded), got "
                         f"{tuple(window_size)}")  # fmt: skip
    if causal and right > 0:
        raise ValueError(f"window_size={tuple(window_size)} looks {right} keys ahead, which "
                         "causal=True forbids: use (left, 0) or (left, -1) with causal=True")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a number, got {softcap!r}")
    if not (softcap >= 0 and math.isfinite(softcap)):
        raise ValueError(f"softcap must be a finite number >= 0 (0 turns it off), got {softcap}")
    if softcap and not _FP32_TINY <= softcap <= _SCALE_MAX:  # the kernels divide by it in fp32
        raise ValueError(f"softcap must be 0 (off) or between 2^-126 and 2^126 (the kernels "
                         f"take 1 / softcap in fp32), got {softcap}")  # fmt: skip
    return left, (0 if causal else right), float(softcap)


def check_bias_tensors(alibi_slopes, sinks, batch: int, heads: int, device) -> None:
    """ALiBi slopes: fp32, (heads,) or (batch, heads), contiguous, on the inputs' device.
    Sinks: fp16/bf16/fp32 logits, (heads,), contiguous, on the inputs' device."""
    for name, t, shapes, dtypes in (
        ("alibi_slopes", alibi_slopes, ((heads,), (batch, heads)), (torch.float32,)),
        ("sinks", sinks, ((heads,),), (torch.float16, torch.bfloat16, torch.float32)),
    ):
        if t is not None:
            shape_rule = ("must have shape " + " or ".join(str(s) for s in shapes)
                          + f" (heads={heads}, batch={batch})")  # fmt: skip
            check_small_tensor(name, t, dtypes, shapes, shape_rule, device)


def check_small_tensor(name: str, t, dtypes: tuple, shapes: tuple, shape_rule: str, device,
                       fake: bool = False) -> None:
    """A small per-head tensor argument (ALiBi slopes, sinks, fp8 descales): a tensor of one
    of ``dtypes`` and ``shapes`` (``shape_rule`` says which, in words), contiguous, on
    ``device``; TypeError / ValueError naming what was given otherwise. ``fake``: tracing,
    strides unknown."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}.dtype is {t.dtype}; accepted: "
                        + ", ".join(str(d).removeprefix("torch.") for d in dtypes))
    if tuple(t.shape) not in shapes:
        raise ValueError(f"{name} {shape_rule}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the inputs on {device}: one device")
    if not fake and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def no_dropout(dropout_p) -> bool:
    """Whether ``dropout_p`` is a number equal to 0: no mask, no seed to draw (a bad value is
    left to :func:`check_dropout`)."""
    return (isinstance(dropout_p, (int, float)) and not isinstance(dropout_p, bool)
            and dropout_p == 0)  # fmt: skip


def check_dropout(dropout_p) -> float:
    """``dropout_p`` as a float in [0, 1)."""
    if type(dropout_p) is float and dropout_p == 0.0:  # the default
        return 0.0
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a number, got {dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return float(dropout_p)


def check_fp8_inputs(q, k, v, q_descale, k_descale, v_descale, batch: int, kv_heads: int,
                     dropout_p: float, fake: bool = False, sinks=None) -> tuple | None:
    """The descales of fp8 (float8_e4m3fn) q, k, v, checked: each fp32, on the inputs'
    device, (1,) / () per tensor or contiguous (batch, kv_heads), all three one shape
    (returned as (1,) or (batch, kv_heads) tensors); None for 16/32-bit inputs, which take
    no descales. fp8 is forward only (inference): no gradient, no dropout."""
    names = ("q_descale", "k_descale", "v_descale")
    given = (q_descale, k_descale, v_descale)
    if q.dtype != torch.float8_e4m3fn:
        for name, t in zip(names, given, strict=True):
            if t is not None:
                raise ValueError(f"{name} applies to float8_e4m3fn q, k, v; these are "
                                 f"{q.dtype}")  # fmt: skip
        return None
    out = []
    for name, t in zip(names, given, strict=True):
        if t is None:
            raise ValueError(f"fp8 (float8_e4m3fn) q, k, v need {name}: fp32, (1,) per tensor "
                             f"or (batch={batch}, kv_heads={kv_heads}); a stored value times "
                             "its descale is the real one")  # fmt: skip
        check_small_tensor(name, t, (torch.float32,), ((), (1,), (batch, kv_heads)),
                           f"must be (1,) per tensor or (batch, kv_heads) = ({batch}, "
                           f"{kv_heads})", q.device, fake)  # fmt: skip
        out.append(t.reshape(1) if t.dim() == 0 else t)
    if len({tuple(t.shape) for t in out}) != 1:
        raise ValueError("q_descale, k_descale and v_descale must share a shape, got "
                         + ", ".join(str(tuple(t.shape)) for t in out))  # fmt: skip
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise ValueError("fp8 attention is forward only (inference): q, k, v require grad; "
                         "call it under torch.no_grad() or detach them")  # fmt: skip
    if torch.is_grad_enabled() and sinks is not None and sinks.requires_grad:
        raise ValueError("fp8 attention is forward only (inference): sinks require grad; "
                         "call it under torch.no_grad() or detach them")  # fmt: skip
    if dropout_p:
        raise ValueError(f"fp8 attention is forward only (inference): dropout_p must be 0, "
                         f"got {dropout_p}")  # fmt: skip
    cap = device_capability(q.device)
    if cap is not None and cap < (8, 9):
        raise ValueError(f"fp8 attention needs a GPU with fp8 tensor cores (compute capability "
                         f">= 8.9), got {cap[0]}.{cap[1]}")  # fmt: skip
    return tuple(out)


def check_inputs(q, k, v, *, causal, softmax_scale, layout, align, fake=False,
                 deterministic=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                 sinks=None, dropout_p=0.0, dropout_seed=0, q_descale=None, k_descale=None,
                 v_descale=None) -> Problem:
    """Check q, k, v and the options; return the call's :class:`Problem`.

    ``layout`` is "bhsd" or "bshd"; ``align`` ("bottom_right" or "top_left") is chosen by
    the public function, not by its caller. Raises TypeError or ValueError naming what is
    wrong. ``fake``: q, k, v are fake tensors (tracing): every check but the pointers'.
    ``deterministic``: the backward must be bitwise reproducible; also set while
    ``torch.use_deterministic_algorithms(True)`` is on. ``window_size`` and ``softcap``: see
    :func:`check_variants`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if align not in ALIGNS:
        raise ValueError(f"align must be one of {ALIGNS}, got {align!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            axes = "batch, heads, seqlen, head_dim" if layout == "bhsd" else (
                "batch, seqlen, heads, head_dim")
            raise ValueError(
                f"{name} must be 4-D ({axes} for layout={layout!r}), got shape {tuple(t.shape)}"
            )
        if t.dtype not in SUPPORTED_DTYPES and t.dtype != torch.float8_e4m3fn:
            raise TypeError(
                f"{name}.dtype is {t.dtype}; accepted: float16, bfloat16, float32, and "
                "float8_e4m3fn (forward only, with descales)"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k, v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}"
        )
    require_kernel_device(q, "q, k, v")
    b, h, sq, d = bhsd_shape(q, layout)
    bk, hk, sk, dk = bhsd_shape(k, layout)
    bv, hv, sv, dv = bhsd_shape(v, layout)
    if not (b == bk == bv):
        raise ValueError(f"batch sizes differ: q has {b}, k has {bk}, v has {bv}")
    if not (hk == hv and sk == sv):
        raise ValueError(
            f"k and v must have the same heads and seqlen, got k (heads={hk}, seqlen={sk}) "
            f"and v (heads={hv}, seqlen={sv})"
        )
    if d != dk:
        raise ValueError(f"q and k must share head_dim, got q={d}, k={dk}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in 1..{MAX_HEAD_DIM}, got {d}")
    if not 1 <= dv <= MAX_HEAD_DIM:
        raise ValueError(f"v's head_dim must be in 1..{MAX_HEAD_DIM}, got {dv}")
    if hk == 0 or h % hk:
        raise ValueError(
            f"q heads ({h}) must be a multiple of k/v heads ({hk}) for GQA/MQA"
        )
    check_flag("causal", causal)
    check_flag("deterministic", deterministic)
    window_left, window_right, softcap = check_variants(window_size, softcap, causal)
    if alibi_slopes is not None or sinks is not None:
        check_bias_tensors(alibi_slopes, sinks, b, h, q.device)
    dropout_p = check_dropout(dropout_p)
    descales = None  # the common case decided in one test (this runs on every call)
    if q.dtype == _E4M3 or not (q_descale is None and k_descale is None and v_descale is None):
        descales = check_fp8_inputs(q, k, v, q_descale, k_descale, v_descale, b, hk,
                                    dropout_p, fake, sinks)  # fmt: skip
    scale = _resolved_scale(softmax_scale, d)
    if softcap:
        check_tanh_scale(scale, softcap)
    device = q.device
    # Fake tensors (torch.compile's tracing, ops.py) have no storage: alignment unknown.
    aligned16 = fake or not (q.data_ptr() % 16 or k.data_ptr() % 16 or v.data_ptr() % 16)
    # Positional, in field order: keywords cost ~0.6 us more on every call.
    return Problem(b, h, hk, sq, sk, d, q.dtype, device, layout, causal, align, scale,
                   bhsd_strides(q, layout), bhsd_strides(k, layout), bhsd_strides(v, layout),
                   device_capability(device), aligned16, None, None, 0,
                   deterministic or torch.are_deterministic_algorithms_enabled(), window_left,
                   window_right, softcap, alibi_slopes, sinks,
                   0 if dv == d else dv, dropout_p, dropout_seed, descales)  # fmt: skip


# Attention calls on a GPU whose signature passed check_inputs before, with the Problem it
# built: a training or inference loop repeats a few signatures, and the checks cost ~9 us of
# host time per call on the H200's host (a small forward's kernel is ~10 us); more with the
# variants' options.
_CHECKED: dict = {}
_CHECKED_KEPT = 64


def _own_signature(t) -> tuple | None:
    """What the checks read of a sinks or slopes argument (None: none given); TypeError for
    anything but a plain tensor or a model's ``nn.Parameter`` (gpt-oss's sinks are one; the
    checks then run and say what is wrong)."""
    if t is None:
        return None
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:  # noqa: E721
        raise TypeError
    return t.shape, t.stride(), t.dtype, t.device


def checked_before(q, k, v, causal, softmax_scale, layout, deterministic, window_size=(-1, -1),
                   softcap=0.0, alibi_slopes=None, sinks=None) -> tuple:
    """(Problem, key) for an attention call without dropout or fp8 on CUDA tensors: the
    Problem that :func:`check_inputs` built for an earlier call with the same signature
    (None if none), with this call's sinks and ALiBi slopes in it, and the key under which
    :func:`remember_checked` keeps this call's. The signature is everything the checks and
    the Problem read: each tensor's type, shape, strides, dtype and device (sinks and
    slopes too), whether q, k and v all start on 16 bytes, each option's type and value
    (the window's sides' too), and torch's deterministic-algorithms flag. Only calls that
    passed every check are kept, so a bad call never finds one. Not for CPU tensors (their
    checks depend on the interpreter's setting too), tensor subclasses or a window given as
    a list: (None, None)."""
    if not (type(q) is torch.Tensor and type(k) is torch.Tensor  # noqa: E721
            and type(v) is torch.Tensor and q.is_cuda  # noqa: E721
            and type(window_size) is tuple):  # noqa: E721  # fmt: skip
        return None, None
    try:
        key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype,
               v.dtype, q.device, k.device, v.device,
               not (q.data_ptr() % 16 or k.data_ptr() % 16 or v.data_ptr() % 16), type(causal),
               causal, type(softmax_scale), softmax_scale, type(layout), layout,
               type(deterministic), deterministic, torch.are_deterministic_algorithms_enabled(),
               type(window_size), tuple((type(w), w) for w in window_size), type(softcap),
               softcap, _own_signature(alibi_slopes), _own_signature(sinks))  # fmt: skip
        problem = _CHECKED.get(key)
    except TypeError:  # an unhashable option or bad tensor: the checks will say what is wrong
        return None, None
    if problem is not None and (sinks is not None or alibi_slopes is not None):
        problem = dataclasses.replace(problem, sinks=sinks, alibi_slopes=alibi_slopes)
    return problem, key


def remember_checked(key, problem: Problem) -> None:
    """Keep ``problem`` for later calls with ``key`` (from :func:`checked_before`; None:
    nothing kept), without its sinks and slopes (each call brings its own)."""
    if key is None:
        return
    if len(_CHECKED) >= _CHECKED_KEPT:
        _CHECKED.clear()
    _CHECKED[key] = problem.without_own_tensors()


def _check_cu_seqlens(name: str, cu, total: int, max_seqlen, max_name: str, device) -> int:
    """Check one cumulative-lengths tensor (all but its values: :class:`HostLengths` reads
    and checks those); returns the number of sequences."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name}.dtype is {cu.dtype}; accepted: int32")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D with batch + 1 >= 1 entries, got shape "
                         f"{tuple(cu.shape)}")  # fmt: skip
    if cu.device != device:
        raise ValueError(f"{name} must be on the tensors' device {device}, got {cu.device}")
    if not cu.is_contiguous():
        raise ValueError(f"{name} must be contiguous (the kernels read it element by element), "
                         f"got strides {cu.stride()}")  # fmt: skip
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise TypeError(f"{max_name} must be an int >= 0, got {max_seqlen!r}")
    return cu.shape[0] - 1


def _check_cu_values(name: str, values: list, total: int, max_seqlen: int,
                     max_name: str) -> tuple:
    """The values of one cumulative-lengths tensor against its packed tensor's rows and the
    given longest length; returns them as a tuple."""
    if values[0] != 0 or values[-1] != total:
        raise ValueError(f"{name} must start at 0 and end at the packed rows ({total}), got "
                         f"{values[0]} .. {values[-1]}")  # fmt: skip
    lengths = [b - a for a, b in zip(values, values[1:], strict=False)]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name} must be non-decreasing, got {values}")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(f"{max_name}={max_seqlen} is less than the longest sequence in "
                         f"{name} ({max(lengths)})")  # fmt: skip
    return tuple(values)


class HostLengths:
    """A packed call's cumulative lengths on their way to the host (``Problem.cu_host``).

    The checks start the copies and do not wait (on a GPU: into pinned memory, behind the
    work already queued); :meth:`values` waits, reads them and checks them against the
    tensors (the ValueErrors of a bad cu_seqlens), once. Every family reads them before its
    first launch (``dispatch.Family``; the Hopper forward as late as it can, after its
    launch is set up): reading them in the checks made the GPU sit idle through all the
    host work between that read and the launch (0.2-0.3 ms per packed forward on the H200's
    host, 2026-11-24). A cu_seqlens tensor read before and not written since (by PyTorch's
    version counter: :data:`REMEMBER_LENGTHS`) is not copied again: nothing to wait for."""

    __slots__ = ("_reads", "_event", "_values", "_fresh")

    def __init__(self, reads: list):
        """``reads``: (name, cu tensor, packed rows, max_seqlen, its name) for q, then k."""
        self._event = None
        self._values = None
        self._fresh = []  # (cu, its stamp, host copy): to remember once checked
        staged = []
        for name, cu, total, max_seqlen, max_name in reads:
            stamp = version_stamp(cu)
            host = recall(cu, stamp)
            if host is None:
                if cu.device.type == "cuda":
                    host = torch.empty(cu.shape, dtype=cu.dtype, pin_memory=True)
                    host.copy_(cu, non_blocking=True)
                else:
                    host = cu.clone()
                self._fresh.append((cu, stamp, host))
            staged.append((name, host, total, max_seqlen, max_name))
        if any(cu.device.type == "cuda" for cu, _, _ in self._fresh):
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(reads[0][1].device))  # (the copies')
        self._reads = tuple(staged)

    def values(self) -> tuple[tuple, tuple]:
        """(cu_seqlens_q values, cu_seqlens_k values), checked; ValueError if they do not fit
        the tensors."""
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            self._values = tuple(_checked_values(*read) for read in self._reads)
            for cu, stamp, host in self._fresh:
                keep(cu, stamp, host)
            self._fresh = []
        return self._values


# A cu_seqlens tensor's values read before, by the tensor: id -> (a weak reference to it, its
# stamp (PyTorch's version counter, which every in-place write through PyTorch moves, and its
# address) when the copy was queued, the host copy). A model's layers take one batch's
# cu_seqlens tensor in turn, a benchmark's repetitions too: with the tensor unchanged, a
# packed call queues its kernels with no wait for the GPU to drain first (the wait and the
# host work after it left the GPU idle: ~0.1-0.3 ms per packed forward on the H200's host).
# Writes PyTorch does not see (a custom kernel's, through ``.data``) leave the stamp as it was:
# give such a tensor to diyfa afresh (a new tensor, or REMEMBER_LENGTHS False, env
# DIYFA_REMEMBER_LENGTHS=0). Inference-mode tensors keep no version counter: read every call.
REMEMBER_LENGTHS = os.environ.get("DIYFA_REMEMBER_LENGTHS", "1") != "0"
_REMEMBERED: dict = {}
_REMEMBERED_KEPT = 32


def version_stamp(t: torch.Tensor) -> tuple | None:
    """What must not have moved for values derived from ``t`` to hold: (PyTorch's version
    counter, address); None where nothing is remembered (REMEMBER_LENGTHS off, inference
    tensors)."""
    if not REMEMBER_LENGTHS or t.is_inference():
        return None
    return (t._version, t.data_ptr())


def recall(t: torch.Tensor, stamp: tuple | None, tag=None):
    """The value kept for ``t`` (and ``tag``) at this ``stamp`` (:func:`keep`), or None."""
    entry = None if stamp is None else _REMEMBERED.get((id(t), tag))
    if entry is None or entry[0]() is not t or entry[1] != stamp:
        return None
    return entry[2]


def keep(t: torch.Tensor, stamp: tuple | None, value, tag=None) -> None:
    """Remember ``value``, derived from ``t`` as it was at ``stamp``, by the tensor (a weak
    reference: a new tensor at the same address is another one) and ``tag``; forgotten when
    ``t`` is freed (a padding mask's unpadding holds device tensors)."""
    if stamp is None:
        return
    if len(_REMEMBERED) >= _REMEMBERED_KEPT:
        _REMEMBERED.clear()
    key = (id(t), tag)

    def forget(ref, key=key):
        entry = _REMEMBERED.get(key)
        if entry is not None and entry[0] is ref:
            del _REMEMBERED[key]

    _REMEMBERED[key] = (weakref.ref(t, forget), stamp, value)


# Lengths checked before: (their bytes, packed rows, max_seqlen) -> the values tuple. A
# model's layers, a benchmark's repetitions, repeat one batch's lengths: their check (and
# the list they are read into) ran on every call, after the wait, with the GPU idle (19-47
# us per packed forward on the H200's host, 2026-11-25). Only lengths that passed are kept.
_CHECKED_LENGTHS: dict = {}
_CHECKED_LENGTHS_KEPT = 64


def _checked_values(name: str, cu: torch.Tensor, total: int, max_seqlen: int,
                    max_name: str) -> tuple:
    """:func:`_check_cu_values` of a (host) cumulative-lengths tensor, once per contents."""
    key = (cu.numpy().tobytes(), total, max_seqlen)
    values = _CHECKED_LENGTHS.get(key)
    if values is None:
        values = _check_cu_values(name, cu.tolist(), total, max_seqlen, max_name)
        if len(_CHECKED_LENGTHS) >= _CHECKED_LENGTHS_KEPT:
            _CHECKED_LENGTHS.clear()
        _CHECKED_LENGTHS[key] = values
    return values


def host_lengths(cu_host) -> tuple[tuple, tuple] | None:
    """A ``Problem.cu_host`` value's cumulative lengths, checked (:class:`HostLengths`: waited
    for and checked once; a tuple pair as given; None as given)."""
    return cu_host.values() if isinstance(cu_host, HostLengths) else cu_host


def packed_lengths(problem) -> tuple[tuple, tuple] | None:
    """A packed problem's cumulative lengths on the host, checked (:func:`host_lengths`);
    None when unknown (tracing) or not packed."""
    return host_lengths(problem.cu_host)


def check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                        causal, softmax_scale, deterministic=False, window_size=(-1, -1),
                        softcap=0.0, fake=False, alibi_slopes=None, sinks=None, dropout_p=0.0,
                        dropout_seed=0) -> Problem:
    """Check packed (total, heads, head_dim) q, k, v and their cumulative lengths; return the
    call's :class:`Problem` (``cu_seqlens_*`` set; seqlen_q / seqlen_k the longest
    sequences; causal is bottom-right per sequence). The tensor checks are check_inputs's
    (on a batch-of-one view); the lengths' values are copied to the host without waiting
    and checked against the tensors when a family first reads them, before any kernel runs
    (:class:`HostLengths`)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (total_tokens, heads, head_dim) for the "
                             f"varlen layout, got shape {tuple(t.shape)}")  # fmt: skip
    if isinstance(q, torch.Tensor) and q.dtype == torch.float8_e4m3fn:
        raise TypeError("flash_attention_varlen takes float16, bfloat16 or float32 q, k, v, "
                        "got float8_e4m3fn (fp8 runs through flash_attention, with descales)")
    one = check_inputs(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), causal=causal,
                       softmax_scale=softmax_scale, layout="bshd", align="bottom_right",
                       deterministic=deterministic, window_size=window_size,
                       softcap=softcap, fake=fake, dropout_p=dropout_p,
                       dropout_seed=dropout_seed)  # fmt: skip
    batch = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q,
                              "max_seqlen_q", q.device)  # fmt: skip
    batch_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k,
                                "max_seqlen_k", q.device)  # fmt: skip
    if batch != batch_k:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of "
                         f"sequences, got {batch} and {batch_k}")  # fmt: skip
    check_bias_tensors(alibi_slopes, sinks, batch, q.shape[1], q.device)

    def packed(t):  # (total, heads, dim): sequences are row ranges, the batch stride unused
        return (0, t.stride(1), t.stride(0), t.stride(2))

    return dataclasses.replace(
        one, batch=batch, seqlen_q=max_seqlen_q, seqlen_k=max_seqlen_k, q_strides=packed(q),
        k_strides=packed(k), v_strides=packed(v), cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, total_q=q.shape[0], alibi_slopes=alibi_slopes,
        sinks=sinks, cu_host=None if fake else HostLengths([
            ("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q"),
            ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k")]))


def _show(value) -> str:
    """A value for an error message: a tensor by its kind and shape, not its contents."""
    if isinstance(value, torch.Tensor):
        return f"<Tensor {value.dtype} {tuple(value.shape)}>"
    return repr(value)


def _check_int32_tensor(name: str, t, dims: int, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name}.dtype is {t.dtype}; accepted: int32")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on the tensors' device {device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (the kernel reads it row by row), got "
                         f"strides {t.stride()}")  # fmt: skip


MAX_SPLITS = 128  # split-KV ranges per sequence: more never pays, and the combine holds them


def check_fp8_cache(q, k_cache, v_cache, k_descale, v_descale) -> bool:
    """Whether the cache is fp8 (e4m3, with per-kv-head descales: a cached value times its
    descale is the real one), after checking that the two agree: fp16/bf16 queries, both
    caches e4m3, fp32 descales of shape (kv_heads,) or (batch, kv_heads), contiguous, on
    q's device; and that a cache in q's dtype gets no descales."""
    e4m3 = torch.float8_e4m3fn
    fp8 = getattr(k_cache, "dtype", None) == e4m3 or getattr(v_cache, "dtype", None) == e4m3
    if not fp8:
        if k_descale is not None or v_descale is not None:
            raise ValueError("k_descale/v_descale apply to an fp8 (float8_e4m3fn) cache; this "
                             f"cache is {getattr(k_cache, 'dtype', None)}")  # fmt: skip
        return False
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache and v_cache must both be float8_e4m3fn, got {k_cache.dtype} "
                        f"and {v_cache.dtype}")  # fmt: skip
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"an fp8 cache takes float16 or bfloat16 queries, got {q.dtype}")
    b, hk = q.shape[0], k_cache.shape[2]
    for name, t in (("k_descale", k_descale), ("v_descale", v_descale)):
        if t is None:
            raise ValueError(f"an fp8 cache needs {name} (fp32, (kv_heads={hk},) or "
                             f"(batch={b}, kv_heads={hk})): cached value x descale = value")
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise TypeError(f"{name} must be a float32 tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")  # fmt: skip
        if tuple(t.shape) not in ((hk,), (b, hk)):
            raise ValueError(f"{name} must have shape ({hk},) or ({b}, {hk}), got "
                             f"{tuple(t.shape)}")  # fmt: skip
        if t.device != q.device or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous on {q.device}")
    if values_in_keys(k_cache, v_cache) and k_descale.data_ptr() != v_descale.data_ptr():
        raise ValueError("v_cache is k_cache's leading columns (one latent cache), so its "
                         "values have the keys' descale: pass the same tensor as k_descale "
                         "and v_descale")  # fmt: skip
    if k_descale.shape != v_descale.shape:
        raise ValueError(f"k_descale {tuple(k_descale.shape)} and v_descale "
                         f"{tuple(v_descale.shape)} must have one shape (both per kv head, or "
                         "both per sequence and kv head)")  # fmt: skip
    if q.is_cuda and torch.cuda.get_device_capability(q.device) < (8, 9):
        raise ValueError("an fp8 cache needs a GPU with fp8 (compute capability >= 8.9)")
    return True


def values_in_keys(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether ``v_cache`` is ``k_cache``'s leading columns (a view ``k_cache[..., :dv]``:
    MLA's one latent cache, whose first 512 columns are the values): same storage, same
    start, same strides."""
    if not (isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)
            and k_cache.dim() == v_cache.dim() == 4):  # fmt: skip
        return False  # (the checks will say what is wrong)
    if isinstance(k_cache, FakeTensor) or isinstance(v_cache, FakeTensor):
        return False  # fake tensors (a trace) have no addresses: the real call checks
    try:
        same = v_cache.data_ptr() == k_cache.data_ptr()
    except RuntimeError:  # (other tensors without storage)
        return False
    # (strides of the axes of size 1 say nothing: MLA's one kv head, one new token)
    return (same and v_cache.shape[3] <= k_cache.shape[3] and v_cache.stride(3) == k_cache.stride(3)
            and all(n == 1 or sv == sk for n, sv, sk in
                    zip(k_cache.shape[:3], v_cache.stride()[:3], k_cache.stride()[:3],
                        strict=True)))  # fmt: skip


MAX_APPEND_BATCH = 65535  # CUDA's limit on a grid's second axis (decode._append's sequences)


def check_kvcache_inputs(q, k_cache, v_cache, k, v, *, cache_seqlens, block_table, causal,
                         softmax_scale, num_splits, fp8: bool = False,
                         max_seqlen_k: int | None = None) -> float:
    """Check a KV-cache call on the host (shapes, dtypes, devices, options, the bound
    ``max_seqlen_k``: in [new tokens, the cache's rows per sequence]); returns the resolved
    softmax scale. The values of ``cache_seqlens`` and ``block_table`` are checked on the
    device afterwards by :func:`check_kvcache_lengths`, once every host check has passed.
    ``fp8``: the caches are float8_e4m3fn (checked by :func:`check_fp8_cache`); k and v,
    the new tokens, are in q's dtype and quantised on the append."""
    names = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache))
    if (k is None) != (v is None):
        given, missing = ("k", "v") if v is None else ("v", "k")
        raise ValueError(f"k and v must be given together (new keys and values to append) or "
                         f"both left None, got {given}={_show(k if v is None else v)} and "
                         f"{missing}=None")  # fmt: skip
    if k is not None:
        names += (("k", k), ("v", v))
    for name, t in names:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
        if fp8 and name in ("k_cache", "v_cache"):
            pass  # float8_e4m3fn, checked by check_fp8_cache
        elif t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}.dtype is {t.dtype}; accepted: float16, bfloat16, float32 "
                            "(and float8_e4m3fn for the caches, with k_descale/v_descale)")
        elif t.dtype != q.dtype:
            raise TypeError(f"{name}.dtype is {t.dtype}, q's is {q.dtype}: they must match")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: one device")
    require_kernel_device(q, "q, k_cache, v_cache")
    grads = [name for name, t in names if t.requires_grad]
    if torch.is_grad_enabled() and grads:
        raise ValueError(f"{', '.join(grads)} requires_grad=True, but "
                         "flash_attention_with_kvcache has no backward: call it under "
                         "torch.no_grad() (or detach the inputs)")  # fmt: skip
    b, sq, h, d = q.shape
    if k is not None and b > MAX_APPEND_BATCH:
        raise ValueError(f"k and v are appended to at most {MAX_APPEND_BATCH} sequences a call "
                         f"(the append's grid holds the sequences on its second axis), got a "
                         f"batch of {b}: append in chunks of sequences")  # fmt: skip
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                         "must agree but for the head dim")  # fmt: skip
    _, rows, hk, dk = k_cache.shape
    dv = v_cache.shape[3]
    if dk != d or not 1 <= d <= MAX_CACHE_HEAD_DIM:
        raise ValueError(f"q and k_cache must share a head_dim in 1..{MAX_CACHE_HEAD_DIM}, got "
                         f"q {d}, k_cache {dk}")  # fmt: skip
    if not 1 <= dv <= MAX_CACHE_HEAD_DIM_V:
        raise ValueError(f"v_cache's head_dim must be in 1..{MAX_CACHE_HEAD_DIM_V}, got {dv}")
    if hk == 0 or h % hk:
        raise ValueError(f"q heads ({h}) must be a multiple of the cache's kv heads ({hk})")
    s_new = 0
    if k is not None:
        if (k.shape[0] != b or k.shape[2:] != (hk, d) or v.shape[:3] != k.shape[:3]
                or v.shape[3] != dv):  # fmt: skip
            raise ValueError(f"k and v must be (batch={b}, new tokens, kv_heads={hk}, "
                             f"head_dim={d} / {dv}), got k {tuple(k.shape)}, "
                             f"v {tuple(v.shape)}")  # fmt: skip
        s_new = k.shape[1]
        if values_in_keys(k_cache, v_cache) and not values_in_keys(k, v):
            raise ValueError("v_cache is k_cache's leading columns (k_cache[..., :dv], one "
                             "latent cache as MLA keeps it), so the new values must be the "
                             "new keys' leading columns too: pass v=k[..., :dv]")  # fmt: skip
    _check_int32_tensor("cache_seqlens", cache_seqlens, 1, q.device)
    if cache_seqlens.shape[0] != b:
        raise ValueError(f"cache_seqlens must have one entry per sequence ({b}), got "
                         f"{cache_seqlens.shape[0]}")  # fmt: skip
    if block_table is None:
        if k_cache.shape[0] != b:
            raise ValueError(f"a contiguous cache must be (batch={b}, max_len, kv_heads, "
                             f"head_dim), got {tuple(k_cache.shape)}")  # fmt: skip
        capacity = rows
    else:
        _check_int32_tensor("block_table", block_table, 2, q.device)
        if block_table.shape[0] != b:
            raise ValueError(f"block_table must be (batch={b}, max_blocks), got "
                             f"{tuple(block_table.shape)}")  # fmt: skip
        if rows < 1:
            raise ValueError(f"a paged cache needs pages of >= 1 token, got page_size {rows}")
        capacity = rows * block_table.shape[1]  # rows = page_size
    if max_seqlen_k is not None:
        if isinstance(max_seqlen_k, bool) or not isinstance(max_seqlen_k, int):
            raise TypeError(f"max_seqlen_k must be an int or None, got {max_seqlen_k!r}")
        if not s_new <= max_seqlen_k <= capacity:
            raise ValueError(f"max_seqlen_k must be in [{s_new} (the new tokens), {capacity} "
                             f"(the cache's rows per sequence)], got {max_seqlen_k}")  # fmt: skip
    check_flag("causal", causal)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise TypeError(f"num_splits must be an int >= 0 (0: chosen), got {num_splits!r}")
    if num_splits > MAX_SPLITS:
        raise ValueError(f"num_splits must be at most {MAX_SPLITS}, got {num_splits}")
    return _resolved_scale(softmax_scale, d)


def check_kvcache_lengths(q, k_cache, cache_seqlens, block_table, s_new: int,
                          max_seqlen_k: int | None, launched: list | None = None,
                          counters: int = 0) -> tuple[int, torch.Tensor]:
    """The device half of a KV-cache call's checks, after every host check
    (:func:`check_kvcache_inputs`) and before anything is written: each sequence's length
    after the append of ``s_new`` tokens against the cache, and the pages it uses against
    the pool, by one small kernel (``decode.cache_status``). Returns the longest length, or
    its bound, and the kernel's status tensor (with ``counters`` zeros per sequence after the
    batch's entries: the split kernel's counters). Without ``max_seqlen_k`` the verdicts are
    read back (one synchronisation) and a fault is a ValueError. With it, or during a CUDA-graph
    capture (where the bound is the cache's capacity), nothing is read back: a fault stops the
    stream ahead of the append and the kernels (the kernel's device-side assert on a GPU, a
    RuntimeError on the CPU). ``launched``: a list that gets the kernel's launch, for a Replay."""
    from diyfa.attention.decode import cache_status

    rows = k_cache.shape[1]
    capacity = rows if block_table is None else rows * block_table.shape[1]
    if max_seqlen_k is None and q.is_cuda and torch.cuda.is_current_stream_capturing():
        max_seqlen_k = capacity  # nothing can be read back during a capture
    limit = capacity if max_seqlen_k is None else max_seqlen_k
    status = cache_status(cache_seqlens, block_table, s_new, limit, k_cache.shape[0], rows,
                          asserted=max_seqlen_k is not None, launched=launched,
                          counters=counters)  # fmt: skip
    if max_seqlen_k is not None:
        return max_seqlen_k, status
    codes = status[:cache_seqlens.shape[0]].tolist()
    for i, n in enumerate(codes):
        if n == -1:
            raise ValueError(f"cache_seqlens[{i}] = {int(cache_seqlens[i])} plus {s_new} new "
                             f"tokens does not fit the cache ({capacity} rows per sequence)")
        if n == -2:
            pool = k_cache.shape[0]
            pages = block_table[i][:(int(cache_seqlens[i]) + s_new + rows - 1) // rows]
            outside = pages[(pages < 0) | (pages >= pool)]
            raise ValueError(f"block_table[{i}] points outside the pool of {pool} pages: "
                             f"{outside[:4].tolist()}")  # fmt: skip
    return max(codes, default=0), status
