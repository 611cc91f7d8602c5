import pytest
import torch

from diyfa import flops
from diyfa.reference import attention_mask


def test_seed_002_cross_attention_is_3_75x_the_naive_count():
    # q=4096, kv=15360, 16 heads, head_dim 64: counting seqlen_q^2 undercounts by 3.75x.
    exact = flops.attention_flops(1, 16, 4096, 15360, 64)
    naive = flops.attention_flops(1, 16, 4096, 4096, 64)
    assert exact == 4 * 1 * 4096 * 15360 * 16 * 64
    assert exact / naive == pytest.approx(3.75, rel=0, abs=0)


def test_forward_backward_and_both():
    fwd = flops.attention_flops(2, 8, 1024, 1024, 128, mode="fwd")
    bwd = flops.attention_flops(2, 8, 1024, 1024, 128, mode="bwd")
    assert fwd == 4 * 2 * 8 * 1024 * 1024 * 128
    assert bwd == int(2.5 * fwd)
    assert flops.attention_flops(2, 8, 1024, 1024, 128, mode="fwd_bwd") == fwd + bwd


def test_different_value_dim():
    # QK^T uses head_dim, PV uses head_dim_v.
    f = flops.attention_flops(1, 1, 10, 20, 64, head_dim_v=32)
    assert f == 2 * 10 * 20 * (64 + 32)
    b = flops.attention_flops(1, 1, 10, 20, 64, head_dim_v=32, mode="bwd")
    assert b == 2 * 10 * 20 * (3 * 64 + 2 * 32)


@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 17), (113, 77), (77, 113), (1000, 1023)])
@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
def test_causal_pairs_match_the_reference_mask(sq, sk, align):
    mask = attention_mask(sq, sk, causal=True, align=align)
    assert flops.attention_pairs(sq, sk, causal=True, align=align) == int(mask.sum())


@pytest.mark.parametrize("window,causal", [((15, 0), True), (7, True), ((3, 5), False),
                                           ((0, 0), False), ((-1, 4), False)])
def test_window_pairs_match_the_reference_mask(window, causal):
    for sq, sk in [(50, 50), (31, 64), (64, 31)]:
        mask = attention_mask(sq, sk, causal=causal, window=window)
        assert flops.attention_pairs(sq, sk, causal=causal, window=window) == int(mask.sum())


def test_causal_exact_vs_published():
    # Square causal: exact = n(n+1)/2 pairs, published = n^2/2.
    n = 1024
    exact = flops.attention_flops(1, 1, n, n, 64, causal=True)
    pub = flops.attention_flops(1, 1, n, n, 64, causal=True, convention="published")
    assert exact == 4 * 64 * n * (n + 1) // 2
    assert pub == 4 * 64 * n * n // 2
    # Bottom-right, seqlen_q > seqlen_k: the first rows see nothing.
    assert flops.attention_pairs(10, 4, causal=True) == 1 + 2 + 3 + 4


def test_varlen_sums_each_sequence():
    f = flops.attention_flops(heads=2, head_dim=16, seqlens_q=[3, 5], seqlens_k=[7, 2])
    assert f == 4 * 2 * 16 * (3 * 7 + 5 * 2)
    with pytest.raises(ValueError, match="one entry per sequence"):
        flops.attention_flops(heads=2, head_dim=16, seqlens_q=[3, 5], seqlens_k=[7])


def test_gqa_does_not_change_flops_but_changes_bytes():
    a = flops.attention_flops(1, 32, 1024, 1024, 128, kv_heads=8)
    assert a == flops.attention_flops(1, 32, 1024, 1024, 128)
    full = flops.attention_bytes(1, 32, 1024, 1024, 128, dtype="bf16")
    gqa = flops.attention_bytes(1, 32, 1024, 1024, 128, kv_heads=8, dtype="bf16")
    # K and V shrink 4x: 2 * 32 * 1024 * 128 * 2 bytes * (1 - 1/4)
    assert full - gqa == 2 * 32 * 1024 * 128 * 2 * 3 // 4


def test_matmul_flops_bytes_intensity():
    assert flops.matmul_flops(4096, 4096, 4096) == 2 * 4096**3
    assert flops.matmul_flops(2, 3, 4, batch=5) == 2 * 5 * 2 * 3 * 4
    nbytes = flops.matmul_bytes(4096, 4096, 4096, dtype="bf16")
    assert nbytes == 3 * 4096 * 4096 * 2
    assert flops.arithmetic_intensity(flops.matmul_flops(4096, 4096, 4096), nbytes) == (
        pytest.approx(4096 / 3)
    )
    assert flops.matmul_bytes(16, 16, 16, dtype="fp8", out_dtype="bf16") == 16 * 16 * (1 + 1 + 2)


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        (dict(batch=-1, heads=1, seqlen_q=8), ValueError, "batch must be >= 1, got -1"),
        (dict(batch=1, heads=0, seqlen_q=8), ValueError, "heads must be >= 1"),
        (dict(batch=1, heads=1, seqlen_q=8, head_dim=0), ValueError, "head_dim"),
        (dict(batch=1, heads=1, seqlen_q=8, window=16), ValueError, "non-causal"),
        (dict(batch=1, heads=1, seqlen_q=8, causal=True, window=(4, 2)), ValueError, "looks ahead"),
        (dict(batch=1, heads=1, seqlen_q=8, window=(-3, 0)), ValueError, ">= 0 or -1"),
        (dict(batch=1, heads=1, seqlen_q=8, mode="forward"), ValueError, "mode must be one of"),
        (dict(batch=1, heads=6, seqlen_q=8, kv_heads=4), ValueError, "multiple of kv_heads"),
        (dict(batch=1, heads=1, seqlen_q=8.5), TypeError, "seqlen_q must be an int"),
        (dict(batch=1, heads=1), ValueError, "give seqlen_q"),
    ],
)
def test_bad_input(kwargs, err, match):
    with pytest.raises(err, match=match):
        flops.attention_flops(**kwargs)


def test_unknown_dtype_names():
    with pytest.raises(ValueError, match="unknown dtype 'fp12'"):
        flops.attention_bytes(1, 1, 8, dtype="fp12")
    with pytest.raises(ValueError, match="m must be >= 1"):
        flops.matmul_flops(0, 1, 1)
    assert flops.dtype_bytes(torch.bfloat16) == 2
