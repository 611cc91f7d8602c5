"""fp8 (float8_e4m3fn) attention forward with descales (issue 18), on the portable kernels.

The yardstick: PyTorch has no fp8 attention, so "PyTorch's own error in the same precision"
is a PyTorch emulation of the same recipe (the fp8 values times their descales, scores in
fp32, P rounded to e4m3 times 2^8 for P @ V, fp32 sums, bf16 output), judged against float64
attention of the dequantised inputs; diyfa's error may be at most 2x the emulation's (plus
bf16's floor). bf16 attention of the same dequantised values is printed alongside in
docs/attention.md, not used as the rule (P in fp8 costs accuracy by design).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import diyfa
from diyfa.reference import attention_mask, attention_ref

from .conftest import DEVICE

E4M3 = torch.float8_e4m3fn


def _quantise(x: torch.Tensor, per_head: bool, layout: str):
    """(fp8 values, fp32 descale): amax scaling to e4m3's 448, per tensor (1,) or per
    (batch, head) for a (batch, heads, s, d) / (batch, s, heads, d) tensor."""
    if per_head:
        dims = (2, 3) if layout == "bhsd" else (1, 3)
        amax = x.abs().amax(dim=dims)  # (batch, heads)
        sc = (amax / 448).clamp_min(1e-12)
        shape = sc[:, :, None, None] if layout == "bhsd" else sc[:, None, :, None]
        return (x / shape).to(E4M3), sc.float().contiguous()
    sc = (x.abs().amax() / 448).clamp_min(1e-12)
    return (x / sc).to(E4M3), sc.reshape(1).float()


def _dequant(x8, sc, layout):
    if sc.numel() == 1:
        return x8.double() * sc.double()
    shape = sc[:, :, None, None] if layout == "bhsd" else sc[:, None, :, None]
    return x8.double() * shape.double()


def _emulate(q, k, v, *, causal, scale, layout, window, softcap):
    """The kernel's recipe in PyTorch on dequantised fp32 values: scores in fp32, softmax
    with the row max subtracted, P times 2^8 rounded to e4m3, P @ V in fp32, / 2^8 / l."""
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k, v = (t.float() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    sq, sk = q.shape[2], k.shape[2]
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            keep &= j >= i - left
        if right >= 0:
            keep &= j <= i + right
    s = s.masked_fill(~keep.to(s.device), float("-inf"))
    if sk == 0:  # nothing to attend to: zeros
        out = torch.zeros(s.shape[:-1] + v.shape[-1:], dtype=torch.bfloat16)
        return out.transpose(1, 2) if layout == "bshd" else out
    m = s.amax(-1, keepdim=True).clamp_min(-1e30)
    p = torch.exp(s - m).nan_to_num(0.0)
    l = p.sum(-1, keepdim=True)
    p8 = (p * 256).to(E4M3).float()
    out = (p8 @ v) / 256 / l.clamp_min(1e-30)
    out = out.to(torch.bfloat16)
    return out.transpose(1, 2) if layout == "bshd" else out


def _case(b, h, hk, sq, sk, d, *, causal=False, layout="bhsd", per_head=False, window=None,
          softcap=0.0, seed=0, backend="auto"):  # fmt: skip
    g = torch.Generator().manual_seed(seed)

    def make(heads, s):
        shape = (b, heads, s, d) if layout == "bhsd" else (b, s, heads, d)
        return torch.randn(shape, generator=g)

    q, k, v = make(h, sq), make(hk, sk), make(hk, sk)
    # Outlier channels, as LLM activations have: a few head-dim channels 20x larger.
    q[..., : max(1, d // 16)] *= 20
    (q8, qs), (k8, ks), (v8, vs) = (_quantise(t, per_head, layout) for t in (q, k, v))
    if per_head and h != hk:  # q's descale is per (batch, kv head) too: one per group
        qs_full = qs.view(b, hk, h // hk).amax(-1)
        shape = (qs_full.repeat_interleave(h // hk, 1)[:, :, None, None] if layout == "bhsd"
                 else qs_full.repeat_interleave(h // hk, 1)[:, None, :, None])  # fmt: skip
        q8 = (q / shape).to(E4M3)
        qs = qs_full.contiguous()
    to = dict(device=DEVICE)
    q8, k8, v8, qs, ks, vs = (t.to(**to) for t in (q8, k8, v8, qs, ks, vs))
    scale = d**-0.5
    kw = dict(causal=causal, layout=layout, softcap=softcap,
              window_size=window if window is not None else (-1, -1))  # fmt: skip
    with torch.no_grad():
        out, lse = diyfa.flash_attention(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs,
                                         return_lse=True, backend=backend, **kw)  # fmt: skip
    qd = _dequant(q8, _expand_q(qs, h, hk), layout)
    kd, vd = _dequant(k8, ks, layout), _dequant(v8, vs, layout)
    ref, ref_lse = attention_ref(qd, kd, vd, causal=causal, layout=layout, softcap=softcap,
                                 window=window, compute_dtype=torch.float64,
                                 return_lse=True)  # fmt: skip
    emu = _emulate(qd, kd, vd, causal=causal, scale=scale, layout=layout, window=window,
                   softcap=softcap)  # fmt: skip
    check_fp8_lse(lse, ref_lse, qd, kd, scale=scale, layout=layout, causal=causal,
                  window=window)  # fmt: skip
    return out, lse, ref, ref_lse, emu


# The tensor cores add fp8 products in reduced precision (about 14 bits kept on Hopper, as
# DeepSeek-V3's report measured; the aligned addends are truncated, so errors add up rather
# than cancel). Left unpromoted over the head dim, a score lost up to ~2^-9.6 of sum_c |q_c
# k_c| at d256 and ~2^-11 at d128 on an H200 (outlier channels, 2026-11-23); the kernel now
# promotes each instruction's 32-product sum into fp32 (portable.py), but one instruction
# alone (d32) still showed ~2^-10.75 of it (H200 fuzz at a6d029c). The bound here is 2^-10
# of sum_c |q_c k_c|: measured, not documented (NVIDIA does not specify the fp8 sums'
# precision), with little margin. The LSE, 1-Lipschitz in the scaled scores (softcap's
# tanh only shrinks them), is off by at most the row's largest score error over the keys it
# sees; on 16-bit inputs (fp32 sums) the LSE check is 1e-4 relative, here that plus this.
FP8_SUM_BITS = 10


def fp8_score_error(qd, kd, *, scale, layout, causal=False, window=None):
    """Per query row (batch, heads, seqlen_q): the bound above on any of its visible scaled
    scores' error, from the dequantised (float64) q and k."""
    q, k = (qd, kd) if layout == "bhsd" else (qd.transpose(1, 2), kd.transpose(1, 2))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    absprod = q.abs().cpu().double() @ k.abs().cpu().double().transpose(-1, -2)
    keep = attention_mask(q.shape[2], k.shape[2], causal=causal, window=window)
    if keep is not None:
        absprod = absprod.masked_fill(~keep, 0.0)
    if absprod.shape[-1] == 0:  # no keys: no score to be wrong
        return absprod.new_zeros(absprod.shape[:-1])
    return 2.0**-FP8_SUM_BITS * scale * absprod.amax(-1)


def check_fp8_lse(lse, ref_lse, qd, kd, *, scale, layout, causal=False, window=None):
    """lse against the float64 reference's: -inf exactly where a row sees no key, elsewhere
    within 1e-4 (1 + |lse|) plus the fp8 score bound above. qd, kd: the dequantised inputs
    (float64)."""
    lse, ref_lse = lse.cpu().double(), ref_lse.cpu()
    seen = torch.isfinite(ref_lse)
    assert lse.shape == ref_lse.shape
    assert torch.equal(torch.isfinite(lse), seen), "LSE finite where the reference's is not"
    assert torch.isneginf(lse[~seen]).all()
    if not seen.any():
        return
    tol = 1e-4 * (1 + ref_lse.abs()) + fp8_score_error(qd, kd, scale=scale, layout=layout,
                                                       causal=causal, window=window)
    err = (lse - ref_lse).abs()
    worst = (err - tol)[seen].argmax()
    assert (err[seen] <= tol[seen]).all(), (
        f"LSE error {err[seen][worst].item():.3e} > allowed {tol[seen][worst].item():.3e}")


def _expand_q(qs, h, hk):
    return qs if qs.numel() == 1 else qs.repeat_interleave(h // hk, 1)


def _check(out, ref, emu):
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item()
    emu_err = (emu.double() - ref).abs().max().item()
    assert err <= 2 * emu_err + 1e-3, f"fp8 error {err:.3e} > 2x the emulation's {emu_err:.3e}"


SHAPES = [  # (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim)
    (1, 2, 2, 1, 1, 16),
    (2, 4, 2, 70, 70, 64),
    (1, 2, 1, 33, 130, 40),
    (1, 2, 2, 97, 45, 128),
    (1, 1, 1, 40, 64, 256),
]


@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}h{}hk{}q{}k{}d{}".format(*s))
def test_fp8_forward_against_float64(shape, causal, per_head):
    out, lse, ref, ref_lse, emu = _case(*shape, causal=causal, per_head=per_head,
                                        layout="bshd" if causal else "bhsd")  # fmt: skip
    _check(out, ref, emu)  # (and _case checked the LSE)


@pytest.mark.parametrize("variant", ["window", "softcap"])
def test_fp8_forward_variants(variant):
    kw = dict(window=(9, 0)) if variant == "window" else dict(softcap=5.0)
    out, _, ref, _, emu = _case(1, 2, 2, 50, 60, 64, causal=True, **kw)
    _check(out, ref, emu)


def test_fp8_small_probabilities_survive_p_rounding():
    """P goes to e4m3 times 2^8: without the factor, probabilities below e4m3's smallest
    subnormal (2^-9) would round to 0. One key at score 0 and 1000 at about -7 (p ~ 9e-4
    each, together as heavy as the first): the output is ~0.48, and 0 if they are lost."""
    n = 1001
    q = torch.zeros(1, 1, 1, 32)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, n, 32)
    k[:, :, 1:, 0] = -7.0  # exact in e4m3
    v = torch.zeros(1, 1, n, 32)
    v[:, :, 1:, 0] = 1.0
    one = torch.ones(1, device=DEVICE)
    q8, k8, v8 = (t.to(E4M3).to(DEVICE) for t in (q, k, v))
    with torch.no_grad():
        out = diyfa.flash_attention(q8, k8, v8, softmax_scale=1.0, q_descale=one,
                                    k_descale=one, v_descale=one)  # fmt: skip
    p = torch.exp(torch.tensor(-7.0, dtype=torch.float64))
    want = (n - 1) * p / (1 + (n - 1) * p)  # ~0.477
    assert abs(out[0, 0, 0, 0].item() - want.item()) < 0.02, (out[0, 0, 0, 0].item(), want)


def _fp8_args(**over):
    q = torch.zeros(1, 2, 8, 16, device=DEVICE).to(E4M3)
    one = torch.ones(1, device=DEVICE)
    args = dict(q=q, k=q, v=q, q_descale=one, k_descale=one, v_descale=one)
    args.update(over)
    return args


def _call(**over):
    a = _fp8_args(**over)
    return diyfa.flash_attention(a.pop("q"), a.pop("k"), a.pop("v"), **a)


@pytest.mark.parametrize("over, err, match", [
    (dict(q_descale=None), ValueError, r"fp8 \(float8_e4m3fn\) q, k, v need q_descale: fp32"),
    (dict(v_descale=torch.ones(1, dtype=torch.float64)), TypeError,
     r"v_descale\.dtype is torch\.float64; accepted: float32"),
    (dict(k_descale=torch.ones(3, 2)), ValueError,
     r"k_descale must be \(1,\) per tensor or \(batch, kv_heads\) = \(1, 2\), got \(3, 2\)"),
    (dict(k_descale=torch.ones(1, 2)), ValueError,
     r"q_descale, k_descale and v_descale must share a shape"),
    (dict(k=torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16)), TypeError,
     r"q, k, v must share a dtype"),
    (dict(dropout_p=0.1), ValueError, r"fp8 attention is forward only \(inference\): dropout_p"),
])  # fmt: skip
def test_fp8_bad_inputs(over, err, match):
    over = {n: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t) for n, t in over.items()}
    with pytest.raises(err, match=match):
        _call(**over)


def test_fp8_refuses_gradients_and_descales_on_16_bit_inputs():
    q = torch.zeros(1, 2, 8, 16, device=DEVICE).to(E4M3).requires_grad_()
    one = torch.ones(1, device=DEVICE)
    with pytest.raises(ValueError, match=r"fp8 attention is forward only \(inference\): q, k, "
                                         r"v require grad"):  # fmt: skip
        diyfa.flash_attention(q, q, q, q_descale=one, k_descale=one, v_descale=one)
    h = torch.zeros(1, 2, 8, 16, device=DEVICE, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"q_descale applies to float8_e4m3fn q, k, v; these "
                                         r"are torch\.float16"):  # fmt: skip
        diyfa.flash_attention(h, h, h, q_descale=one)
    sinks = torch.zeros(2, device=DEVICE, requires_grad=True)
    with pytest.raises(ValueError, match=r"fp8 attention is forward only \(inference\): sinks "
                                         r"require grad"):  # fmt: skip
        diyfa.flash_attention(q.detach(), q.detach(), q.detach(), q_descale=one, k_descale=one,
                              v_descale=one, sinks=sinks)  # fmt: skip
    from diyfa.flash_attn_interface import flash_attn_func

    with pytest.raises(TypeError, match=r"flash_attn_func takes float16, bfloat16 or float32 "
                                        r"tensors, got float8_e4m3fn"):  # fmt: skip
        flash_attn_func(q.detach(), q.detach(), q.detach())
    cu = torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
    p = torch.zeros(8, 2, 16, device=DEVICE).to(E4M3)
    with pytest.raises(TypeError, match=r"flash_attention_varlen takes float16, bfloat16 or "
                                        r"float32 q, k, v, got float8_e4m3fn"):  # fmt: skip
        diyfa.flash_attention_varlen(p, p, p, cu, cu, 8, 8)


def test_fp8_custom_op_fake_gives_bf16():
    """The custom op (torch.compile's path) takes the descales; its fake output is bf16."""
    a = _fp8_args()
    torch.library.opcheck(torch.ops.diyfa.attention_fwd.default,
                          (a["q"], a["k"], a["v"], False, "bottom_right", None, "bhsd", "auto",
                           False, -1, -1, 0.0, None, None, a["q_descale"], a["k_descale"],
                           a["v_descale"]),
                          test_utils=("test_faketensor",))  # fmt: skip


_COMPILE_FP8 = """
import torch
from diyfa.attention import portable as P
for causal, d in ((False, 128), (True, 128), (True, 32)):  # 32: a head dim <= 32, padded
    k = P.compile_for_hopper("attn_fwd", torch.float8_e4m3fn, 4, 2, CAUSAL=causal,
                             HEAD_DIM=16 if d == 32 else d, HEAD_DIM_PAD=d,
                             HEAD_DIM_V=16 if d == 32 else d, HEAD_DIM_V_PAD=d,
                             BLOCK_N=64 if d > 32 else 32)
    print(causal, k.metadata.shared, k.asm["ptx"].count("wgmma.mma_async"),
          k.asm["ptx"].count("e4m3"))
"""


def test_fp8_forward_compiles_for_hopper():
    """The fp8 forward compiles for sm90a: both dots on fp8 wgmma (P converted to e4m3), a
    head dim of 16 too (padded to 32: 8-bit dots need K >= 32 on the GPU, which the
    interpreter does not check)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FP8], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for line in done.stdout.splitlines():
        _, shared, wgmma, e4m3 = line.split()
        assert int(wgmma) > 0 and int(e4m3) > 0 and int(shared) <= 232448, line


HOPPER_SHAPES = [  # head dims the Hopper forward takes; odd lengths, GQA, seqlen_q != seqlen_k
    (2, 4, 2, 70, 70, 64), (1, 2, 2, 97, 45, 128), (1, 1, 1, 40, 64, 256),
    (2, 8, 2, 1000, 1531, 128), (1, 4, 4, 517, 300, 96), (1, 2, 1, 1, 777, 64),
    (2, 8, 2, 1000, 1531, 64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", HOPPER_SHAPES, ids=lambda s: "b{}h{}hk{}q{}k{}d{}".format(*s))
def test_gpu_fp8_hopper_forward_against_float64(shape, causal, per_head):
    """The fp8 forward of the Hopper family (backend="hopper": e4m3 wgmma, V^T, P through
    shared memory) by the same rules as the portable one: output within 2x the emulated
    recipe's error, LSE within the fp8 score bound."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper family needs an sm90 GPU")
    out, _, ref, _, emu = _case(*shape, causal=causal, per_head=per_head, backend="hopper",
                                layout="bshd" if per_head else "bhsd")  # fmt: skip
    _check(out, ref, emu)


def test_fp8_hopper_dispatch():
    """fp8 problems the Hopper forward takes: plain attention (causal or not, GQA) at its head
    dims, under "auto" too (measured faster than the portable fp8 kernel at every shape of
    benchmarks/fp8_speed.py); variants are refused with the reason (the portable kernel runs
    them)."""
    import dataclasses

    from diyfa.attention import dispatch, hopper_fwd
    from diyfa.attention.checks import check_inputs

    q = torch.zeros(1, 4, 64, 128, device=DEVICE).to(E4M3)
    one = torch.ones(1, device=DEVICE)
    p = check_inputs(q, q, q, causal=True, softmax_scale=None, layout="bhsd",
                     align="bottom_right", q_descale=one, k_descale=one,
                     v_descale=one)  # fmt: skip
    p = dataclasses.replace(p, capability=(9, 0), aligned16=True)
    assert hopper_fwd.supports(p) is None and hopper_fwd.prefer(p) is None
    assert dispatch.select(p).name == "hopper"
    capped = dataclasses.replace(p, softcap=5.0)
    assert "no window" in hopper_fwd.supports(capped)
    assert dispatch.select(capped).name == "portable"


def test_fp8_sums_setting_from_the_environment(monkeypatch):
    """DIYFA_FP8_ATTN_SUMS picks the Hopper fp8 forward's sums (1..5, or "auto", the default:
    mode 4 at d64, 5 at d128, 3 at d256), each mode with its launch config (mode 4's blocks
    twice as wide); anything else is a clear error naming the variable and the accepted values."""
    from diyfa.attention import hopper_fwd

    monkeypatch.delenv("DIYFA_FP8_ATTN_SUMS", raising=False)
    assert hopper_fwd._fp8_sums_from_env() == 0
    monkeypatch.setenv("DIYFA_FP8_ATTN_SUMS", "3")
    assert hopper_fwd._fp8_sums_from_env() == 3
    for bad in ("0", "6", "fast", ""):
        monkeypatch.setenv("DIYFA_FP8_ATTN_SUMS", bad)
        with pytest.raises(ValueError, match="must be one of auto, 1, 2, 3, 4, 5"):
            hopper_fwd._fp8_sums_from_env()
    monkeypatch.setattr(hopper_fwd, "FP8_PROMOTION", 0)
    assert [hopper_fwd.fp8_mode(d) for d in (64, 128, 256)] == [4, 5, 3]
    assert hopper_fwd.fp8_config(64) == hopper_fwd.FP8_CONFIGS_UNPROMOTED[64]
    # (the 16-bit config, unchained: chaining tiles spilled 64-84 bytes in fp8, not measured)
    assert hopper_fwd.fp8_config(128) == hopper_fwd.HOPPER_CONFIGS[128]._replace(chain=0)
    monkeypatch.setattr(hopper_fwd, "FP8_PROMOTION", 4)
    assert hopper_fwd.fp8_mode(64) == 4
    assert hopper_fwd.fp8_config(128) == hopper_fwd.FP8_CONFIGS_UNPROMOTED[128]


def test_fp8_v_transpose_kernel():
    """The fp8 forward's V^T (hopper_fwd.transpose_v, a Triton kernel: PyTorch's strided copy
    of 1-byte elements was a quarter of a call's time at 4096 keys): exact, for odd lengths,
    strided (bshd) views and head dims that are not a multiple of the tile, with its rows
    16-byte aligned for TMA."""
    from diyfa.attention.hopper_fwd import transpose_v

    g = torch.Generator().manual_seed(0)
    for b, hk, s, d, bshd in [(2, 3, 70, 40, False), (1, 2, 130, 128, True), (1, 1, 1, 16, False),
                              (1, 2, 65, 256, True)]:
        if bshd:
            v = torch.randn(b, s, hk, d, generator=g).to(E4M3).to(DEVICE).transpose(1, 2)
        else:
            v = torch.randn(b, hk, s, d, generator=g).to(E4M3).to(DEVICE)
        vt = transpose_v(v)
        assert vt.shape == (b, hk, d, s) and vt.dtype == E4M3
        assert vt.stride(2) % 16 == 0 and vt.stride(3) == 1
        assert torch.equal(vt.view(torch.uint8).cpu(), v.transpose(2, 3).view(torch.uint8).cpu())


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_key_major_values_keeps_values_and_puts_keys_together(layout):
    """diyfa.key_major_values: the same values, shape and layout, the keys contiguous and the
    rows 16-byte aligned (TMA), for odd lengths, fp8 and bf16; bad arguments are named."""
    g = torch.Generator().manual_seed(0)
    for dtype, s in [(E4M3, 70), (torch.bfloat16, 33), (E4M3, 1)]:
        shape = (2, 3, s, 64) if layout == "bhsd" else (2, s, 3, 64)
        v = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
        km = diyfa.key_major_values(v, layout=layout)
        assert km.shape == v.shape and km.dtype == dtype
        keys, dim = (2, 3) if layout == "bhsd" else (1, 3)
        assert km.stride(keys) == 1 and km.stride(dim) * km.element_size() % 16 == 0
        assert torch.equal(km.float().cpu(), v.float().cpu())
    with pytest.raises(ValueError, match="layout must be 'bhsd' or 'bshd', got 'sbhd'"):
        diyfa.key_major_values(v, layout="sbhd")
    with pytest.raises(ValueError, match=r"must be 4-D \(bhsd\), got shape \(3, 4\)"):
        diyfa.key_major_values(torch.zeros(3, 4))
    with pytest.raises(TypeError, match="must be a torch.Tensor, got list"):
        diyfa.key_major_values([1.0])


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_fp8_forward_with_key_major_v_gives_the_same_output(layout):
    """An fp8 V stored with its keys contiguous (key_major_values) gives bitwise the output of
    the plain V: on the CPU through the portable kernel's strides, on an H100/H200 through the
    Hopper kernel, which then reads it as V^T without its copy (GQA, causal, odd lengths)."""
    g = torch.Generator().manual_seed(3)
    b, h, hk, sq, sk, d = 1, 4, 2, 67, 131, 128
    shape = (lambda n, s: (b, n, s, d)) if layout == "bhsd" else (lambda n, s: (b, s, n, d))
    q, k, v = (torch.randn(shape(n, s), generator=g).to(E4M3).to(DEVICE)
               for n, s in ((h, sq), (hk, sk), (hk, sk)))  # fmt: skip
    sc = [torch.full((1,), x, device=DEVICE) for x in (0.05, 0.04, 0.03)]
    kw = dict(causal=True, layout=layout, q_descale=sc[0], k_descale=sc[1], v_descale=sc[2])
    with torch.no_grad():
        plain = diyfa.flash_attention(q, k, v, **kw)
        km = diyfa.flash_attention(q, k, diyfa.key_major_values(v, layout=layout), **kw)
    assert plain.abs().max() > 0
    assert torch.equal(plain, km)


def test_fp8_hopper_reads_key_major_v_without_a_copy():
    """The Hopper family takes an fp8 V whose keys are contiguous (its V^T is then a view of
    the caller's tensor, no transposed copy); a key-major 16-bit V, whose wgmma reads V
    row-major, and a key-major fp8 V with unaligned rows are refused with the reason."""
    import dataclasses

    from diyfa.attention import hopper_fwd
    from diyfa.attention.checks import check_inputs

    q = torch.zeros(1, 4, 64, 128, device=DEVICE).to(E4M3)
    v = diyfa.key_major_values(torch.zeros(1, 4, 64, 128, device=DEVICE).to(E4M3))
    one = torch.ones(1, device=DEVICE)

    def problem(q, k, v, **kw):
        p = check_inputs(q, k, v, causal=True, softmax_scale=None, layout="bhsd",
                         align="bottom_right", **kw)  # fmt: skip
        return dataclasses.replace(p, capability=(9, 0), aligned16=True)

    p = problem(q, q, v, q_descale=one, k_descale=one, v_descale=one)
    assert hopper_fwd.supports(p) is None
    vt = hopper_fwd._fp8_operands(v, p)["vt"]
    assert vt.data_ptr() == v.data_ptr() and vt.shape == (1, 4, 128, 64)
    assert torch.equal(vt.view(torch.uint8), v.transpose(2, 3).view(torch.uint8))
    # rows of 40 keys: 40 bytes apart, not a multiple of 16
    odd = torch.zeros(1, 4, 128, 40, device=DEVICE).to(E4M3).transpose(2, 3)
    p_odd = problem(q[:, :, :40], q[:, :, :40], odd, q_descale=one, k_descale=one,
                    v_descale=one)  # fmt: skip
    assert "not multiples of 16 bytes" in hopper_fwd.supports(p_odd)
    q16 = torch.zeros(1, 4, 64, 128, dtype=torch.bfloat16, device=DEVICE)
    v16 = diyfa.key_major_values(q16)
    assert "v's head dim is not contiguous" in hopper_fwd.supports(problem(q16, q16, v16))
