"""diyfa.flash_attention_with_kvcache: append + attend against contiguous and paged caches,
split over the keys, against the float64 reference (2x PyTorch's own error). CPU runs use
the Triton interpreter.
"""

from __future__ import annotations

import pytest
import torch

import diyfa
from diyfa.reference import attention_ref

from .conftest import DEVICE
from .test_attention import _check

LENS = [0, 70, 200]  # cached tokens per sequence before the append (an empty one first)


def _setup(dtype, sq, s_new, h=8, hk=2, d=32, page=16, device=DEVICE, seed=0, dv=None):
    """Inputs, the same cache as a contiguous tensor and as shuffled pages, and the
    contiguous cache after the append (the reference's keys and values). ``dv``: the value
    head dim (default d)."""
    dv = dv or d
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    b, max_len = len(LENS), 300
    q = rnd(b, sq, h, d)
    k_cache, v_cache = rnd(b, max_len, hk, d), rnd(b, max_len, hk, dv)
    k_new = rnd(b, s_new, hk, d) if s_new else None
    v_new = rnd(b, s_new, hk, dv) if s_new else None
    pages_per_seq = -(-max_len // page)
    pool = b * pages_per_seq + 5
    perm = torch.randperm(pool, generator=g)[: b * pages_per_seq]
    table = perm.view(b, pages_per_seq).to(device, torch.int32)
    k_pages, v_pages = rnd(pool, page, hk, d), rnd(pool, page, hk, dv)
    for i in range(b):
        for j in range(0, LENS[i], page):
            n = min(page, LENS[i] - j)
            k_pages[table[i, j // page], :n] = k_cache[i, j:j + n]
            v_pages[table[i, j // page], :n] = v_cache[i, j:j + n]
    after_k, after_v = k_cache.clone(), v_cache.clone()
    for i in range(b):
        if s_new:
            after_k[i, LENS[i]:LENS[i] + s_new] = k_new[i]
            after_v[i, LENS[i]:LENS[i] + s_new] = v_new[i]
    seqlens = torch.tensor(LENS, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, k_new, v_new, seqlens, table, k_pages, v_pages, after_k, after_v


def _reference(q, k, v, lengths, causal, dtype):
    outs = []
    for i, n in enumerate(lengths):
        outs.append(attention_ref(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], causal=causal,
                                  layout="bshd", compute_dtype=dtype))  # fmt: skip
    return torch.cat(outs)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("sq, s_new, causal", [(1, 1, True), (4, 0, True), (3, 3, False),
                                               (2, 0, False)],  # fmt: skip
                         ids=["decode", "spec4", "append3-full", "q2-full"])
@pytest.mark.parametrize("splits", [1, 3, 0], ids=["1split", "3splits", "auto"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=["fp16", "bf16", "fp32"])  # fmt: skip
def test_kvcache_append_and_attend(dtype, splits, sq, s_new, causal, paged):
    (q, k_cache, v_cache, k_new, v_new, seqlens, table, k_pages, v_pages, after_k,
     after_v) = _setup(dtype, sq, s_new)  # fmt: skip
    if paged:
        kc, vc, bt = k_pages, v_pages, table
    else:
        kc, vc, bt = k_cache, v_cache, None
    with torch.no_grad():
        out, lse = diyfa.flash_attention_with_kvcache(
            q, kc, vc, k_new, v_new, cache_seqlens=seqlens, block_table=bt, causal=causal,
            num_splits=splits, return_lse=True)  # fmt: skip
    lengths = [n + s_new for n in LENS]
    ref = _reference(q.double(), after_k.double(), after_v.double(), lengths, causal,
                     torch.float64)  # fmt: skip
    pt = _reference(q, after_k, after_v, lengths, causal, dtype)
    _check("out", out, pt, ref, 2, dtype)
    assert lse.shape == (q.shape[0], q.shape[2], sq)
    assert torch.equal(seqlens, torch.tensor(LENS, dtype=torch.int32, device=q.device))
    if not paged:  # the append wrote exactly the new rows
        assert torch.equal(k_cache, after_k) and torch.equal(v_cache, after_v)
    else:
        for i, n in enumerate(LENS):
            for j in range(n + s_new):
                page, row = table[i, j // 16], j % 16
                assert torch.equal(k_pages[page, row], after_k[i, j])
                assert torch.equal(v_pages[page, row], after_v[i, j])
    if LENS[0] + s_new < sq and causal:  # rows of sequence 0 that see no key
        assert (out[0, : sq - LENS[0] - s_new] == 0).all()


@pytest.mark.parametrize("splits", [1, 3], ids=["1split", "3splits"])
@pytest.mark.parametrize("page", [1, 12, 16, 64, 256])
def test_kvcache_page_sizes(page, splits):
    """The split kernel's three ways through the block table (decode.kvcache_attention's
    PAGE): pages of 64 and 256 (a 64-key block in one page: one entry a block), 16 and 1
    (whole pages in a block: an entry per page, spread over its keys) and 12 (not a power of
    two: an entry per key), 4 new tokens appended through the pages, against the reference;
    the same cache contiguous gives the same output within rounding."""
    dtype = torch.bfloat16
    (q, k_cache, v_cache, k_new, v_new, seqlens, table, k_pages, v_pages, after_k,
     after_v) = _setup(dtype, 4, 4, page=page)  # fmt: skip
    with torch.no_grad():
        out = diyfa.flash_attention_with_kvcache(
            q, k_pages, v_pages, k_new, v_new, cache_seqlens=seqlens, block_table=table,
            num_splits=splits)  # fmt: skip
    lengths = [n + 4 for n in LENS]
    ref = _reference(q.double(), after_k.double(), after_v.double(), lengths, True,
                     torch.float64)  # fmt: skip
    pt = _reference(q, after_k, after_v, lengths, True, dtype)
    _check("out", out, pt, ref, 2, dtype)
    with torch.no_grad():
        flat = diyfa.flash_attention_with_kvcache(q, after_k, after_v,
                                                  cache_seqlens=seqlens + 4,
                                                  num_splits=splits)  # fmt: skip
    assert (out.float() - flat.float()).abs().max().item() <= 1e-2


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("variant", [
    dict(window_size=(40, 0)), dict(softcap=2.0), dict(alibi="heads"), dict(sinks=True),
    dict(window_size=(25, 0), softcap=3.0, alibi="batch", sinks=True),
], ids=["window", "softcap", "alibi", "sinks", "all"])
def test_kvcache_variants(variant, paged):
    """Sliding window, softcap, ALiBi and sinks through the cache path (3 splits, so the
    window's first key lands inside a split and the sinks join the merge), decode and a
    3-token append, against the float64 reference per sequence by the 2x rule."""
    dtype = torch.bfloat16
    (q, k_cache, v_cache, k_new, v_new, seqlens, table, k_pages, v_pages, after_k,
     after_v) = _setup(dtype, 3, 3)  # fmt: skip
    kc, vc, bt = (k_pages, v_pages, table) if paged else (k_cache, v_cache, None)
    b, h = q.shape[0], q.shape[2]
    g = torch.Generator().manual_seed(4)
    kw = dict(window_size=variant.get("window_size", (-1, -1)),
              softcap=variant.get("softcap", 0.0))  # fmt: skip
    if "alibi" in variant:
        shape = (h,) if variant["alibi"] == "heads" else (b, h)
        kw["alibi_slopes"] = (torch.rand(shape, generator=g) * 0.2).to(DEVICE)
    if variant.get("sinks"):
        kw["sinks"] = torch.randn(h, generator=g).to(DEVICE, dtype)
    with torch.no_grad():
        out = diyfa.flash_attention_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens,
                                                 block_table=bt, num_splits=3, **kw)
    ref_kw = dict(window=None if kw["window_size"] == (-1, -1) else kw["window_size"],
                  softcap=kw["softcap"])  # fmt: skip

    def reference(cdt):
        outs = []
        for i, n in enumerate(n + 3 for n in LENS):
            slopes = kw.get("alibi_slopes")
            if slopes is not None and slopes.dim() == 2:
                slopes = slopes[i]
            sinks = kw.get("sinks")
            outs.append(attention_ref(
                q[i:i + 1], after_k[i:i + 1, :n], after_v[i:i + 1, :n], causal=True,
                layout="bshd", compute_dtype=cdt, alibi_slopes=slopes,
                sinks=sinks.to(cdt) if sinks is not None else None, **ref_kw))
        return torch.cat(outs)

    _check("out", out, reference(dtype), reference(torch.float64), 2, dtype)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("d, dv, dtype", [(48, 16, torch.bfloat16), (32, 80, torch.float32),
                                          (64, 32, torch.float16)],
                         ids=["d48-dv16", "d32-dv80", "d64-dv32"])  # fmt: skip
def test_kvcache_value_head_dim(d, dv, dtype, paged):
    """A value head dim other than q's and k's (MLA-style, e.g. 192 / 128): the v cache and
    the new v rows in it, the output in it; a 3-token append over 3 splits and a decode
    step, against the float64 reference per sequence by the 2x rule."""
    for sq, s_new in ((3, 3), (1, 0)):
        (q, k_cache, v_cache, k_new, v_new, seqlens, table, k_pages, v_pages, after_k,
         after_v) = _setup(dtype, sq, s_new, d=d, dv=dv)  # fmt: skip
        kc, vc, bt = (k_pages, v_pages, table) if paged else (k_cache, v_cache, None)
        with torch.no_grad():
            out, lse = diyfa.flash_attention_with_kvcache(
                q, kc, vc, k_new, v_new, cache_seqlens=seqlens, block_table=bt,
                num_splits=3, return_lse=True)  # fmt: skip
        assert out.shape == (q.shape[0], sq, q.shape[2], dv)
        lengths = [n + s_new for n in LENS]
        ref = _reference(q.double(), after_k.double(), after_v.double(), lengths, True,
                         torch.float64)  # fmt: skip
        _check("out", out, _reference(q, after_k, after_v, lengths, True, dtype), ref, 2, dtype)
        if not paged:
            assert torch.equal(v_cache, after_v)


@pytest.mark.parametrize("latent, paged, dtype", [
    (True, False, torch.bfloat16), (True, True, torch.bfloat16), (False, False, torch.bfloat16),
    (False, True, torch.bfloat16), (False, False, torch.float32), (True, False, torch.float16),
], ids=["one-latent-cache", "one-latent-cache-paged", "two-caches", "two-caches-paged",
        "two-caches-fp32", "one-latent-cache-fp16"])
def test_kvcache_mla_decode_form(latent, paged, dtype, monkeypatch):
    """DeepSeek's MLA in its decode form: q/k head dim 576 (512 latent + 64 rope columns),
    value head dim 512, one kv head for 16 query heads (two chunks, 512 + 64:
    decode.head_chunks). One latent cache, v_cache = k_cache[..., :512] (the split kernel
    reads the key tile as the value tile, V_IN_K; the append writes the keys only), or two
    caches; a 3-token append and a decode step over 3 splits, against float64 per sequence
    by the 2x rule."""
    from diyfa.attention import decode

    seen = []
    launch = decode.launch_recorded

    def spy(fn, grid, args, *rest, **kw):
        if fn is decode._decode_split:
            seen.append((args["HEAD_DIM_PAD"], args["HEAD_DIM_TAIL"], args["V_IN_K"]))
        if fn is decode._append:
            seen.append(("append writes v", args["WRITE_V"]))
        return launch(fn, grid, args, *rest, **kw)

    monkeypatch.setattr(decode, "launch_recorded", spy)
    for sq, s_new in ((3, 3), (1, 0)):
        (q, k_cache, v_cache, k_new, v_new, seqlens, table, k_pages, v_pages, after_k,
         after_v) = _setup(dtype, sq, s_new, h=16, hk=1, d=576, dv=512)  # fmt: skip
        if latent:
            v_cache, v_pages, after_v = k_cache[..., :512], k_pages[..., :512], after_k[..., :512]
            v_new = None if k_new is None else k_new[..., :512]
        kc, vc, bt = (k_pages, v_pages, table) if paged else (k_cache, v_cache, None)
        seen.clear()
        with torch.no_grad():
            out = diyfa.flash_attention_with_kvcache(q, kc, vc, k_new, v_new,
                                                     cache_seqlens=seqlens, block_table=bt,
                                                     num_splits=3)  # fmt: skip
        assert (512, 64, latent) in seen, seen
        if s_new:
            assert ("append writes v", not latent) in seen, seen
        assert out.shape == (q.shape[0], sq, q.shape[2], 512)
        lengths = [n + s_new for n in LENS]
        ref = _reference(q.double(), after_k.double(), after_v.double(), lengths, True,
                         torch.float64)  # fmt: skip
        _check("out", out, _reference(q, after_k, after_v, lengths, True, dtype), ref, 2, dtype)
        if not paged:  # the append wrote exactly the new rows
            assert torch.equal(k_cache, after_k) and torch.equal(v_cache, after_v)
        else:
            for i, n in enumerate(LENS):
                for j in range(n, n + s_new):
                    assert torch.equal(k_pages[table[i, j // 16], j % 16], after_k[i, j])
                    assert torch.equal(v_pages[table[i, j // 16], j % 16], after_v[i, j])


def test_kvcache_mla_latent_cache_under_torch_compile():
    """One latent cache through the custom op (torch.compile, fullgraph): v_cache and v are
    views of k_cache and k (aliased mutated inputs of diyfa::attention_kvcache); the output
    and the appended cache equal the eager call's bitwise."""
    (q, k_cache, _, k_new, _, seqlens, *_) = _setup(torch.bfloat16, 1, 1, h=4, hk=1, d=576,
                                                     dv=512)  # fmt: skip

    def step(q, kc, kn, lens):
        return diyfa.flash_attention_with_kvcache(q, kc, kc[..., :512], kn, kn[..., :512],
                                                  cache_seqlens=lens)  # fmt: skip

    eager_cache, compiled_cache = k_cache.clone(), k_cache.clone()
    with torch.no_grad():
        eager = step(q, eager_cache, k_new, seqlens)
        out = torch.compile(step, fullgraph=True, backend="aot_eager")(q, compiled_cache, k_new,
                                                                       seqlens)  # fmt: skip
    assert torch.equal(out, eager) and torch.equal(compiled_cache, eager_cache)
    assert not torch.equal(eager_cache, k_cache)  # the append wrote


def test_kvcache_mla_bad_inputs():
    """Head dims past MLA's (q/k 576, values 512) are refused with the accepted range; with
    one latent cache (v_cache = k_cache[..., :512]) the new values must be the new keys'
    leading columns, and an fp8 latent cache takes one descale for both: clear errors, and
    nothing written to the cache."""
    dtype = torch.bfloat16
    (q, k_cache, _, k_new, _, seqlens, *_) = _setup(dtype, 1, 1, h=4, hk=1, d=576, dv=512)
    v_cache, before = k_cache[..., :512], k_cache.clone()
    with torch.no_grad(), pytest.raises(ValueError, match="new keys' leading columns"):
        diyfa.flash_attention_with_kvcache(q, k_cache, v_cache, k_new,
                                           torch.zeros_like(k_new[..., :512]),
                                           cache_seqlens=seqlens)  # fmt: skip
    assert torch.equal(k_cache, before)
    wide = torch.zeros(3, 8, 1, 577, dtype=dtype, device=DEVICE)
    with torch.no_grad(), pytest.raises(ValueError, match="head_dim in 1..576, got q 577"):
        diyfa.flash_attention_with_kvcache(wide[:, :1], wide, wide[..., :512],
                                           cache_seqlens=seqlens)  # fmt: skip
    with torch.no_grad(), pytest.raises(ValueError, match="v_cache's head_dim must be in "
                                                          "1..512, got 513"):
        diyfa.flash_attention_with_kvcache(wide[:, :1, :, :576], wide[..., :576],
                                           wide[..., :513], cache_seqlens=seqlens)  # fmt: skip
    if DEVICE != "cpu" and torch.cuda.get_device_capability() < (8, 9):
        return
    k8 = torch.zeros(3, 8, 1, 576, dtype=torch.float8_e4m3fn, device=DEVICE)
    one = torch.ones(1, dtype=torch.float32, device=DEVICE)
    with torch.no_grad(), pytest.raises(ValueError, match="same tensor as k_descale"):
        diyfa.flash_attention_with_kvcache(q, k8, k8[..., :512], cache_seqlens=seqlens,
                                           k_descale=one, v_descale=one.clone())  # fmt: skip


def test_splits_merge_to_the_unsplit_result():
    q, k_cache, v_cache, *_ = _setup(torch.float32, 1, 0)
    seqlens = torch.tensor([150, 299, 64], dtype=torch.int32, device=q.device)
    outs = [diyfa.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                               num_splits=n, return_lse=True)
            for n in (1, 2, 5)]  # fmt: skip
    for out, lse in outs[1:]:
        torch.testing.assert_close(out, outs[0][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, outs[0][1], rtol=1e-5, atol=1e-6)


def _bad_call(over):
    q, k_cache, v_cache, k_new, v_new, seqlens, table, k_pages, v_pages, *_ = _setup(
        torch.float16, 1, 1)
    args = dict(q=q, k_cache=k_pages, v_cache=v_pages, k=k_new, v=v_new, cache_seqlens=seqlens,
                block_table=table)  # fmt: skip
    args.update(over(args))
    return args


@pytest.mark.parametrize("over, err, match", [
    (lambda a: dict(cache_seqlens=a["cache_seqlens"].long()), TypeError,
     "cache_seqlens.dtype is torch.int64; accepted: int32"),
    (lambda a: dict(cache_seqlens=torch.tensor([0, 70, 304], dtype=torch.int32,
                                               device=DEVICE)), ValueError,
     "cache_seqlens\\[2\\] = 304 plus 1 new tokens does not fit the cache \\(304 rows"),
    (lambda a: dict(cache_seqlens=torch.tensor([0, -1, 5], dtype=torch.int32, device=DEVICE)),
     ValueError, "cache_seqlens\\[1\\] = -1"),
    (lambda a: dict(cache_seqlens=torch.tensor([0, 2**31 - 1, 5], dtype=torch.int32,
                                               device=DEVICE)),
     ValueError, "cache_seqlens\\[1\\] = 2147483647 plus 1 new tokens does not fit"),
    (lambda a: dict(block_table=a["block_table"].clone().index_fill_(
        1, torch.tensor([0], device=DEVICE), 999)), ValueError,
     "block_table\\[0\\] points outside the pool of 62 pages: \\[999\\]"),
    (lambda a: dict(block_table=a["block_table"].long()), TypeError,
     "block_table.dtype is torch.int64"),
    (lambda a: dict(v=None), ValueError, "k and v must be given together"),
    (lambda a: dict(k=a["k"][:, :, :1], v=a["v"][:, :, :1]), ValueError,
     "k and v must be \\(batch=3, new tokens, kv_heads=2, head_dim=32 / 32\\)"),
    (lambda a: dict(q=a["q"].float()), TypeError, "k_cache.dtype is torch.float16, q's is"),
    (lambda a: dict(q=a["q"][:, :, :3]), ValueError, "q heads \\(3\\) must be a multiple"),
    (lambda a: dict(block_table=None), ValueError, "a contiguous cache must be \\(batch=3"),
    (lambda a: dict(num_splits=-2), TypeError, "num_splits must be an int >= 0"),
    (lambda a: dict(q=a["q"].clone().requires_grad_()), ValueError, "has no backward"),
    (lambda a: dict(cache_seqlens=torch.tensor([0, 9, 70, 9, 200, 9], dtype=torch.int32,
                                               device=DEVICE)[::2]),
     ValueError, "cache_seqlens must be contiguous"),
    (lambda a: dict(block_table=a["block_table"].t().contiguous().t()), ValueError,
     "block_table must be contiguous"),
    (lambda a: dict(num_splits=129), ValueError, "num_splits must be at most 128"),
    (lambda a: dict(k_cache=a["k_cache"][:, :0], v_cache=a["v_cache"][:, :0], k=None, v=None,
                    cache_seqlens=torch.zeros(3, dtype=torch.int32, device=DEVICE)),
     ValueError, "pages of >= 1 token, got page_size 0"),
], ids=["int64-seqlens", "past-cache", "negative", "int32-max", "page-outside", "int64-table",
        "k-only", "k-heads", "dtypes", "heads", "contiguous-batch", "splits", "requires-grad",
        "strided-seqlens", "column-major-table", "too-many-splits", "page-size-0"])
def test_kvcache_bad_input_is_a_clear_error_and_writes_nothing(over, err, match):
    args = _bad_call(over)
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    with pytest.raises(err, match=match):
        diyfa.flash_attention_with_kvcache(**args)
    assert torch.equal(args["k_cache"], before[0]) and torch.equal(args["v_cache"], before[1])


def test_kvcache_append_batch_past_the_grid_is_a_clear_error(monkeypatch):
    """The append puts the sequences on its grid's second axis (CUDA: 65535 programs, made 2
    here): a bigger batch with new tokens is refused before anything runs, the cache
    untouched; without new tokens the same batch attends."""
    from diyfa.attention import checks

    monkeypatch.setattr(checks, "MAX_APPEND_BATCH", 2)
    args = _bad_call(lambda a: {})
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    with pytest.raises(ValueError, match="appended to at most 2 sequences a call .* batch of 3"):
        diyfa.flash_attention_with_kvcache(**args)
    assert torch.equal(args["k_cache"], before[0]) and torch.equal(args["v_cache"], before[1])
    with torch.no_grad():
        diyfa.flash_attention_with_kvcache(**{**args, "k": None, "v": None})


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_max_seqlen_k_reads_nothing_back(paged, monkeypatch):
    """``max_seqlen_k`` given: no read back (``Tensor.tolist`` / ``item`` fail here), the
    same result bitwise as the checked call when the bound is the longest length, and the
    2x rule when it is the cache's capacity (other split ranges)."""
    (q, k_cache, v_cache, k_new, v_new, seqlens, table, k_pages, v_pages, after_k,
     after_v) = _setup(torch.bfloat16, 1, 1)  # fmt: skip
    kc, vc, bt = (k_pages, v_pages, table) if paged else (k_cache, v_cache, None)
    args = dict(cache_seqlens=seqlens, block_table=bt, num_splits=0)
    with torch.no_grad():
        want = diyfa.flash_attention_with_kvcache(q, kc.clone(), vc.clone(), k_new, v_new,
                                                  **args)  # fmt: skip

        def no_read_back(*a, **kw):
            raise AssertionError("read back to the host")

        monkeypatch.setattr(torch.Tensor, "tolist", no_read_back)
        monkeypatch.setattr(torch.Tensor, "item", no_read_back)
        monkeypatch.setattr(torch.Tensor, "__bool__", no_read_back)
        longest = max(LENS) + 1
        got = diyfa.flash_attention_with_kvcache(q, kc.clone(), vc.clone(), k_new, v_new,
                                                 max_seqlen_k=longest, **args)  # fmt: skip
        capacity = table.shape[1] * 16 if paged else k_cache.shape[1]
        kc2, vc2 = kc.clone(), vc.clone()
        wide = diyfa.flash_attention_with_kvcache(q, kc2, vc2, k_new, v_new,
                                                  max_seqlen_k=capacity, **args)  # fmt: skip
    monkeypatch.undo()
    assert torch.equal(got, want)
    lengths = [n + 1 for n in LENS]
    ref = _reference(q.double(), after_k.double(), after_v.double(), lengths, True,
                     torch.float64)  # fmt: skip
    _check("out", wide, _reference(q, after_k, after_v, lengths, True, torch.bfloat16), ref, 2,
           torch.bfloat16)  # fmt: skip
    if not paged:
        assert torch.equal(kc2, after_k) and torch.equal(vc2, after_v)


@pytest.mark.parametrize("over", [
    lambda a: dict(cache_seqlens=torch.tensor([0, 70, 250], dtype=torch.int32, device=DEVICE)),
    lambda a: dict(cache_seqlens=torch.tensor([0, -1, 5], dtype=torch.int32, device=DEVICE)),
    lambda a: dict(block_table=a["block_table"].clone().index_fill_(
        1, torch.tensor([0], device=DEVICE), 999)),
], ids=["past-bound", "negative", "page-outside"])
def test_kvcache_max_seqlen_k_violation_asserts_and_writes_nothing(over):
    """The bound broken (a length past max_seqlen_k, a negative one, a used page outside
    the pool): the assert (on the CPU, a RuntimeError) comes before the append. On a GPU it
    is a device-side assert, which ends the process's CUDA context: see the subprocess test
    below."""
    if DEVICE != "cpu":
        pytest.skip("a device-side assert would end this process's CUDA context")
    args = _bad_call(over)
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    with pytest.raises(RuntimeError, match="outside \\[0, max_seqlen_k\\], or a page"):
        diyfa.flash_attention_with_kvcache(**args, max_seqlen_k=201)
    assert torch.equal(args["k_cache"], before[0]) and torch.equal(args["v_cache"], before[1])


_ASSERT_ON_GPU = """
import torch, diyfa
q = torch.randn(2, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
cache = torch.randn(2, 100, 2, 64, device="cuda", dtype=torch.bfloat16)
lens = torch.tensor([10, 99], dtype=torch.int32, device="cuda")
k = torch.randn(2, 1, 2, 64, device="cuda", dtype=torch.bfloat16)
diyfa.flash_attention_with_kvcache(q, cache, cache.clone(), k, k, cache_seqlens=lens,
                                   max_seqlen_k=50)
torch.cuda.synchronize()
print("no assert")
"""


@pytest.mark.gpu
def test_gpu_kvcache_max_seqlen_k_violation_is_a_device_assert():
    """On a GPU a length past max_seqlen_k stops the stream with a device-side assert (in a
    subprocess: it ends that process's CUDA context), not a silent result."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _ASSERT_ON_GPU], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode != 0 and "no assert" not in done.stdout, done.stdout
    assert "device-side assert" in done.stderr, done.stderr[-2000:]
    assert "outside [0, max_seqlen_k]" in done.stderr, done.stderr[-2000:]  # the message


@pytest.mark.parametrize("value, err, match", [
    (2.5, TypeError, "max_seqlen_k must be an int or None, got 2.5"),
    (True, TypeError, "max_seqlen_k must be an int or None, got True"),
    (0, ValueError, "max_seqlen_k must be in \\[1 \\(the new tokens\\), 304"),
    (305, ValueError, "max_seqlen_k must be in .* got 305"),
])
def test_kvcache_bad_max_seqlen_k(value, err, match):
    args = _bad_call(lambda a: {})
    with pytest.raises(err, match=match):
        diyfa.flash_attention_with_kvcache(**args, max_seqlen_k=value)


def test_pick_splits_fills_whole_waves(monkeypatch):
    """Whole waves (paged caches, decode.PAGED_WAVES; 3 programs per SM below): the fewest
    splits whose last wave is 90% full on a 132-SM GPU, as the H200 A/B found best; the
    others keep the programs-per-SM rule."""
    from diyfa.attention import decode

    monkeypatch.setattr(decode, "kernel_limits", lambda index: {"sm_count": 132})
    dev = torch.device("cuda", 0)
    want = {(16, 8, 16384): 3, (64, 8, 4096): 3, (4, 8, 65536): 12, (1, 8, 131072): 45,
            (16, 32, 16384): 3, (128, 8, 512): 1, (128, 8, 4096): 3}  # fmt: skip
    for (b, hk, n), splits in want.items():
        assert decode.pick_splits(b, hk, n, dev, 64, 3, True) == splits, (b, hk, n)
    assert decode.pick_splits(16, 8, 16384, dev, 128, 4) == 5  # cdiv(4 x 132, 128)
    assert decode.pick_splits(1, 8, 1000, dev, 64, 3, True) == 4  # ranges of >= 4 blocks
    assert decode.launch_config(True, 128, 128, 2, True) == (*decode.PAGED_WAVES, True)
    assert decode.launch_config(False, 128, 128, 2, True) == (*decode.WIDE, True)
    assert decode.launch_config(True, 128, 128, 1, True) == (*decode.PAGED_WAVES_FP8, True)
    assert decode.launch_config(False, 128, 128, 1, True) == (
        decode.BLOCK_N, decode.NUM_WARPS, decode.PROGRAMS_PER_SM, False)  # fp8: the defaults
    assert decode.launch_config(False, 128, 128, 4, True)[0] == decode.BLOCK_N  # fp32: default
    # one new token over pages of LARGE_PAGE keys or more with the keys split, or pages whose
    # size is not a power of two, at <= 16 rows a program: 64-key blocks, 3 per SM
    big = decode.LARGE_PAGE
    assert decode.launch_config(True, 128, 128, 2, True, page=big, split_one_token=True) == (
        *decode.PAGED_WAVES_LARGE_PAGES, True)
    assert decode.launch_config(True, 128, 128, 2, True, page=big) == (*decode.PAGED_WAVES, True)
    assert decode.launch_config(True, 128, 128, 2, True, page=big // 2,
                                split_one_token=True) == (*decode.PAGED_WAVES, True)
    assert decode.launch_config(True, 128, 128, 2, True, page=12) == (  # (not a power of two)
        *decode.PAGED_WAVES_LARGE_PAGES, True)
    # 8 new tokens x a group of 4 = 32 rows a program: PAGED_WAVES at any page size (16-bit)
    for page in (16, big, 2 * big):
        assert decode.launch_config(True, 128, 128, 2, True, block_m=32, page=page) == (
            *decode.PAGED_WAVES, True)
    assert decode.launch_config(True, 128, 128, 1, True, block_m=32)[2] == 2  # fp8
    # ... and contiguous ones take WIDE_MULTI's launch
    assert decode.launch_config(False, 128, 128, 2, True, block_m=32) == (
        *decode.WIDE_MULTI, True)
    assert decode.pick_splits(16, 8, 16384, dev, 64, 2, True) == 2  # 256 of 264 slots
    # where WIDE's launch applies (above: not paged, fp8, fp32 or 32 rows), short caches with
    # (batch, kv head) pairs for two waves of two programs per SM take SHORT's
    assert decode.short_cache(512, 128 * 8, 132) and decode.short_cache(1024, 64 * 8, 132)
    assert not decode.short_cache(1025, 128 * 8, 132)  # longer: WIDE
    assert not decode.short_cache(1024, 16 * 8, 132)  # fewer pairs: WIDE (b16 x 1024 lost)
    assert decode.split_stages(128, 128, 2, 232448, 64, decode.SHORT_STAGES) == 4
    assert decode.split_stages(128, 128, 2, 232448, 64) == 3
    # Contiguous 16-bit caches (decode.WIDE: one resident program per SM): the fewest splits
    # that fill 90% of one wave of 132 SMs, or one split where the pairs fill waves already
    block_n, _, per_sm, waves = decode.launch_config(False, 128, 128, 2, True)
    want = {(1, 8, 131072): 15, (2, 8, 131072): 8, (4, 8, 65536): 4, (8, 8, 32768): 2,
            (16, 8, 16384): 1, (64, 8, 4096): 1, (128, 8, 512): 1, (16, 32, 16384): 1}
    for (b, hk, n), splits in want.items():
        assert decode.pick_splits(b, hk, n, dev, block_n, per_sm, waves) == splits, (b, hk, n)


def test_cache_status_codes():
    """The device check's verdict per sequence: the length after the append, -1 outside
    [s_new, limit], -2 a used page outside the pool (an unused one does not count)."""
    from diyfa.attention.decode import cache_status

    seqlens = torch.tensor([0, 17, 40, -3, 33], dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[0, -1, -1], [1, 2, 9], [3, 4, 5], [0, 0, 0], [6, 7, 99]],
                         dtype=torch.int32, device=DEVICE)  # fmt: skip
    got = cache_status(seqlens, table, 1, 48, 10, 16).tolist()
    assert got == [1, 18, 41, -1, -2]
    got = cache_status(seqlens, None, 8, 47, 0, 1).tolist()
    assert got == [8, 25, -1, -1, 41]
    # lengths near int32's top: compared in int64 (n + s_new wrapped around before)
    top = torch.tensor([2**31 - 1, 2**31 - 2], dtype=torch.int32, device=DEVICE)
    assert cache_status(top, None, 1, 100, 0, 1).tolist() == [-1, -1]


_COMPILE_DECODE = """
import torch
from diyfa._compile import compile_for_sm90
from diyfa.attention import decode

for fp8 in (False, True):  # a bf16 cache, and an e4m3 one with its descales
    tensors = {"BLOCK_TABLE": torch.int32, "CACHE_SEQLENS": torch.int32, "STATUS": torch.int32,
               "COUNTERS": torch.int32,
               "O_PART": torch.float32, "LSE_PART": torch.float32, "LSE": torch.float32,
               "SLOPES": torch.float32, "K_DESCALE": torch.float32, "V_DESCALE": torch.float32}
    if fp8:
        tensors.update(K=torch.float8_e4m3fn, V=torch.float8_e4m3fn,
                       K_CACHE=torch.float8_e4m3fn, V_CACHE=torch.float8_e4m3fn)
    args = dict(qk_scale=0.5, tanh_scale=0.1, HEAD_DIM=128, HEAD_DIM_PAD=128, HEAD_DIM_V=128,
                HEAD_DIM_V_PAD=128, CAUSAL=True,
                PAGED=True, PRECISION="tf32", WINDOW=True, SOFTCAP=True, ALIBI=True,
                SINKS=True, FP8=fp8, BLOCK_M=16, BLOCK_N=64, NUM_SPLITS=4, BLOCK_P=1024,
                ASSERT=True, BLOCK_H=8, BLOCK_D=128, BLOCK_DV=128, DIRECT=False, PDL=True,
                PDL_WAIT=True, PAGE=16, HEAD_DIM_TAIL=0, V_IN_K=False, WRITE_V=True, MERGE=True)
    for fn in (decode._decode_split, decode._combine, decode._cache_status, decode._append):
        values = {p.name: args.get(p.name, torch.empty(16, dtype=tensors.get(
            p.name, torch.bfloat16)) if p.name.isupper() else 17) for p in fn.params}
        compile_for_sm90(fn, values, num_warps=4, num_stages=2)
    # the contiguous and paged caches' launches (decode.WIDE / PAGED_WAVES, their fp8
    # versions), no variant; the contiguous one writing its output directly (one split)
    for paged, launch, rows in ((False, decode.WIDE, 16),
                                (True, decode.PAGED_WAVES_FP8 if fp8 else decode.PAGED_WAVES, 16),
                                (True, decode.PAGED_WAVES, 32),
                                (True, decode.PAGED_WAVES_LARGE_PAGES, 16)):  # fmt: skip
        block_n, warps, _ = launch
        plain = dict(args, BLOCK_N=block_n, PAGED=paged, WINDOW=False, SOFTCAP=False,
                     ALIBI=False, DIRECT=not paged, BLOCK_M=rows)  # fmt: skip
        values = {p.name: plain.get(p.name, torch.empty(16, dtype=tensors.get(
            p.name, torch.bfloat16)) if p.name.isupper() else 17)
                  for p in decode._decode_split.params}
        compile_for_sm90(decode._decode_split, values, num_warps=warps, num_stages=3)
    if fp8:  # (SHORT: 16-bit caches only)
        continue
    # SHORT's launch: 64-key blocks, 4 stages, within an H100 / H200 block's shared memory
    block_n, warps, _ = decode.SHORT
    # (unit strides for the head dim, the rest multiples of 16: the copies pipelined)
    short = dict(args, BLOCK_N=block_n, PAGED=False, WINDOW=False, SOFTCAP=False, ALIBI=False,
                 DIRECT=True, FP8=False)
    values = {p.name: short.get(p.name, torch.empty(16, dtype=tensors.get(p.name, torch.bfloat16))
                                if p.name.isupper() else 1 if p.name.startswith("stride")
                                and p.name.endswith("d") else 1024)
              for p in decode._decode_split.params}  # fmt: skip
    k = compile_for_sm90(decode._decode_split, values, num_warps=warps,
                         num_stages=decode.SHORT_STAGES)
    assert 3 * 64 * 256 * 2 <= k.metadata.shared <= 232448, k.metadata.shared
print("compiled")
"""


_COMPILE_PDL = """
import torch
from diyfa._compile import compile_for_sm90
from diyfa.attention import decode

def values(fn, **args):
    # realistic specialisation: unit strides for the head dim, the rest multiples of 16
    return {p.name: args.get(p.name, torch.empty(16, dtype=torch.int32 if p.name in (
        "BLOCK_TABLE", "CACHE_SEQLENS", "COUNTERS") else torch.bfloat16)) if p.name.isupper() else (
        1 if p.name.startswith("stride") and p.name.endswith("d") else 1024) for p in fn.params}

def first(ptx, *needles):
    lines = ptx.splitlines()
    return min((i for i, line in enumerate(lines) if any(n in line for n in needles)),
               default=None)

def last(ptx, *needles):
    lines = ptx.splitlines()
    return max((i for i, line in enumerate(lines) if any(n in line for n in needles)),
               default=None)

base = dict(qk_scale=0.5, tanh_scale=0.1, HEAD_DIM=128, HEAD_DIM_PAD=128, HEAD_DIM_V=128,
            HEAD_DIM_V_PAD=128, CAUSAL=True, PRECISION="tf32", WINDOW=False, SOFTCAP=False,
            ALIBI=False, FP8=False, BLOCK_M=16, BLOCK_N=128, DIRECT=False, PDL=True,
            PAGE=16, HEAD_DIM_TAIL=0, V_IN_K=False, MERGE=False, SINKS=False)
for paged in (False, True):
    ptx = compile_for_sm90(decode._decode_split, values(decode._decode_split, **base,
                           PAGED=paged, PDL_WAIT=True), num_warps=8, num_stages=3).asm["ptx"]
    wait, copy = first(ptx, "griddepcontrol.wait"), first(ptx, "cp.async.cg", "cp.async.ca")
    assert wait is not None and copy is not None and wait < copy, (paged, wait, copy)
    assert "griddepcontrol.launch_dependents" in ptx
    ptx = compile_for_sm90(decode._decode_split, values(decode._decode_split, **base,
                           PAGED=paged, PDL_WAIT=False), num_warps=8, num_stages=3).asm["ptx"]
    assert "griddepcontrol.wait" not in ptx
    # merging in the split kernel: it waits for the check (which zeroes the counters) after
    # its last cache copy and before it counts
    ptx = compile_for_sm90(decode._decode_split, values(decode._decode_split, **dict(
        base, MERGE=True), PAGED=paged, PDL_WAIT=False), num_warps=8, num_stages=3).asm["ptx"]
    wait, copy, count = (first(ptx, "griddepcontrol.wait"), last(ptx, "cp.async.cg", "cp.async.ca"),
                         first(ptx, "atom.global.gpu.acq_rel.add"))
    assert None not in (wait, copy, count) and copy < wait < count, (paged, wait, copy, count)
ptx = compile_for_sm90(decode._combine, values(decode._combine, NUM_SPLITS=4, HEAD_DIM=128,
                       HEAD_DIM_PAD=128, SINKS=False, PDL=True), num_warps=4,
                       num_stages=3).asm["ptx"]
assert first(ptx, "griddepcontrol.wait") < first(ptx, "ld.global"), "combine reads first"
ptx = compile_for_sm90(decode._append, values(decode._append, HEAD_DIM=128, HEAD_DIM_V=128,
                       BLOCK_H=8, BLOCK_D=128, BLOCK_DV=128, PAGED=True, FP8=False, PDL=True,
                       WRITE_V=True),
                       num_warps=4, num_stages=1).asm["ptx"]
assert first(ptx, "griddepcontrol.wait") < first(ptx, "st.global"), "append writes first"
ptx = compile_for_sm90(decode._cache_status, values(decode._cache_status, PAGED=True,
                       BLOCK_P=1024, ASSERT=True, PDL=True), num_warps=4, num_stages=1).asm["ptx"]
assert "griddepcontrol.launch_dependents" in ptx and "griddepcontrol.wait" not in ptx
print("ordered")
"""


def test_decode_pdl_waits_before_it_reads_or_writes():
    """Programmatic dependent launch (decode.PDL): in the sm90 PTX the split kernel that
    follows an append waits for it before its first cache copy (and without an append does
    not wait), the combine waits before it reads the splits, the append before it writes,
    and the device check lets the next kernel launch at once."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_PDL], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0 and "ordered" in done.stdout, done.stderr[-3000:]


def test_decode_kernels_compile_for_hopper():
    """The split-KV, combine, check and append kernels compile for sm90, every variant on,
    with a bf16 and an fp8 cache (the interpreter does not compile)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_DECODE], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


_COMPILE_FP32_D256 = """
import torch
from diyfa._compile import compile_for_sm90
from diyfa.attention import decode

H100_SHARED = 232448  # bytes a block may opt into on H100 / H200
stages = decode.split_stages(256, 256, 4, H100_SHARED)
tensors = {"BLOCK_TABLE": torch.int32, "CACHE_SEQLENS": torch.int32, "COUNTERS": torch.int32}
args = dict(qk_scale=0.5, tanh_scale=0.1, HEAD_DIM=147, HEAD_DIM_PAD=256, HEAD_DIM_V=147,
            HEAD_DIM_V_PAD=256, CAUSAL=True, PAGED=False, PRECISION="ieee", WINDOW=False,
            SOFTCAP=False, ALIBI=False, FP8=False, BLOCK_M=16, BLOCK_N=64, DIRECT=False,
            PDL=False, PDL_WAIT=False, PAGE=0, HEAD_DIM_TAIL=0, V_IN_K=False, MERGE=True,
            SINKS=False)
values = {p.name: args.get(p.name, torch.empty(16, dtype=tensors.get(p.name, torch.float32))
          if p.name.isupper() else 17) for p in decode._decode_split.params}
kernel = compile_for_sm90(decode._decode_split, values, num_warps=4, num_stages=stages)
print("shared", kernel.metadata.shared, "stages", stages, "limit", H100_SHARED)
"""


def test_split_stages_fit_the_shared_memory():
    """fp32 at padded head dim 256 asked 282,688 bytes at 3 stages on an H200 (a crash inside
    Triton, found by the GPU fuzz): the split kernel now runs fewer stages where its K and V
    tiles would not fit. The rule, then the kernel compiled for sm90 at that depth."""
    import os
    import subprocess
    import sys

    from diyfa.attention.decode import split_stages

    limit = 232448
    assert split_stages(128, 128, 2, limit) == 3  # the measured bf16 d128 decode path
    assert split_stages(256, 256, 2, limit) == 3
    assert split_stages(256, 256, 4, limit) == 2
    assert split_stages(256, 256, 1, limit) == 3  # fp8 cache
    assert split_stages(512, 512, 4, limit) == 1
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FP32_D256], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    words = done.stdout.split()
    assert int(words[1]) <= limit, done.stdout


_COMPILE_MLA = """
import os, subprocess, sys, tempfile
import torch, triton
from diyfa._compile import compile_for_sm90
from diyfa.attention import decode

H100_SHARED = 232448
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
d_pad, tail = decode.head_chunks(576)
assert (d_pad, tail) == (512, 64)
# (the cache's dtype, one latent cache, paged, query rows a program)
for cache, latent, paged, rows in (("bf16", True, False, 16), ("bf16", True, False, 64),
                                   ("bf16", False, True, 64), ("bf16", False, False, 16),
                                   ("fp8", True, False, 16), ("fp8", False, True, 16),
                                   ("fp32", False, False, 16)):
    size, fp8 = {"bf16": 2, "fp8": 1, "fp32": 4}[cache], cache == "fp8"
    block_n, warps, _, _ = decode.launch_config(paged, 576, 512, size, True, rows, latent)
    data = {"bf16": {}, "fp8": {"K": torch.float8_e4m3fn, "V": torch.float8_e4m3fn},
            "fp32": dict.fromkeys(("Q", "K", "V", "O"), torch.float32)}[cache]
    args = dict(qk_scale=0.5, tanh_scale=0.1, HEAD_DIM=576, HEAD_DIM_PAD=d_pad, HEAD_DIM_V=512,
                HEAD_DIM_V_PAD=512, CAUSAL=True, PAGED=paged,
                PRECISION="ieee" if size == 4 else "tf32", WINDOW=False,
                SOFTCAP=False, ALIBI=False, FP8=fp8, BLOCK_M=rows,
                BLOCK_N=block_n, DIRECT=False, PDL=True, PDL_WAIT=True, PAGE=64 if paged else 0,
                HEAD_DIM_TAIL=tail, V_IN_K=latent, MERGE=False,
                SINKS=False)  # (value heads of 512: the combine kernel merges)
    values = {p.name: args.get(p.name, torch.empty(16, dtype=data.get(p.name, torch.int32 if
              p.name in ("BLOCK_TABLE", "CACHE_SEQLENS", "COUNTERS") else torch.float32 if p.name
              in (
              "O_PART", "LSE_PART", "LSE", "K_DESCALE", "V_DESCALE") else torch.bfloat16)))
              if p.name.isupper() else (1 if p.name.startswith("stride") and p.name.endswith("d")
              else 1024) for p in decode._decode_split.params}
    stages = decode.split_stages(d_pad + tail, 0 if latent else 512, size, H100_SHARED, block_n,
                                 decode.WIDE_HEAD_STAGES if rows > 16 else 3)  # fmt: skip
    k = compile_for_sm90(decode._decode_split, values, num_warps=warps, num_stages=stages)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    log = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    where = (cache, latent, paged, rows, stages)
    assert k.metadata.shared <= H100_SHARED, (where, k.metadata.shared)
    assert ", 0 bytes spill stores" in log, (where, log)
print("compiled")
"""


_COMPILE_MLA_SMALL = """
import torch
from diyfa._compile import compile_for_sm90
from diyfa.attention import decode

SM89_SHARED = 101376  # bytes a block may opt into on sm86 / sm89 (A10, L4, L40S, RTX 30/40)
d_pad, tail = decode.head_chunks(576)
for cache, latent, paged in (("bf16", True, False), ("bf16", False, False), ("bf16", True, True),
                             ("fp32", False, False), ("fp32", True, True)):
    size = {"bf16": 2, "fp32": 4}[cache]
    rows = decode.wide_head_rows(size, SM89_SHARED)
    assert rows == 16, rows
    block_n, warps, _, _ = decode.launch_config(paged, 576, 512, size, True, rows, latent,
                                                SM89_SHARED)
    data = dict.fromkeys(("Q", "K", "V", "O"), torch.float32) if size == 4 else {}
    args = dict(qk_scale=0.5, tanh_scale=0.1, HEAD_DIM=576, HEAD_DIM_PAD=d_pad, HEAD_DIM_V=512,
                HEAD_DIM_V_PAD=512, CAUSAL=True, PAGED=paged,
                PRECISION="ieee" if size == 4 else "tf32", WINDOW=False, SOFTCAP=False,
                ALIBI=False, FP8=False, BLOCK_M=rows, BLOCK_N=block_n, DIRECT=False, PDL=False,
                PDL_WAIT=False, PAGE=64 if paged else 0, HEAD_DIM_TAIL=tail, V_IN_K=latent,
                MERGE=False, SINKS=False)
    values = {p.name: args.get(p.name, torch.empty(16, dtype=data.get(p.name, torch.int32 if
              p.name in ("BLOCK_TABLE", "CACHE_SEQLENS", "COUNTERS") else torch.float32 if p.name
              in (
              "O_PART", "LSE_PART", "LSE", "K_DESCALE", "V_DESCALE") else torch.bfloat16)))
              if p.name.isupper() else (1 if p.name.startswith("stride") and p.name.endswith("d")
              else 1024) for p in decode._decode_split.params}
    stages = decode.split_stages(d_pad + tail, 0 if latent else 512, size, SM89_SHARED,
                                 block_n)  # fmt: skip
    k = compile_for_sm90(decode._decode_split, values, num_warps=warps, num_stages=stages,
                         arch=89)  # fmt: skip
    assert k.metadata.shared <= SM89_SHARED, ((cache, latent, paged), k.metadata.shared)
print("fits")
"""


def test_mla_decode_fits_smaller_gpus():
    """On GPUs with less shared memory a block than an H100's (sm86 / sm89: 99 KB; A100: 163
    KB) wide heads run 16-row programs (decode.wide_head_rows), fp32 with 16-key blocks:
    compiled for sm89 at the stages decode.split_stages gives there, every launch fits
    (a launch that did not would fail after the append had written the cache)."""
    import os
    import subprocess
    import sys

    from diyfa.attention import decode

    assert decode.wide_head_rows(2, 232448) == decode.WIDE_HEAD_ROWS == 64  # H100 / H200
    assert decode.wide_head_rows(2, 166912) == 16  # A100
    assert decode.wide_head_rows(1, 232448) == decode.wide_head_rows(4, 232448) == 16
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_MLA_SMALL], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0 and "fits" in done.stdout, done.stderr[-3000:]


def test_latent_cache_recognised_through_axes_of_size_one():
    """checks.values_in_keys: v_cache as k_cache's leading columns, also when built so that
    an axis of size 1 (one kv head, one new token) has another stride in the two views;
    other storage, an offset start or another stride on a longer axis is not it."""
    from diyfa.attention.checks import values_in_keys

    buf = torch.zeros(3, 10, 576)
    k_cache, v_cache = buf.unsqueeze(2), buf[..., :512].unsqueeze(2)
    assert k_cache.stride() != v_cache.stride() and values_in_keys(k_cache, v_cache)
    k4 = torch.zeros(3, 10, 2, 576)
    assert values_in_keys(k4, k4[..., :512]) and values_in_keys(k4, k4)
    assert not values_in_keys(k4, k4[..., 64:])  # another start
    assert not values_in_keys(k4, k4.clone()[..., :512])  # another storage
    assert not values_in_keys(k4[:, :5], k4[:, ::2][..., :512])  # another row stride
    assert not values_in_keys(k4, None)


def test_mla_decode_kernel_compiles_and_fits():
    """The split kernel at MLA's head dims (576 / 512) compiles for sm90 in the launches
    decode.launch_config gives it (WIDE_HEAD at 16 query rows a program, WIDE_HEAD_GROUP /
    _TWO at 64 with WIDE_HEAD_STAGES), bf16 caches, fp8 and fp32 ones (16 rows), one latent
    cache or two, contiguous and paged, within an H100 / H200 block's shared memory and with
    nothing spilled (ptxas's report)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_MLA], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("h", [16, 128])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("latent", [True, False], ids=["one-latent-cache", "two-caches"])
def test_gpu_kvcache_mla(latent, paged, h):
    """MLA's decode form on the GPU (q/k 576, values 512, one kv head for 16 or 128 query
    heads: one 16-row block, or 2 (one token) / 8 (4 tokens) blocks of 64 rows): a decode
    step with its append, and 4 new tokens, over the default splits, against float64 per
    sequence by the 2x rule."""
    dtype = torch.bfloat16
    for sq in (1, 4):
        (q, k_cache, v_cache, k_new, v_new, seqlens, table, k_pages, v_pages, after_k,
         after_v) = _setup(dtype, sq, sq, h=h, hk=1, d=576, dv=512, device="cuda")  # fmt: skip
        if latent:
            v_cache, v_pages, after_v = k_cache[..., :512], k_pages[..., :512], after_k[..., :512]
            v_new = k_new[..., :512]
        kc, vc, bt = (k_pages, v_pages, table) if paged else (k_cache, v_cache, None)
        with torch.no_grad():
            out = diyfa.flash_attention_with_kvcache(q, kc, vc, k_new, v_new,
                                                     cache_seqlens=seqlens, block_table=bt)
        lengths = [n + sq for n in LENS]
        ref = _reference(q.double(), after_k.double(), after_v.double(), lengths, True,
                         torch.float64)  # fmt: skip
        _check("out", out, _reference(q, after_k, after_v, lengths, True, dtype), ref, 2, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8], ids=["1-token", "8-tokens"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_gpu_kvcache(paged, tokens):
    """New tokens appended and attended causally, against float64. 8 new tokens x a GQA
    group of 4 = 32 query rows a program: the launch for such programs (decode.WIDE_MULTI on
    a contiguous cache, PAGED_WAVES on a paged one)."""
    (q, k_cache, v_cache, k_new, v_new, seqlens, table, k_pages, v_pages, after_k,
     after_v) = _setup(torch.bfloat16, tokens, tokens, h=32, hk=8, d=128,
                       device="cuda")  # fmt: skip
    kc, vc, bt = (k_pages, v_pages, table) if paged else (k_cache, v_cache, None)
    with torch.no_grad():
        out = diyfa.flash_attention_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens,
                                                 block_table=bt)  # fmt: skip
    lengths = [n + tokens for n in LENS]
    ref = _reference(q.double(), after_k.double(), after_v.double(), lengths, True,
                     torch.float64)  # fmt: skip
    pt = _reference(q, after_k, after_v, lengths, True, torch.bfloat16)
    _check("out", out, pt, ref, 2, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_kvcache_appends_more_tokens_than_one_grid_axis():
    """70,000 new tokens in one call (a long prefill into the cache): more than the 65535
    programs a grid's second axis holds, so the append puts the tokens on the first one.
    Every appended row is bitwise the new token, the rows past them untouched, and the last
    query rows (which see every key) match float64 by the 2x rule."""
    g = torch.Generator(device="cpu").manual_seed(5)
    n_old, n_new, cap, hk, d = 50, 70_000, 70_100, 2, 64

    def rand(*shape):
        return torch.randn(*shape, generator=g).to("cuda", torch.bfloat16)

    k_cache, v_cache = rand(1, cap, hk, d), rand(1, cap, hk, d)
    q, k_new, v_new = rand(1, n_new, 4, d), rand(1, n_new, hk, d), rand(1, n_new, hk, d)
    tail_k, tail_v = k_cache[:, n_old + n_new:].clone(), v_cache[:, n_old + n_new:].clone()
    seqlens = torch.tensor([n_old], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        out = diyfa.flash_attention_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                 cache_seqlens=seqlens)  # fmt: skip
    assert torch.equal(k_cache[:, n_old:n_old + n_new], k_new)
    assert torch.equal(v_cache[:, n_old:n_old + n_new], v_new)
    assert torch.equal(k_cache[:, n_old + n_new:], tail_k)
    assert torch.equal(v_cache[:, n_old + n_new:], tail_v)
    keys = n_old + n_new
    rows = q[:, -64:]
    kv = [t[:, :keys].transpose(1, 2) for t in (k_cache, v_cache)]
    ref = attention_ref(rows.transpose(1, 2).double(), *(t.double() for t in kv), causal=True,
                        compute_dtype=torch.float64).transpose(1, 2)  # fmt: skip
    pt = attention_ref(rows.transpose(1, 2), *kv, causal=True,
                       compute_dtype=torch.bfloat16).transpose(1, 2)  # fmt: skip
    _check("out", out[:, -64:], pt, ref, 2, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_gpu_kvcache_cuda_graph(paged):
    """A decode step (append + attend) captured in a CUDA graph (nothing read back during a
    capture: the cache's capacity bounds the lengths) and replayed after the caller moves
    cache_seqlens on: every replay equals the eager call with max_seqlen_k given, and the
    appends land where the lengths say."""
    (q, k_cache, v_cache, k_new, v_new, seqlens, table, k_pages, v_pages, *_) = _setup(
        torch.bfloat16, 1, 1, h=32, hk=8, d=128, device="cuda")  # fmt: skip
    kc, vc, bt = (k_pages, v_pages, table) if paged else (k_cache, v_cache, None)
    capacity = table.shape[1] * 16 if paged else k_cache.shape[1]
    kc0, vc0 = kc.clone(), vc.clone()
    lens = seqlens.clone()
    with torch.no_grad():
        step = lambda **kw: diyfa.flash_attention_with_kvcache(  # noqa: E731
            q, kc, vc, k_new, v_new, cache_seqlens=lens, block_table=bt, **kw)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(max_seqlen_k=capacity)  # the captured kernels, compiled outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        kc.copy_(kc0), vc.copy_(vc0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for shift in (0, 1, 5):
            kc.copy_(kc0), vc.copy_(vc0)
            lens.copy_(seqlens + shift)
            graph.replay()
            kc1, vc1 = kc0.clone(), vc0.clone()
            want = diyfa.flash_attention_with_kvcache(q, kc1, vc1, k_new, v_new,
                                                      cache_seqlens=seqlens + shift,
                                                      block_table=bt, max_seqlen_k=capacity)
            torch.cuda.synchronize()
            assert torch.equal(out, want), shift
            assert torch.equal(kc, kc1) and torch.equal(vc, vc1), shift


@pytest.mark.gpu
def test_gpu_kvcache_mla_latent_calls_reuse_launches(monkeypatch):
    """One latent cache (v_cache and v views of k_cache and k: one role each in the Replay)
    is replayed like any cache: repeated calls with max_seqlen_k reuse the first call's
    launches, and each output and appended cache equals the full path's; two caches of the
    same shapes and strides are another signature (the full path, then an entry of its
    own), with the same result within rounding."""
    from diyfa.attention import decode

    from .test_replay import count_replays

    reused = count_replays(monkeypatch)
    setups = [_setup(torch.bfloat16, 1, 1, h=16, hk=1, d=576, dv=512, device="cuda", seed=s)
              for s in range(3)]  # fmt: skip
    outs = []
    for reuse in (True, False):
        decode._PREPARED.clear()
        outs.append([])
        for q, k_cache, _, k_new, _, seqlens, *_ in setups:
            kc = k_cache.clone()
            with torch.no_grad():
                out = diyfa.flash_attention_with_kvcache(
                    q, kc, kc[..., :512], k_new, k_new[..., :512], cache_seqlens=seqlens,
                    max_seqlen_k=290)  # fmt: skip
            outs[-1].append((out, kc))
            if not reuse:
                decode._PREPARED.clear()
    assert reused == [True, True]  # the 2nd and 3rd calls of the first pass
    for (a, ka), (b, kb) in zip(*outs, strict=True):
        assert torch.equal(a, b) and torch.equal(ka, kb)
    q, k_cache, _, k_new, _, seqlens, *_ = setups[0]
    kc = k_cache.clone()
    with torch.no_grad():  # an entry for the latent signature (the second pass left none)
        diyfa.flash_attention_with_kvcache(q, kc, kc[..., :512], k_new, k_new[..., :512],
                                           cache_seqlens=seqlens, max_seqlen_k=290)
    assert len(decode._PREPARED) == 1
    two = torch.empty_like(k_cache)
    two[..., :512] = k_cache[..., :512]  # a second cache, strided as the latent view
    new_v = torch.empty_like(k_new)
    new_v[..., :512] = k_new[..., :512]
    with torch.no_grad():
        got = diyfa.flash_attention_with_kvcache(q, k_cache.clone(), two[..., :512], k_new,
                                                 new_v[..., :512], cache_seqlens=seqlens,
                                                 max_seqlen_k=290)  # fmt: skip
    assert reused == [True, True] and len(decode._PREPARED) == 2
    assert (got.float() - outs[0][0][0].float()).abs().max().item() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_gpu_kvcache_repeated_calls_reuse_launches(paged, monkeypatch):
    """Calls with one signature and max_seqlen_k reuse the first call's launches
    (_launcher.Replay) on new tensors: each result equals the full path's (the cache of
    prepared launches cleared before it), and a misaligned query takes the full path."""
    from diyfa.attention import decode

    setups = [_setup(torch.bfloat16, 1, 1, h=32, hk=8, d=128, device="cuda", seed=s)
              for s in range(3)]  # fmt: skip
    from .test_replay import count_replays

    reused = count_replays(monkeypatch)  # each Replay.run: whether it ran the kernels
    outs = []
    for reuse in (True, False):
        decode._PREPARED.clear()
        outs.append([])
        for (q, k_cache, v_cache, k_new, v_new, seqlens, table, k_pages, v_pages, *_) in setups:
            kc, vc, bt = (k_pages, v_pages, table) if paged else (k_cache, v_cache, None)
            with torch.no_grad():
                outs[-1].append(diyfa.flash_attention_with_kvcache(
                    q, kc.clone(), vc.clone(), k_new, v_new, cache_seqlens=seqlens,
                    block_table=bt, max_seqlen_k=290))
            if not reuse:
                decode._PREPARED.clear()
        assert len(decode._PREPARED) == (1 if reuse else 0)
    assert reused == [True, True]  # the 2nd and 3rd calls of the first pass
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    q, k_cache, v_cache, k_new, v_new, seqlens, table, k_pages, v_pages, *_ = setups[0]
    kc, vc, bt = (k_pages, v_pages, table) if paged else (k_cache, v_cache, None)
    with torch.no_grad():  # an entry for the signature (the second pass left none)
        diyfa.flash_attention_with_kvcache(q, kc.clone(), vc.clone(), k_new, v_new,
                                           cache_seqlens=seqlens, block_table=bt,
                                           max_seqlen_k=290)  # fmt: skip
    assert len(decode._PREPARED) == 1 and reused == [True, True]
    store = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    odd = store[1:].view(q.shape).copy_(q)  # 2-byte aligned: another specialisation
    with torch.no_grad():
        got = diyfa.flash_attention_with_kvcache(odd, kc.clone(), vc.clone(), k_new, v_new,
                                                 cache_seqlens=seqlens, block_table=bt,
                                                 max_seqlen_k=290)  # fmt: skip
    assert torch.equal(got, outs[0][0])
    assert reused == [True, True, False]  # the misaligned query took the full path


class _TinyLM(torch.nn.Module):
    """A two-layer, GQA (4 query / 2 kv heads, d 16) decoder with learned positions: enough
    of a Llama-style model to run prefill and decoding through the cache API."""

    def __init__(self, vocab=64, hidden=64, heads=4, kv_heads=2, d=16, layers=2):
        super().__init__()
        g = torch.Generator().manual_seed(0)

        def w(*shape):
            return torch.nn.Parameter(torch.randn(*shape, generator=g) * 0.3)

        self.h, self.hk, self.d = heads, kv_heads, d
        self.emb, self.pos = w(vocab, hidden), w(128, hidden)
        self.qkv = torch.nn.ParameterList(w(hidden, (heads + 2 * kv_heads) * d)
                                          for _ in range(layers))  # fmt: skip
        self.proj = torch.nn.ParameterList(w(heads * d, hidden) for _ in range(layers))
        self.head = w(hidden, vocab)

    def _split(self, x, i):
        b, s, _ = x.shape
        qkv = (x @ self.qkv[i]).view(b, s, self.h + 2 * self.hk, self.d)
        return qkv.split([self.h, self.hk, self.hk], dim=2)

    def forward_sdpa(self, ids):
        """Logits of every position, the whole sequence through PyTorch's SDPA (causal)."""
        x = self.emb[ids] + self.pos[: ids.shape[1]]
        for i in range(len(self.qkv)):
            q, k, v = (t.transpose(1, 2) for t in self._split(x, i))
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                 enable_gqa=True)
            x = x + a.transpose(1, 2).flatten(2) @ self.proj[i]
        return x @ self.head

    def step(self, ids, start, caches, lens, table):
        """Logits of the new tokens ``ids`` (batch, n) at positions start.., appending their
        keys and values to the paged caches (one per layer) at ``lens``."""
        x = self.emb[ids] + self.pos[start: start + ids.shape[1]]
        for i, (kc, vc) in enumerate(caches):
            q, k, v = self._split(x, i)
            a = diyfa.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens,
                                                   block_table=table, causal=True)
            x = x + a.flatten(2) @ self.proj[i]
        return x @ self.head


def test_greedy_generation_through_the_paged_cache_matches_sdpa():
    """A tiny GQA decoder generates greedily through diyfa's cache path (prefill of the
    prompt as one multi-token call, then one token per call, k/v appended into shuffled
    pages of 8 tokens) and gives the same tokens as the same model recomputing the whole
    sequence with PyTorch's SDPA at every step."""
    model = _TinyLM().to(DEVICE)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 64, (2, 11), generator=g).to(DEVICE)
    steps, page = 9, 8
    with torch.no_grad():
        ref = prompt
        for _ in range(steps):
            nxt = model.forward_sdpa(ref)[:, -1].argmax(-1, keepdim=True)
            ref = torch.cat([ref, nxt], dim=1)
        pages = -(-(prompt.shape[1] + steps) // page)
        pool = 2 * pages + 3
        table = torch.randperm(pool, generator=g)[: 2 * pages].view(2, pages).to(
            DEVICE, torch.int32)  # fmt: skip
        caches = [(torch.zeros(pool, page, 2, 16, device=DEVICE),
                   torch.zeros(pool, page, 2, 16, device=DEVICE)) for _ in range(2)]
        lens = torch.zeros(2, dtype=torch.int32, device=DEVICE)
        logits = model.step(prompt, 0, caches, lens, table)  # prefill: 11 tokens at once
        out = prompt
        for t in range(steps):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out = torch.cat([out, nxt], dim=1)
            lens = lens + (prompt.shape[1] if t == 0 else 1)
            logits = model.step(nxt, out.shape[1] - 1, caches, lens, table)
    assert torch.equal(out, ref), (out, ref)


def _quantize(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """The reference of an fp8 cache's rows: (batch, n, kv_heads, d) in fp16/bf16 divided by
    their sequence's and head's descale ((kv_heads,) or (batch, kv_heads)), clamped to the
    e4m3 range (a cast alone would turn larger values into NaN), cast."""
    scale = descale if descale.dim() == 2 else descale[None].expand(x.shape[0], -1)
    return (x.float() / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("per_batch, dtype", [(False, torch.bfloat16), (True, torch.float16)],
                         ids=["per-head-bf16", "per-batch-head-fp16"])
def test_fp8_cache(per_batch, dtype, paged):
    """An e4m3 cache with per-kv-head descales: the append quantises the new rows (divided by
    the descale, clamped, cast: exactly what ``_quantize`` gives), and attention over
    the cache equals attention over its dequantised values (float64 reference) by the 2x
    rule, PyTorch in the query dtype as the yardstick; a 3-token append with 3 splits."""
    (q, k_cache, v_cache, k_new, v_new, seqlens, table, k_pages, v_pages, after_k,
     after_v) = _setup(dtype, 3, 3)  # fmt: skip
    b, hk = q.shape[0], k_cache.shape[2]
    g = torch.Generator().manual_seed(3)
    shape = (b, hk) if per_batch else (hk,)
    k_desc = (0.02 + torch.rand(shape, generator=g) * 0.02).to(DEVICE)
    v_desc = (0.02 + torch.rand(shape, generator=g) * 0.02).to(DEVICE)
    kc_src, vc_src = (k_pages, v_pages) if paged else (k_cache, v_cache)
    # Quantise the existing cache as a serving stack would have when writing it.
    full_k = k_desc if per_batch else k_desc[None].expand(b, -1)
    full_v = v_desc if per_batch else v_desc[None].expand(b, -1)
    if paged:
        owner = torch.full((k_pages.shape[0],), 0, dtype=torch.long)
        for i in range(b):
            owner[table[i].long().cpu()] = i
        kq = (k_pages.float() / full_k[owner.to(DEVICE)][:, None, :, None]).clamp(
            -448, 448).to(torch.float8_e4m3fn)  # fmt: skip
        vq = (v_pages.float() / full_v[owner.to(DEVICE)][:, None, :, None]).clamp(
            -448, 448).to(torch.float8_e4m3fn)  # fmt: skip
    else:
        kq, vq = _quantize(kc_src, k_desc), _quantize(vc_src, v_desc)
    with torch.no_grad():
        out = diyfa.flash_attention_with_kvcache(
            q, kq, vq, k_new, v_new, cache_seqlens=seqlens, block_table=table if paged else None,
            num_splits=3, k_descale=k_desc, v_descale=v_desc)  # fmt: skip
    # The appended rows are the quantised new tokens.
    new_k, new_v = _quantize(k_new, k_desc), _quantize(v_new, v_desc)
    for i, n in enumerate(LENS):
        for j in range(3):
            pos = n + j
            for cache, new in ((kq, new_k), (vq, new_v)):
                row = cache[table[i, pos // 16], pos % 16] if paged else cache[i, pos]
                assert torch.equal(row.view(torch.uint8), new[i, j].view(torch.uint8))
    # Dequantised caches (contiguous, after the append) are the reference's inputs.
    deq_k = after_k.clone().float()
    deq_v = after_v.clone().float()
    for i, n in enumerate(LENS):
        m = n + 3
        if paged:
            idx = torch.arange(m, device=DEVICE)
            rows_k = kq[table[i, idx // 16].long(), idx % 16]
            rows_v = vq[table[i, idx // 16].long(), idx % 16]
        else:
            rows_k, rows_v = kq[i, :m], vq[i, :m]
        deq_k[i, :m] = rows_k.float() * full_k[i][None, :, None]
        deq_v[i, :m] = rows_v.float() * full_v[i][None, :, None]
    lengths = [n + 3 for n in LENS]
    ref = _reference(q.double(), deq_k.double(), deq_v.double(), lengths, True, torch.float64)
    pt = _reference(q, deq_k.to(dtype), deq_v.to(dtype), lengths, True, dtype)
    _check("out", out, pt, ref, 2, dtype)


def _fp8_cache_case(d, sq, per_batch, seed=0):
    """32 query heads over 8 kv heads at head dim ``d``, ``sq`` new tokens appended to e4m3
    caches whose rows past each sequence's end hold NaN bytes (0x7f): (q, caches, new rows,
    lengths, descales, the float64 and query-dtype references over the dequantised caches
    after the append)."""
    dtype = torch.bfloat16
    (q, k_cache, v_cache, k_new, v_new, seqlens, *_rest) = _setup(dtype, sq, sq, h=32, hk=8,
                                                                 d=d, device="cuda",
                                                                 seed=seed)  # fmt: skip
    b, hk = q.shape[0], k_cache.shape[2]
    g = torch.Generator().manual_seed(seed + 1)
    shape = (b, hk) if per_batch else (hk,)
    k_desc = (0.02 + torch.rand(shape, generator=g) * 0.02).cuda()
    v_desc = (0.02 + torch.rand(shape, generator=g) * 0.02).cuda()
    kq, vq = _quantize(k_cache, k_desc), _quantize(v_cache, v_desc)
    for i, n in enumerate(LENS):
        kq.view(torch.uint8)[i, n:] = 0x7F
        vq.view(torch.uint8)[i, n:] = 0x7F
    full_k = k_desc if per_batch else k_desc[None].expand(b, -1)
    full_v = v_desc if per_batch else v_desc[None].expand(b, -1)
    new_k, new_v = _quantize(k_new, k_desc), _quantize(v_new, v_desc)
    deq_k = torch.zeros(k_cache.shape, dtype=torch.float64, device="cuda")
    deq_v = torch.zeros(v_cache.shape, dtype=torch.float64, device="cuda")
    for i, n in enumerate(LENS):
        deq_k[i, :n] = kq[i, :n].double() * full_k[i][None, :, None]
        deq_v[i, :n] = vq[i, :n].double() * full_v[i][None, :, None]
        deq_k[i, n:n + sq] = new_k[i].double() * full_k[i][None, :, None]
        deq_v[i, n:n + sq] = new_v[i].double() * full_v[i][None, :, None]
    lengths = [n + sq for n in LENS]
    ref = _reference(q.double(), deq_k, deq_v, lengths, True, torch.float64)
    pt = _reference(q, deq_k.to(dtype), deq_v.to(dtype), lengths, True, dtype)
    return q, kq, vq, k_new, v_new, seqlens, k_desc, v_desc, ref, pt


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq, splits, per_batch", [(1, 0, False), (1, 1, True), (2, 3, False),
                                                   (4, 0, True), (4, 2, False)])
@pytest.mark.parametrize("mma", [True, False])
def test_gpu_fp8_cache_hopper_kernel(d, sq, splits, per_batch, mma, monkeypatch):
    """An e4m3 cache on an H100 / H200 runs the Gluon split kernel (hopper_decode) and gives
    attention over the dequantised cache by the 2x rule: 1, 2 and 4 new tokens appended (4,
    8 and 16 query rows a kv head), one split (the output written by the split kernel),
    2 or 3 splits and the default (the combine kernel), per-head and per-(batch, head)
    descales, an empty sequence and lengths off the 64-key blocks; rows past each sequence's
    end hold NaN bytes that must not reach the output. Calls with ``max_seqlen_k`` give the
    same output bitwise, the second by replaying the first's launches. Both split kernels
    (``MMA``; the mma.sync one merges its splits itself)."""
    from diyfa.attention import decode, hopper_decode

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon decode kernel is sm90's")
    monkeypatch.setattr(hopper_decode, "MMA", mma)
    decode._PREPARED.clear()  # (recorded launches are not keyed by the kernel choice)
    ran = []
    real = decode.launch_recorded
    monkeypatch.setattr(decode, "launch_recorded",
                        lambda fn, *a, **kw: (ran.append(fn), real(fn, *a, **kw))[1])
    q, kq, vq, k_new, v_new, seqlens, k_desc, v_desc, ref, pt = _fp8_cache_case(d, sq,
                                                                              per_batch)
    with torch.no_grad():
        out = diyfa.flash_attention_with_kvcache(q, kq, vq, k_new, v_new, cache_seqlens=seqlens,
                                                 num_splits=splits, k_descale=k_desc,
                                                 v_descale=v_desc)  # fmt: skip
    assert hopper_decode.split_kernel() in ran and decode._decode_split not in ran, ran
    # (2 or 3 splits: the mma.sync kernel merges them itself, no combine kernel)
    if splits > 1:
        assert (decode._combine in ran) == (not mma), ran
    assert torch.isfinite(out).all()
    _check("out", out, pt, ref, 2, torch.bfloat16)
    # the same step again from the cache as it was before the append, through the replay
    q2, kq2, vq2, k_new2, v_new2, seqlens2, *_ = _fp8_cache_case(d, sq, per_batch)
    bound = max(LENS) + sq
    with torch.no_grad():
        for i in range(2):
            kq3, vq3 = kq2.clone(), vq2.clone()
            before = len(ran)
            again = diyfa.flash_attention_with_kvcache(q2, kq3, vq3, k_new2, v_new2,
                                                       cache_seqlens=seqlens2, num_splits=splits,
                                                       k_descale=k_desc, v_descale=v_desc,
                                                       max_seqlen_k=bound)  # fmt: skip
            assert torch.equal(again, out)
            # the second call replays the first's launches (no host path: nothing launched
            # through launch_recorded)
            assert (len(ran) == before) == (i == 1), ran[before:]


def _pages_of(cache: torch.Tensor, page: int, seed: int):
    """A (batch, n, kv_heads, d) e4m3 cache as shuffled pages of ``page`` rows in a pool with
    spare pages, every row not copied from ``cache`` NaN bytes (0x7f), and its int32 block
    table (batch, ceil(n / page))."""
    b, n = cache.shape[:2]
    per = -(-n // page)
    pool = b * per + 3
    perm = torch.randperm(pool, generator=torch.Generator().manual_seed(seed))[: b * per]
    table = perm.view(b, per).to(cache.device, torch.int32)
    nan = torch.full((b, per * page, *cache.shape[2:]), 0x7F, dtype=torch.uint8,
                     device=cache.device)  # fmt: skip
    nan[:, :n] = cache.view(torch.uint8)
    pages = torch.full((pool, page, *cache.shape[2:]), 0x7F, dtype=torch.uint8,
                       device=cache.device)  # fmt: skip
    pages[table.long()] = nan.view(b, per, page, *cache.shape[2:])
    return pages.view(cache.dtype), table


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("d, sq, splits", [(128, 1, 0), (64, 4, 2), (128, 2, 1)])
@pytest.mark.parametrize("mma", [True, False])
def test_gpu_fp8_paged_cache_hopper_kernel(page, d, sq, splits, mma, monkeypatch):
    """A paged e4m3 cache (shuffled pages of 16..256 keys: a TMA box a page below the
    kernel's 128-key blocks, one a block from 128 up) runs the Gluon split kernel and gives
    the contiguous cache's output bitwise (the same keys, the same order), attention over the
    dequantised cache by the 2x rule; unused rows and spare pages hold NaN bytes; the append
    writes the quantised new rows into their pages; the second ``max_seqlen_k`` call
    replays. Both split kernels (``MMA``)."""
    from diyfa.attention import decode, hopper_decode

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon decode kernel is sm90's")
    monkeypatch.setattr(hopper_decode, "MMA", mma)
    decode._PREPARED.clear()
    ran = []
    real = decode.launch_recorded
    monkeypatch.setattr(decode, "launch_recorded",
                        lambda fn, *a, **kw: (ran.append(fn), real(fn, *a, **kw))[1])
    q, kq, vq, k_new, v_new, seqlens, k_desc, v_desc, ref, pt = _fp8_cache_case(d, sq, False)
    k_pages, table = _pages_of(kq, page, seed=page)
    v_pages, _ = _pages_of(vq, page, seed=page)
    bound = max(LENS) + sq
    with torch.no_grad():
        contiguous = diyfa.flash_attention_with_kvcache(q, kq, vq, k_new, v_new,
                                                        cache_seqlens=seqlens,
                                                        num_splits=splits, k_descale=k_desc,
                                                        v_descale=v_desc)  # fmt: skip
        before = len(ran)
        outs = []
        for i in range(2):  # the second call replays the first's launches
            kp, vp = k_pages.clone(), v_pages.clone()
            outs.append(diyfa.flash_attention_with_kvcache(
                q, kp, vp, k_new, v_new, cache_seqlens=seqlens, block_table=table,
                num_splits=splits, k_descale=k_desc, v_descale=v_desc,
                max_seqlen_k=bound))  # fmt: skip
            if i == 0:
                assert hopper_decode.split_kernel() in ran[before:], ran[before:]
                assert decode._decode_split not in ran[before:], ran[before:]
                before = len(ran)
        assert len(ran) == before, ran[before:]
    for out in outs:
        assert torch.equal(out, contiguous)
    _check("out", outs[0], pt, ref, 2, torch.bfloat16)
    new_k = _quantize(k_new, k_desc)
    for i, n in enumerate(LENS):
        for j in range(sq):
            pos = n + j
            assert torch.equal(kp[table[i, pos // page], pos % page].view(torch.uint8),
                               new_k[i, j].view(torch.uint8))  # fmt: skip


def test_fp8_cache_hopper_kernel_compiles_and_fits():
    """The Gluon split kernels for fp8 caches (hopper_decode: the warpgroup one and the
    mma.sync one) compile for sm90a at head dims 64 and 128, causal or not, one split or
    several (the mma.sync kernel merging them itself), in their launch configurations, and
    the mma.sync kernel over paged caches (pages of 16 and 256 keys): nothing spilled, and
    shared memory (and, for the mma.sync kernel, registers) for ``CONFIG``'s /
    ``MMA_CONFIG``'s programs per SM on an H100 / H200."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FP8_DECODE], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0 and "compiled 18" in done.stdout, done.stderr[-3000:]


_COMPILE_FP8_DECODE = """
import torch
from diyfa._compile import compile_for_sm90, registers, spill_bytes
from diyfa.attention import hopper_decode as hd

block_n, stages, per_sm, one_tile = hd.CONFIG[:4]
n = 0
for d in (64, 128):
    cache = torch.empty(4, 1024, 8, d, dtype=torch.float8_e4m3fn)
    for causal in (False, True):
        for direct in (False, True):
            args = dict(Q=torch.empty(16, dtype=torch.bfloat16),
                        k_desc=hd.cache_desc(cache, block_n), v_desc=hd.cache_desc(cache, block_n),
                        CACHE_SEQLENS=torch.empty(16, dtype=torch.int32), O_PART=torch.empty(16),
                        LSE_PART=torch.empty(16), O=torch.empty(16, dtype=torch.bfloat16),
                        LSE=torch.empty(16), K_DESCALE=torch.empty(16), V_DESCALE=torch.empty(16),
                        qk_scale=0.5, HEAD_DIM=d, CAUSAL=causal, BLOCK_N=block_n, STAGES=stages,
                        ROWS=hd.ROWS, DIRECT=direct, PDL=True, PDL_WAIT=True,
                        ONE_TILE=bool(one_tile), EARLY_S=hd.EARLY_S, PAGE=0,
                        BLOCK_TABLE=torch.empty(16, dtype=torch.int32))
            # (the launch's warps and register cap: decode._hopper_fp8's)
            warps = hd.launch_warps(d, hd.CONFIG)
            args["MAXNREG"] = hd.register_cap(per_sm, warps)
            values = {p.name: args.get(p.name, 1 if p.name == "stride_qd" or p.name == "stride_od"
                                       else 1024) for p in hd._decode_split_fp8.params}
            k = compile_for_sm90(hd._decode_split_fp8, values, num_warps=warps,
                                 maxnreg=args["MAXNREG"] or None)
            # (an SM's 228 KB hold per_sm programs of this size, 1 KB each reserved)
            assert per_sm * (k.metadata.shared + 1024) <= 233472, (d, k.metadata.shared)
            assert spill_bytes(k) == 0, (d, causal, direct)
            n += 1
            # the mma.sync kernel in MMA_CONFIG: shared memory and registers for its programs
            # per SM, nothing spilled
            mma_n, mma_stages, mma_per_sm = hd.MMA_CONFIG
            for key in ("ONE_TILE", "EARLY_S"):
                args.pop(key)
            args.update(k_desc=hd.cache_desc(cache, mma_n), v_desc=hd.cache_desc(cache, mma_n),
                        BLOCK_N=mma_n, STAGES=mma_stages, MAXNREG=hd.register_cap(mma_per_sm),
                        COUNTERS=torch.empty(16, dtype=torch.int32), MERGE=not direct,
                        EARLY_ISSUE=2)
            values = {p.name: args.get(p.name, 1 if p.name == "stride_qd" or p.name == "stride_od"
                                       else 1024) for p in hd._decode_split_fp8_mma.params}
            k = compile_for_sm90(hd._decode_split_fp8_mma, values, num_warps=4,
                                 maxnreg=args["MAXNREG"] or None)
            assert mma_per_sm * (k.metadata.shared + 1024) <= 233472, (d, k.metadata.shared)
            assert mma_per_sm * 128 * registers(k) <= 65536, (d, registers(k))
            assert spill_bytes(k) == 0, (d, causal, direct)
            n += 1
            # paged caches: a box a page (16 keys) and one a block (256-key pages)
            if causal and not direct:
                page = 16 if d == 128 else 256
                pages = torch.empty(64, page, 8, d, dtype=torch.float8_e4m3fn)
                values.update(k_desc=hd.cache_desc(pages, mma_n, True), PAGE=page,
                              v_desc=hd.cache_desc(pages, mma_n, True))
                k = compile_for_sm90(hd._decode_split_fp8_mma, values, num_warps=4,
                                     maxnreg=args["MAXNREG"] or None)
                assert mma_per_sm * 128 * registers(k) <= 65536, (d, page, registers(k))
                assert spill_bytes(k) == 0, (d, page)
                n += 1
print("compiled", n)
"""


def test_fp8_cache_bad_input_writes_nothing():
    """fp8 caches without descales, descales on a bf16 cache, wrong descale shapes or dtypes,
    descales of two shapes, mixed cache dtypes, fp32 queries: clear errors, the cache
    untouched."""
    (q, k_cache, v_cache, k_new, v_new, seqlens, *_rest) = _setup(torch.bfloat16, 1, 1)
    kq = k_cache.to(torch.float8_e4m3fn)
    vq = v_cache.to(torch.float8_e4m3fn)
    good = torch.full((k_cache.shape[2],), 0.1, device=DEVICE)
    before = kq.view(torch.uint8).clone()
    cases = [
        (dict(k_cache=kq, v_cache=vq), ValueError, "needs k_descale"),
        (dict(k_cache=k_cache, v_cache=v_cache, k_descale=good, v_descale=good), ValueError,
         "apply to an fp8"),
        (dict(k_cache=kq, v_cache=vq, k_descale=good[:1], v_descale=good), ValueError,
         "k_descale must have shape"),
        (dict(k_cache=kq, v_cache=vq, k_descale=good.double(), v_descale=good), TypeError,
         "k_descale must be a float32 tensor"),
        (dict(k_cache=kq, v_cache=v_cache, k_descale=good, v_descale=good), TypeError,
         "must both be float8_e4m3fn"),
        (dict(k_cache=kq, v_cache=vq, k_descale=good[None].expand(q.shape[0], -1).contiguous(),
              v_descale=good), ValueError, "must have one shape"),
    ]
    for kw, err, match in cases:
        with pytest.raises(err, match=match), torch.no_grad():
            diyfa.flash_attention_with_kvcache(q, k=k_new, v=v_new, cache_seqlens=seqlens, **kw)
    with pytest.raises(TypeError, match="fp8 cache takes float16 or bfloat16 queries"):
        with torch.no_grad():
            diyfa.flash_attention_with_kvcache(q.float(), kq, vq, cache_seqlens=seqlens,
                                               k_descale=good, v_descale=good)  # fmt: skip
    assert torch.equal(kq.view(torch.uint8), before)


def test_fp8_cache_queries_beyond_fp16_range():
    """With an fp8 cache the dots run in fp16; bf16 queries far beyond fp16's range (1e6,
    with a softmax scale to match) are scaled by a power of two on the way, not turned into
    inf: the output matches float64 attention over the dequantised cache by the 2x rule."""
    q, k_cache, v_cache, *_ = _setup(torch.bfloat16, 1, 0, seed=5)
    hk, d = k_cache.shape[2], q.shape[3]
    desc = torch.full((hk,), 0.01, device=DEVICE)
    kq, vq = _quantize(k_cache, desc), _quantize(v_cache, desc)
    big = (q.float() * 1e6).to(torch.bfloat16)
    scale = 1e-6 / d**0.5
    seqlens = torch.tensor(LENS, dtype=torch.int32, device=DEVICE)
    with torch.no_grad():
        out = diyfa.flash_attention_with_kvcache(big, kq, vq, cache_seqlens=seqlens,
                                                 softmax_scale=scale, k_descale=desc,
                                                 v_descale=desc)  # fmt: skip
    assert torch.isfinite(out).all()
    deq_k, deq_v = kq.float() * 0.01, vq.float() * 0.01
    ref = torch.cat([attention_ref(big[i:i + 1].double(), deq_k[i:i + 1, :n].double(),
                                   deq_v[i:i + 1, :n].double(), causal=True, layout="bshd",
                                   softmax_scale=scale, compute_dtype=torch.float64)
                     for i, n in enumerate(LENS)])  # fmt: skip
    pt = torch.cat([attention_ref(big[i:i + 1], deq_k[i:i + 1, :n].bfloat16(),
                                  deq_v[i:i + 1, :n].bfloat16(), causal=True, layout="bshd",
                                  softmax_scale=scale, compute_dtype=torch.bfloat16)
                    for i, n in enumerate(LENS)])  # fmt: skip
    _check("out", out, pt, ref, 2, torch.bfloat16)


def test_call_signature_keys_only_what_it_can():
    """decode._signature (the key of a replayed decode step): None for a tensor argument
    that is not a tensor, unhashable with an unhashable option, so the checks still name
    those; equal for
    two calls that differ only in their tensors' addresses; apart for another option type,
    grad flag or stride."""
    from diyfa.attention import decode

    q = torch.zeros(2, 1, 4, 8)
    kc = torch.zeros(2, 16, 2, 8)
    lens = torch.zeros(2, dtype=torch.int32)
    tensors = (q, kc, kc.clone(), None, None, lens, None, None, None, None, None)
    opts = (True, None, 0, (-1, -1), 0.0, 16)
    key = decode._signature(tensors, opts)
    assert key is not None
    assert decode._signature(tuple(t if t is None else t.clone() for t in tensors), opts) == key
    assert decode._signature(tensors[:5] + ([0, 0],) + tensors[6:], opts) is None
    with pytest.raises(TypeError):  # append_and_attend then takes the checks
        hash(decode._signature(tensors, opts[:3] + ([-1, -1],) + opts[4:]))
    assert decode._signature(tensors, (1,) + opts[1:]) != key  # causal=1 is not True
    assert decode._signature((q.requires_grad_(),) + tensors[1:], opts) != key
    assert decode._signature((q.detach().transpose(0, 1),) + tensors[1:], opts) != key


def test_one_split_writes_the_output_without_the_combine(monkeypatch):
    """One split and no sinks: the split kernel stores the output and LSE itself (DIRECT).
    More splits, or sinks: the last split program of a block of rows merges them (MERGE), no
    combine kernel runs, and the counters it counts on are the zeros the device check wrote
    (every new tensor is filled with 7s here); with MERGE off the combine kernel runs. All
    agree to rounding. (CPU: the interpreter's launches are counted; the GPU path's are the
    same launches.)"""
    from diyfa.attention import decode

    if DEVICE != "cpu":
        pytest.skip("counts the interpreter's launches")

    q, k_cache, v_cache, _, _, seqlens, *_ = _setup(torch.float32, 2, 0)
    combined = []
    real, real_empty = decode._combine, torch.empty

    class Counting:  # decode._combine[grid](...) in the interpreter, counted
        def __getitem__(self, grid):
            combined.append(grid)
            return real[grid]

    def run(splits, sinks=None):
        return diyfa.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                  num_splits=splits, sinks=sinks,
                                                  return_lse=True)  # fmt: skip

    monkeypatch.setattr(decode, "_combine", Counting())
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(7))
    sinks = torch.randn(q.shape[2], device=q.device)
    with torch.no_grad():
        one, lse1 = run(1)
        assert combined == []
        for splits in (2, 3):
            out, lse = run(splits)
            assert combined == []
            torch.testing.assert_close(out, one, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse, lse1, rtol=1e-5, atol=1e-5)
        merged = run(1, sinks), run(3, sinks)
        assert combined == []
        monkeypatch.setattr(decode, "MERGE", False)
        out, lse = run(2)
        assert len(combined) == 1
        torch.testing.assert_close(out, one, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, lse1, rtol=1e-5, atol=1e-5)
        combine = run(1, sinks)
        assert len(combined) == 2
    for got in merged:
        torch.testing.assert_close(got[0], combine[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], combine[1], rtol=1e-5, atol=1e-5)
