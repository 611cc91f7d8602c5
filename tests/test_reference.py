import math

import pytest
import torch

from diyfa.reference import attention_mask, attention_ref, matmul_ref


def _naive(q, k, v, mask):
    out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=torch.float64)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            hk = h * k.shape[1] // q.shape[1]
            s = q[b, h] @ k[b, hk].T / math.sqrt(q.shape[-1])
            for i in range(q.shape[2]):
                row = s[i][mask[i]] if mask is not None else s[i]
                if row.numel() == 0:
                    out[b, h, i] = 0
                    continue
                p = torch.softmax(row, 0)
                vv = v[b, hk][mask[i]] if mask is not None else v[b, hk]
                out[b, h, i] = p @ vv
    return out


@pytest.mark.parametrize("causal,align", [(False, "bottom_right"), (True, "bottom_right"),
                                          (True, "top_left")])
def test_attention_ref_against_a_row_by_row_softmax(causal, align):
    torch.manual_seed(0)
    q = torch.randn(1, 4, 9, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    v = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    out, lse = attention_ref(q, k, v, causal=causal, align=align, return_lse=True)
    mask = attention_mask(9, 5, causal=causal, align=align)
    torch.testing.assert_close(out, _naive(q, k, v, mask), rtol=1e-12, atol=1e-12)
    if causal and align == "bottom_right":
        # 9 queries, 5 keys: the first 4 rows see no key -> zero output, lse = -inf.
        assert torch.all(out[:, :, :4] == 0) and torch.all(torch.isneginf(lse[:, :, :4]))
        assert not torch.isnan(out).any()


def test_layouts_agree():
    q, k, v = (torch.randn(2, 3, 7, 16) for _ in range(3))
    a = attention_ref(q, k, v, causal=True)
    b = attention_ref(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, layout="bshd")
    torch.testing.assert_close(a, b.transpose(1, 2))


def test_window_mask():
    m = attention_mask(4, 4, causal=True, window=2)
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]).bool()
    assert torch.equal(m, expected)


def test_matmul_ref():
    a, b = torch.randn(3, 5, dtype=torch.float16), torch.randn(5, 2, dtype=torch.float16)
    assert matmul_ref(a, b).dtype == torch.float64
    with pytest.raises(ValueError, match="compute_dtype"):
        matmul_ref(a, b, compute_dtype=torch.float16)
