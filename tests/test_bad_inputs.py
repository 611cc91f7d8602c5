"""The bad-input catalogue: one table of refused calls to every public function.

Each row: the call (on fresh, valid inputs with one thing wrong), the exception type and a
regex that the message must match: it names the argument and shows the value given.
ValueError for a wrong value (shapes, devices, ranges, names), TypeError for a wrong kind
of value (not a tensor, a dtype, a flag that is not a bool), NotImplementedError for what
diyfa.flash_attn_interface refuses as not implemented. Every call's KV caches (and every
other input) must be bitwise unchanged afterwards: nothing is written on an error.

Rows that already exist verbatim elsewhere are not repeated here: test_attention.py
(test_bad_input_is_a_clear_error), test_variants.py (test_bad_values), test_varlen.py,
test_kvcache.py, test_matmul.py (test_bad_input, TMA and ws refusals) and
test_flash_attn_interface.py (every NotImplementedError option) hold theirs. docs/errors.md
describes the contract.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import diyfa
from diyfa import flash_attn_interface as fai
from diyfa.ops.matmul import triton_matmul

from .conftest import DEVICE, HAS_CUDA

F16, F32, I32 = torch.float16, torch.float32, torch.int32
DEV = r"(cpu|cuda:\d+)"  # this machine's device as messages print it


def _t(*shape, dtype=F16, device=DEVICE):
    return torch.randn(*shape).to(device=device, dtype=dtype)


def _i32(values, device=DEVICE):
    return torch.tensor(values, dtype=I32, device=device)


def _env():
    """Fresh valid inputs for every function (each row spoils one thing)."""
    torch.manual_seed(0)
    e = SimpleNamespace()
    # flash_attention / SDPA: (batch 1, heads 2, seqlen 8, d 16), bhsd
    e.q, e.k, e.v = _t(1, 2, 8, 16), _t(1, 2, 8, 16), _t(1, 2, 8, 16)
    # flash_attention_varlen: 8 packed rows in sequences of 3 and 5
    e.qp, e.kp, e.vp = _t(8, 2, 16), _t(8, 2, 16), _t(8, 2, 16)
    e.cu = _i32([0, 3, 8])
    # flash_attention_with_kvcache: 2 sequences, 1 new token each, appended at rows 3 and 4
    e.q1 = _t(2, 1, 2, 16)
    e.kc, e.vc = _t(2, 10, 2, 16), _t(2, 10, 2, 16)  # contiguous, 10 rows per sequence
    e.kn, e.vn = _t(2, 1, 2, 16), _t(2, 1, 2, 16)
    e.lens = _i32([3, 4])
    e.kpg, e.vpg = _t(6, 4, 2, 16), _t(6, 4, 2, 16)  # 6 pages of 4 rows
    e.table = _i32([[0, 1], [2, 3]])
    # flash-attn's bshd tensors
    e.qs, e.ks, e.vs = _t(1, 8, 2, 16), _t(1, 8, 2, 16), _t(1, 8, 2, 16)
    # matmul
    e.a, e.b = _t(4, 5), _t(5, 6)
    return e


def _kv(e, **over):
    """flash_attention_with_kvcache on the contiguous cache with an append, ``over`` applied."""
    args = dict(q=e.q1, k_cache=e.kc, v_cache=e.vc, k=e.kn, v=e.vn, cache_seqlens=e.lens)
    args.update(over)
    return diyfa.flash_attention_with_kvcache(**args)


def _paged(e, **over):
    args = dict(q=e.q1, k_cache=e.kpg, v_cache=e.vpg, k=e.kn, v=e.vn, cache_seqlens=e.lens,
                block_table=e.table)  # fmt: skip
    args.update(over)
    return diyfa.flash_attention_with_kvcache(**args)


def _varlen(e, **over):
    args = dict(q=e.qp, k=e.kp, v=e.vp, cu_seqlens_q=e.cu, cu_seqlens_k=e.cu, max_seqlen_q=5,
                max_seqlen_k=5)  # fmt: skip
    args.update(over)
    return diyfa.flash_attention_varlen(**args)


def _fa(e, **over):
    args = dict(q=e.q, k=e.k, v=e.v)
    args.update(over)
    return diyfa.flash_attention(**args)


def _sdpa(e, **over):
    args = dict(query=e.q, key=e.k, value=e.v)
    args.update(over)
    return diyfa.scaled_dot_product_attention(**args)


def _mm(e, **over):
    args = dict(a=e.a, b=e.b)
    args.update(over)
    return triton_matmul(**args)


def _fai_kv(e, **over):
    args = dict(q=e.q1, k_cache=e.kc, v_cache=e.vc, k=e.kn, v=e.vn, cache_seqlens=3)
    args.update(over)
    return fai.flash_attn_with_kvcache(**args)


def _meta(t):
    return t.to("meta")


V, T, N = ValueError, TypeError, NotImplementedError
CPU_ONLY = "on a GPU this call may be valid"

# (id, call, exception, regex naming the argument and the value given[, skip on CUDA])
ROWS = [
    # ---- flash_attention ------------------------------------------------------------------
    ("fa/q-int32", lambda e: _fa(e, q=e.q.int()), T,
     r"q\.dtype is torch\.int32; accepted: float16, bfloat16, float32"),
    ("fa/k-bf16", lambda e: _fa(e, k=e.k.bfloat16()), T,
     r"q, k, v must share a dtype, got q=torch\.float16, k=torch\.bfloat16, v=torch\.float16"),
    ("fa/k-device", lambda e: _fa(e, k=_meta(e.k)), V,
     rf"q, k, v must be on one device, got q={DEV}, k=meta, v={DEV}"),
    ("fa/all-meta", lambda e: _fa(e, q=_meta(e.q), k=_meta(e.k), v=_meta(e.v)), V,
     r"q, k, v are on device meta; accepted: cuda"),
    ("fa/head-dim-0", lambda e: _fa(e, q=e.q[..., :0], k=e.k[..., :0], v=e.v[..., :0]), V,
     r"head_dim must be in 1\.\.256, got 0"),
    ("fa/head-dim-257", lambda e: _fa(e, q=_t(1, 2, 8, 257), k=_t(1, 2, 8, 257),
                                      v=_t(1, 2, 8, 257)), V,
     r"head_dim must be in 1\.\.256, got 257"),
    ("fa/kv-heads-0", lambda e: _fa(e, k=e.k[:, :0], v=e.v[:, :0]), V,
     r"q heads \(2\) must be a multiple of k/v heads \(0\)"),
    ("fa/v-dim", lambda e: _fa(e, v=_t(1, 2, 8, 300)), V,
     r"v's head_dim must be in 1\.\.256, got 300"),
    ("fa/bshd-3d", lambda e: _fa(e, q=e.q[0], layout="bshd"), V,
     r"q must be 4-D \(batch, seqlen, heads, head_dim for layout='bshd'\), got shape "
     r"\(2, 8, 16\)"),
    ("fa/layout-none", lambda e: _fa(e, layout=None), V,
     r"layout must be one of \('bhsd', 'bshd'\), got None"),
    ("fa/layout-case", lambda e: _fa(e, layout="BHSD"), V, r"layout must be one of .* got 'BHSD'"),
    ("fa/backend-name", lambda e: _fa(e, backend="cuda"), V,
     r"unknown attention backend 'cuda'; accepted: 'auto', 'hopper', 'portable'"),
    ("fa/backend-none", lambda e: _fa(e, backend=None), V, r"unknown attention backend None"),
    ("fa/backend-hopper", lambda e: _fa(e, backend="hopper"), V,
     r"attention backend 'hopper' cannot run this problem: it needs a Hopper GPU", CPU_ONLY),
    ("fa/causal-none", lambda e: _fa(e, causal=None), T, r"causal must be a bool, got None"),
    ("fa/deterministic-str", lambda e: _fa(e, deterministic="yes"), T,
     r"deterministic must be a bool, got 'yes'"),
    ("fa/return-lse-int", lambda e: _fa(e, return_lse=1), T, r"return_lse must be a bool, got 1"),
    ("fa/window-none", lambda e: _fa(e, window_size=None), T,
     r"window_size must be a \(left, right\) pair of ints, got None"),
    ("fa/window-int", lambda e: _fa(e, window_size=4), T,
     r"window_size must be a \(left, right\) pair of ints, got 4"),
    ("fa/window-right", lambda e: _fa(e, window_size=(0, -5)), V,
     r"window_size sides must be >= 0 or -1 \(unbounded\), got \(0, -5\)"),
    ("fa/softcap-str", lambda e: _fa(e, softcap="1"), T, r"softcap must be a number, got '1'"),
    ("fa/softcap-scale-ratio", lambda e: _fa(e, softcap=2.0**-100, softmax_scale=2.0**100), V,
     r"softmax_scale / softcap must be at most 2\^126 \(the kernels take it in fp32\), got "),
    ("fa/softcap-tiny", lambda e: _fa(e, softcap=1e-300), V,
     r"softcap must be 0 \(off\) or between 2\^-126 and 2\^126 \(the kernels take 1 / softcap "
     r"in fp32\), got 1e-300"),
    ("fa/scale-inf", lambda e: _fa(e, softmax_scale=float("inf")), V,
     r"softmax_scale must be finite and >= 0, got inf"),
    ("fa/scale-huge", lambda e: _fa(e, softmax_scale=1e300), V,
     r"softmax_scale must be at most 2\^126 \(8\.51e\+37: the kernels scale in fp32\), "
     r"got 1e\+300"),
    # ---- flash_attention_varlen -----------------------------------------------------------
    ("varlen/q-list", lambda e: _varlen(e, q=e.qp.tolist()), T,
     r"q must be a torch\.Tensor, got list"),
    ("varlen/k-2d", lambda e: _varlen(e, k=e.kp[:, 0]), V,
     r"k must be 3-D \(total_tokens, heads, head_dim\) for the varlen layout, got shape "
     r"\(8, 16\)"),
    ("varlen/q-float64", lambda e: _varlen(e, q=e.qp.double()), T,
     r"q\.dtype is torch\.float64; accepted"),
    ("varlen/v-fp32", lambda e: _varlen(e, v=e.vp.float()), T,
     r"q, k, v must share a dtype, got q=torch\.float16, k=torch\.float16, v=torch\.float32"),
    ("varlen/k-device", lambda e: _varlen(e, k=_meta(e.kp)), V,
     rf"q, k, v must be on one device, got q={DEV}, k=meta"),
    ("varlen/v-rows", lambda e: _varlen(e, v=e.vp[:7]), V,
     r"k and v must have the same heads and seqlen, got k \(heads=2, seqlen=8\) and v "
     r"\(heads=2, seqlen=7\)"),
    ("varlen/head-dim-0", lambda e: _varlen(e, q=e.qp[..., :0], k=e.kp[..., :0],
                                            v=e.vp[..., :0]), V,
     r"head_dim must be in 1\.\.256, got 0"),
    ("varlen/cu-k-float", lambda e: _varlen(e, cu_seqlens_k=e.cu.float()), T,
     r"cu_seqlens_k\.dtype is torch\.float32; accepted: int32"),
    ("varlen/cu-q-empty", lambda e: _varlen(e, cu_seqlens_q=e.cu[:0]), V,
     r"cu_seqlens_q must be 1-D with batch \+ 1 >= 1 entries, got shape \(0,\)"),
    ("varlen/cu-q-device", lambda e: _varlen(e, cu_seqlens_q=_meta(e.cu)), V,
     rf"cu_seqlens_q must be on the tensors' device {DEV}, got meta"),
    ("varlen/cu-k-past-rows", lambda e: _varlen(e, cu_seqlens_k=_i32([0, 3, 9])), V,
     r"cu_seqlens_k must start at 0 and end at the packed rows \(8\), got 0 \.\. 9"),
    ("varlen/cu-q-start", lambda e: _varlen(e, cu_seqlens_q=_i32([1, 3, 8])), V,
     r"cu_seqlens_q must start at 0 and end at the packed rows \(8\), got 1 \.\. 8"),
    ("varlen/max-q-str", lambda e: _varlen(e, max_seqlen_q="5"), T,
     r"max_seqlen_q must be an int >= 0, got '5'"),
    ("varlen/max-q-bool", lambda e: _varlen(e, max_seqlen_q=True), T,
     r"max_seqlen_q must be an int >= 0, got True"),
    ("varlen/max-k-short", lambda e: _varlen(e, max_seqlen_k=4), V,
     r"max_seqlen_k=4 is less than the longest sequence in cu_seqlens_k \(5\)"),
    ("varlen/causal-none", lambda e: _varlen(e, causal=None), T,
     r"causal must be a bool, got None"),
    ("varlen/deterministic-int", lambda e: _varlen(e, deterministic=0), T,
     r"deterministic must be a bool, got 0"),
    ("varlen/return-lse-int", lambda e: _varlen(e, return_lse=2), T,
     r"return_lse must be a bool, got 2"),
    ("varlen/window-left", lambda e: _varlen(e, window_size=(-3, 0)), V,
     r"window_size sides must be >= 0 or -1 \(unbounded\), got \(-3, 0\)"),
    ("varlen/softcap-nan", lambda e: _varlen(e, softcap=float("nan")), V,
     r"softcap must be a finite number >= 0 \(0 turns it off\), got nan"),
    ("varlen/backend-hopper", lambda e: _varlen(e, backend="hopper", window_size=(4, 0)), V,
     r"attention backend 'hopper' cannot run this problem: it takes packed \(varlen\) "
     r"sequences without window, softcap, ALiBi or sinks"),
    ("varlen/backend-name", lambda e: _varlen(e, backend="triton"), V,
     r"unknown attention backend 'triton'"),
    # ---- flash_attention_with_kvcache (the caches must stay untouched: see the test) -------
    ("kvcache/q-3d", lambda e: _kv(e, q=e.q1[0]), V, r"q must be 4-D, got shape \(1, 2, 16\)"),
    ("kvcache/q-float64", lambda e: _kv(e, q=e.q1.double()), T,
     r"q\.dtype is torch\.float64; accepted: float16, bfloat16, float32"),
    ("kvcache/k-fp32", lambda e: _kv(e, k=e.kn.float(), v=e.vn.float()), T,
     r"k\.dtype is torch\.float32, q's is torch\.float16: they must match"),
    ("kvcache/k-cache-device", lambda e: _kv(e, k_cache=_meta(e.kc)), V,
     rf"k_cache is on meta, q on {DEV}: one device"),
    ("kvcache/v-only", lambda e: _kv(e, k=None), V,
     r"k and v must be given together .* got v=<Tensor torch\.float16 \(2, 1, 2, 16\)> and "
     r"k=None"),
    ("kvcache/v-cache-rows", lambda e: _kv(e, v_cache=e.vc[:, :9]), V,
     r"k_cache \(2, 10, 2, 16\) and v_cache \(2, 9, 2, 16\) must agree but for the head dim"),
    ("kvcache/head-dim-0", lambda e: _kv(e, q=e.q1[..., :0], k_cache=e.kc[..., :0],
                                         v_cache=e.vc[..., :0], k=None, v=None), V,
     r"q and k_cache must share a head_dim in 1\.\.576, got q 0, k_cache 0"),
    ("kvcache/head-dim-mismatch", lambda e: _kv(e, q=_t(2, 1, 2, 32)), V,
     r"q and k_cache must share a head_dim in 1\.\.576, got q 32, k_cache 16"),
    ("kvcache/v-head-dim", lambda e: _kv(e, v_cache=_t(2, 10, 2, 600), k=None, v=None), V,
     r"v_cache's head_dim must be in 1\.\.512, got 600"),
    ("kvcache/v-new-head-dim", lambda e: _kv(e, v=_t(2, 1, 2, 8)), V,
     r"k and v must be \(batch=2, new tokens, kv_heads=2, head_dim=16 / 16\), got k "
     r"\(2, 1, 2, 16\), v \(2, 1, 2, 8\)"),
    ("kvcache/kv-heads-0", lambda e: _kv(e, k_cache=e.kc[:, :, :0], v_cache=e.vc[:, :, :0],
                                         k=None, v=None), V,
     r"q heads \(2\) must be a multiple of the cache's kv heads \(0\)"),
    ("kvcache/k-batch", lambda e: _kv(e, k=e.kn[:1], v=e.vn[:1]), V,
     r"k and v must be \(batch=2, new tokens, kv_heads=2, head_dim=16 / 16\), got k "
     r"\(1, 1, 2, 16\), v \(1, 1, 2, 16\)"),
    ("kvcache/k-cache-grad", lambda e: _kv(e, k_cache=e.kc.clone().requires_grad_()), V,
     r"k_cache requires_grad=True, but flash_attention_with_kvcache has no backward"),
    ("kvcache/seqlens-none", lambda e: _kv(e, cache_seqlens=None), T,
     r"cache_seqlens must be a torch\.Tensor, got NoneType"),
    ("kvcache/seqlens-float", lambda e: _kv(e, cache_seqlens=e.lens.float()), T,
     r"cache_seqlens\.dtype is torch\.float32; accepted: int32"),
    ("kvcache/seqlens-count", lambda e: _kv(e, cache_seqlens=e.lens[:1]), V,
     r"cache_seqlens must have one entry per sequence \(2\), got 1"),
    ("kvcache/seqlens-device", lambda e: _kv(e, cache_seqlens=_meta(e.lens)), V,
     rf"cache_seqlens must be on the tensors' device {DEV}, got meta"),
    ("kvcache/seqlens-past-cache", lambda e: _kv(e, cache_seqlens=_i32([3, 10])), V,
     r"cache_seqlens\[1\] = 10 plus 1 new tokens does not fit the cache \(10 rows per "
     r"sequence\)"),
    ("kvcache/append-past-cache", lambda e: _kv(e, cache_seqlens=_i32([9, 4]),
                                                k=_t(2, 2, 2, 16), v=_t(2, 2, 2, 16)), V,
     r"cache_seqlens\[0\] = 9 plus 2 new tokens does not fit the cache \(10 rows"),
    ("kvcache/paged-past-pages", lambda e: _paged(e, cache_seqlens=_i32([3, 8])), V,
     r"cache_seqlens\[1\] = 8 plus 1 new tokens does not fit the cache \(8 rows per "
     r"sequence\)"),
    ("kvcache/table-negative", lambda e: _paged(e, block_table=_i32([[0, 1], [2, -1]]),
                                                cache_seqlens=_i32([3, 5])), V,
     r"block_table\[1\] points outside the pool of 6 pages: \[-1\]"),
    ("kvcache/table-pool-size", lambda e: _paged(e, block_table=_i32([[6, 1], [2, 3]])), V,
     r"block_table\[0\] points outside the pool of 6 pages: \[6\]"),
    ("kvcache/table-append-page", lambda e: _paged(e, block_table=_i32([[0, 7], [2, 3]]),
                                                   cache_seqlens=_i32([4, 4])), V,
     r"block_table\[0\] points outside the pool of 6 pages: \[7\]"),  # the append's page
    ("kvcache/table-1d", lambda e: _paged(e, block_table=e.table[0]), V,
     r"block_table must be 2-D, got shape \(2,\)"),
    ("kvcache/table-batch", lambda e: _paged(e, block_table=e.table[:1]), V,
     r"block_table must be \(batch=2, max_blocks\), got \(1, 2\)"),
    ("kvcache/table-device", lambda e: _paged(e, block_table=_meta(e.table)), V,
     rf"block_table must be on the tensors' device {DEV}, got meta"),
    ("kvcache/causal-int", lambda e: _kv(e, causal=1), T, r"causal must be a bool, got 1"),
    ("kvcache/return-lse-str", lambda e: _kv(e, return_lse="no"), T,
     r"return_lse must be a bool, got 'no'"),
    ("kvcache/splits-float", lambda e: _kv(e, num_splits=1.0), T,
     r"num_splits must be an int >= 0 \(0: chosen\), got 1\.0"),
    ("kvcache/scale-negative", lambda e: _kv(e, softmax_scale=-1.0), V,
     r"softmax_scale must be finite and >= 0, got -1\.0"),
    # ---- scaled_dot_product_attention (q, k, v in messages: query, key, value) -------------
    ("sdpa/batch", lambda e: _sdpa(e, key=_t(2, 2, 8, 16), value=_t(2, 2, 8, 16)), V,
     r"batch sizes differ: q has 1, k has 2, v has 2"),
    ("sdpa/key-fp32", lambda e: _sdpa(e, key=e.k.float()), T,
     r"q, k, v must share a dtype, got q=torch\.float16, k=torch\.float32"),
    ("sdpa/key-device", lambda e: _sdpa(e, key=_meta(e.k)), V,
     rf"q, k, v must be on one device, got q={DEV}, k=meta"),
    ("sdpa/value-seqlen", lambda e: _sdpa(e, value=_t(1, 2, 9, 16)), V,
     r"k and v must have the same heads and seqlen, got k \(heads=2, seqlen=8\) and v "
     r"\(heads=2, seqlen=9\)"),
    ("sdpa/gqa-heads", lambda e: _sdpa(e, key=_t(1, 3, 8, 16), value=_t(1, 3, 8, 16),
                                       enable_gqa=True), V,
     r"q heads \(2\) must be a multiple of k/v heads \(3\)"),
    ("sdpa/kv-heads-0", lambda e: _sdpa(e, key=e.k[:, :0], value=e.v[:, :0], enable_gqa=True), V,
     r"q heads \(2\) must be a multiple of k/v heads \(0\)"),
    ("sdpa/head-dim-0", lambda e: _sdpa(e, query=e.q[..., :0], key=e.k[..., :0],
                                        value=e.v[..., :0]), V,
     r"head_dim must be in 1\.\.256, got 0"),
    ("sdpa/scale-str", lambda e: _sdpa(e, scale="0.5"), T,
     r"scale must be a float or None, got '0\.5'"),
    ("sdpa/scale-nan", lambda e: _sdpa(e, scale=float("nan")), V, r"scale must be finite, got nan"),
    # ---- triton_matmul --------------------------------------------------------------------
    ("matmul/a-float64", lambda e: _mm(e, a=e.a.double()), T,
     r"a\.dtype is torch\.float64; accepted: float16, bfloat16, float32, float8_e4m3fn"),
    ("matmul/fp8-fp16", lambda e: _mm(e, a=e.a.to(torch.float8_e4m3fn)), T,
     r"a and b must share a dtype \(two fp8 kinds may mix\), got a=float8_e4m3fn, b=float16"),
    ("matmul/a-0d", lambda e: _mm(e, a=e.a[0, 0]), V,
     r"a must be 2-D \(rows, cols\) or 3-D \(batch, rows, cols\), got shape \(\)"),
    ("matmul/b-device", lambda e: _mm(e, b=_meta(e.b)), V,
     rf"a and b must be on one device, got a={DEV}, b=meta"),
    ("matmul/both-meta", lambda e: _mm(e, a=_meta(e.a), b=_meta(e.b)), V,
     r"a and b are on device meta; accepted: cuda"),
    ("matmul/scale-a-float", lambda e: _mm(e, scale_a=1.0), T,
     r"scale_a must be a torch\.Tensor \(fp32\) or None, got float"),
    ("matmul/scale-a-device", lambda e: _mm(e, scale_a=torch.ones(1, device="meta")), V,
     rf"scale_a is on meta, the operands on {DEV}"),
    ("matmul/scale-b-batch", lambda e: _mm(e, a=_t(2, 4, 5), b=_t(2, 5, 6),
                                           scale_b=_t(3, 6, dtype=F32)), V,
     r"scale_b has shape \(3, 6\); accepted: one element \(per-tensor\) or per-column of b: "
     r"\(6,\) or \(1, 6\) \(or with a leading batch dim\)"),
    ("matmul/bias-list", lambda e: _mm(e, bias=[0.0] * 6), T,
     r"bias must be a torch\.Tensor or None, got list"),
    ("matmul/bias-int32", lambda e: _mm(e, bias=torch.ones(6, dtype=I32, device=DEVICE)), T,
     r"bias\.dtype is torch\.int32; accepted: float16, bfloat16, float32"),
    ("matmul/bias-device", lambda e: _mm(e, bias=_t(6, device="meta")), V,
     rf"bias is on meta, the operands on {DEV}"),
    ("matmul/out-dtype-fp8", lambda e: _mm(e, out_dtype=torch.float8_e4m3fn), T,
     r"out_dtype is torch\.float8_e4m3fn; accepted: None"),
    ("matmul/out-dtype-str", lambda e: _mm(e, out_dtype="float16"), T,
     r"out_dtype is float16; accepted: None"),
    ("matmul/activation-str-none", lambda e: _mm(e, activation="None"), V,
     r"activation must be one of \(None, 'relu', 'gelu', 'silu'\), got 'None'"),
    ("matmul/precision-none", lambda e: _mm(e, precision=None), V,
     r"precision must be one of \('tf32', 'ieee'\), got None"),
    ("matmul/kernel-none", lambda e: _mm(e, kernel=None), V,
     r"kernel must be one of \('auto', 'portable', 'tma', 'ws'\), got None"),
    # ---- diyfa.flash_attn_interface -------------------------------------------------------
    ("fai/func-q-float64", lambda e: fai.flash_attn_func(e.qs.double(), e.ks, e.vs), T,
     r"q\.dtype is torch\.float64; accepted"),
    ("fai/func-window-int", lambda e: fai.flash_attn_func(e.qs, e.ks, e.vs, window_size=4), T,
     r"window_size must be a \(left, right\) pair of ints, got 4"),
    ("fai/func-window-3", lambda e: fai.flash_attn_func(e.qs, e.ks, e.vs,
                                                        window_size=(1, 2, 3)), T,
     r"window_size must be a \(left, right\) pair of ints, got \(1, 2, 3\)"),
    ("fai/func-softcap-str", lambda e: fai.flash_attn_func(e.qs, e.ks, e.vs, softcap="1"), T,
     r"softcap must be a number, got '1'"),
    ("fai/func-softcap-nan", lambda e: fai.flash_attn_func(e.qs, e.ks, e.vs,
                                                           softcap=float("nan")), V,
     r"softcap must be a finite number >= 0 \(0 turns it off\), got nan"),
    ("fai/func-causal-str", lambda e: fai.flash_attn_func(e.qs, e.ks, e.vs, causal="no"), T,
     r"causal must be a bool, got 'no'"),
    ("fai/func-deterministic-int", lambda e: fai.flash_attn_func(e.qs, e.ks, e.vs,
                                                                 deterministic=1), T,
     r"deterministic must be a bool, got 1"),
    ("fai/func-dropout-str", lambda e: fai.flash_attn_func(e.qs, e.ks, e.vs, dropout_p="0"), T,
     r"dropout_p must be a number, got '0'"),
    ("fai/qkvpacked-2", lambda e: fai.flash_attn_qkvpacked_func(_t(1, 8, 2, 2, 16)), V,
     r"qkv must be 5-D \(batch, seqlen, 3, nheads, headdim\), got shape \(1, 8, 2, 2, 16\)"),
    ("fai/qkvpacked-4", lambda e: fai.flash_attn_qkvpacked_func(_t(1, 8, 4, 2, 16)), V,
     r"qkv must be 5-D \(batch, seqlen, 3, nheads, headdim\), got shape \(1, 8, 4, 2, 16\)"),
    ("fai/qkvpacked-4d", lambda e: fai.flash_attn_qkvpacked_func(_t(1, 8, 3, 32)), V,
     r"qkv must be 5-D .* got shape \(1, 8, 3, 32\)"),
    ("fai/qkvpacked-list", lambda e: fai.flash_attn_qkvpacked_func([[1.0]]), T,
     r"qkv must be a torch\.Tensor, got list"),
    ("fai/kvpacked-3", lambda e: fai.flash_attn_kvpacked_func(e.qs, _t(1, 8, 3, 2, 16)), V,
     r"kv must be 5-D \(batch, seqlen_k, 2, nheads_k, headdim\), got shape "
     r"\(1, 8, 3, 2, 16\)"),
    ("fai/kvpacked-q-fp32", lambda e: fai.flash_attn_kvpacked_func(e.qs.float(),
                                                                   _t(1, 8, 2, 2, 16)), T,
     r"q, k, v must share a dtype, got q=torch\.float32, k=torch\.float16"),
    ("fai/varlen-cu-int64", lambda e: fai.flash_attn_varlen_func(e.qp, e.kp, e.vp, e.cu,
                                                                 e.cu.long(), 5, 5), T,
     r"cu_seqlens_k\.dtype is torch\.int64; accepted: int32"),
    ("fai/varlen-window-str", lambda e: fai.flash_attn_varlen_func(
        e.qp, e.kp, e.vp, e.cu, e.cu, 5, 5, window_size="full"), T,
     r"window_size must be a \(left, right\) pair of ints, got 'full'"),
    ("fai/kvcache-seqlens-float", lambda e: _fai_kv(e, cache_seqlens=3.0), T,
     r"cache_seqlens must be a torch\.Tensor, got float"),
    ("fai/kvcache-seqlens-past", lambda e: _fai_kv(e, cache_seqlens=10), V,
     r"cache_seqlens\[0\] = 10 plus 1 new tokens does not fit the cache \(10 rows"),
    ("fai/kvcache-append-no-seqlens", lambda e: _fai_kv(e, cache_seqlens=None), V,
     r"k and v are appended at cache_seqlens, got cache_seqlens=None"),
    ("fai/kvcache-lse-str", lambda e: _fai_kv(e, return_softmax_lse="y"), T,
     r"return_softmax_lse must be a bool, got 'y'"),
    ("fai/kvcache-q-list", lambda e: _fai_kv(e, q=[1.0]), T,
     r"q must be a torch\.Tensor, got list"),
    ("fai/kvcache-table-pool", lambda e: _fai_kv(e, k_cache=e.kpg, v_cache=e.vpg,
                                                 block_table=_i32([[0, 9], [2, 3]]),
                                                 cache_seqlens=4), V,
     r"block_table\[0\] points outside the pool of 6 pages: \[9\]"),
    ("fai/kvcache-alibi-shape", lambda e: _fai_kv(e, alibi_slopes=_t(3, dtype=torch.float32)), V,
     r"alibi_slopes must have shape"),
]


def _snapshot(e):
    return {name: t.clone() for name, t in vars(e).items() if isinstance(t, torch.Tensor)}


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_is_refused_by_name_and_writes_nothing(row):
    _, call, err, match, *skip = row
    if skip and HAS_CUDA:
        pytest.skip(skip[0])
    e = _env()
    before = _snapshot(e)
    with pytest.raises(err, match=match) as info:
        call(e)
    assert type(info.value) is err  # not a subclass standing in for it
    for name, t in before.items():  # the caches above all: nothing written on an error
        assert torch.equal(getattr(e, name), t), f"{name} was written by a refused call"


def test_rows_cover_every_public_function():
    prefixes = {row[0].split("/")[0] for row in ROWS}
    assert prefixes == {"fa", "varlen", "kvcache", "sdpa", "matmul", "fai"}
    fai_functions = {row[0].split("/")[1].split("-")[0] for row in ROWS if row[0][:4] == "fai/"}
    assert fai_functions == {"func", "qkvpacked", "kvpacked", "varlen", "kvcache"}
