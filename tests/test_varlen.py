"""diyfa.flash_attention_varlen: packed sequences of different lengths, forward and gradients.

Judged per sequence against the float64 reference by the rule of test_attention.py: the
kernel's error at most 2x PyTorch's own error in the same precision (3x for gradients).
CPU runs use the Triton interpreter.
"""

from __future__ import annotations

import pytest
import torch

import diyfa
from diyfa.reference import attention_ref

from .conftest import DEVICE
from .test_attention import _check

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DTYPE_IDS = ["fp16", "bf16", "fp32"]


def _packed(lens_q, lens_k, h, hk, d, dtype, device=DEVICE, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def make(rows, heads):
        return torch.randn(rows, heads, d, generator=g).to(device, dtype).requires_grad_()

    def cumulative(lens):
        return torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))],
                            dtype=torch.int32, device=device)  # fmt: skip

    q, k, v = make(sum(lens_q), h), make(sum(lens_k), hk), make(sum(lens_k), hk)
    return q, k, v, cumulative(lens_q), cumulative(lens_k)


def _reference(q, k, v, cu_q, cu_k, causal, dtype, do):
    """Per-sequence attention in ``dtype`` (float64: the reference), concatenated; and the
    gradients of sum(out * do)."""
    ins = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    outs, lses = [], []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        o, lse = attention_ref(ins[0][qs][None], ins[1][ks][None], ins[2][ks][None],
                               causal=causal, layout="bshd", compute_dtype=dtype,
                               return_lse=True)  # fmt: skip
        outs.append(o[0])
        lses.append(lse[0])
    out = torch.cat(outs)
    (out * do.to(dtype)).sum().backward()
    return out, torch.cat(lses, dim=1), [t.grad for t in ins]


def _run_and_check(lens_q, lens_k, h, hk, d, dtype, causal, device=DEVICE, backend="auto",
                   deterministic=False):
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, h, hk, d, dtype, device)
    out, lse = diyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                            causal=causal, return_lse=True, backend=backend,
                                            deterministic=deterministic)  # fmt: skip
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (h, q.shape[0])
    do = torch.randn_like(out)
    out.backward(do)
    ref, ref_lse, ref_grads = _reference(q, k, v, cu_q, cu_k, causal, torch.float64, do)
    pt, _, pt_grads = _reference(q, k, v, cu_q, cu_k, causal, dtype, do)
    _check("out", out, pt, ref, 2, dtype)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)  # -inf exactly where a row sees no key
    assert (lse[seen].double() - ref_lse[seen]).abs().max().item() < 1e-3
    for name, t, p, r in zip(("dq", "dk", "dv"), (q, k, v), pt_grads, ref_grads, strict=True):
        _check(name, t.grad, p, r, 3, dtype)


# (query lengths, key lengths, heads, kv heads, head dim): zero-length sequences on either
# side, single rows, seqlen_q != seqlen_k both ways, GQA and MQA, odd head dims.
CASES = [
    ([5, 0, 17, 33, 1], [9, 3, 17, 20, 1], 4, 2, 24),
    ([64, 1, 70], [64, 130, 0], 2, 1, 64),
    ([3], [200], 3, 3, 40),
    ([129, 7], [31, 257], 2, 2, 16),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"q{c[0]}k{c[1]}h{c[2]}/{c[3]}d{c[4]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_varlen_forward_and_gradients(case, dtype, causal):
    lens_q, lens_k, h, hk, d = case
    _run_and_check(lens_q, lens_k, h, hk, d, dtype, causal)


def test_varlen_equals_the_batched_call_on_equal_lengths():
    """Packed equal-length sequences give what flash_attention gives on the same batch."""
    b, s, h, d = 3, 37, 2, 32
    q, k, v, cu_q, cu_k = _packed([s] * b, [s] * b, h, h, d, torch.float16)
    out = diyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, s, s, causal=True)
    batched = diyfa.flash_attention(*(t.view(b, s, h, d) for t in (q, k, v)), causal=True,
                                    layout="bshd")  # fmt: skip
    assert torch.equal(out.view(b, s, h, d), batched)


def test_keys_of_a_sequence_without_queries_get_zero_gradients():
    q, k, v, cu_q, cu_k = _packed([4, 0, 6], [5, 7, 3], 2, 2, 16, torch.float32)
    out = diyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, 6, 7)
    out.sum().backward()
    assert (k.grad[5:12] == 0).all() and (v.grad[5:12] == 0).all()
    assert k.grad[:5].abs().sum() > 0


def test_varlen_hopper_path_by_head_dim(monkeypatch):
    """On an H100/H200 (capability set by hand here) the Hopper family takes packed
    sequences under "auto" at every head dim (above d128 since 2026-11-25); at d64 its
    "auto" forward is the Hopper kernel too (the portable one's until 2026-11-24, measured
    faster then) and its backward the Gluon one where hopper_bwd.auto_mode picks it (plain
    attention's rule: at d64 the atomic dQ, the deterministic path when asked for; at
    d72..128 the deterministic path); with a window
    (or softcap, ALiBi, sinks) the family refuses them."""
    import dataclasses
    import types

    from diyfa.attention import dispatch, hopper_bwd, hopper_fwd, portable
    from diyfa.attention.checks import check_varlen_inputs

    q, k, v, cu_q, cu_k = _packed([3, 4], [3, 4], 2, 2, 64, torch.bfloat16)
    # (max_seqlen 4096: at d64 "auto" keeps small causal calls below SHORT_KEYS_D64 keys portable)
    p = check_varlen_inputs(q, k, v, cu_q, cu_k, 4096, 4096, causal=False, softmax_scale=None)
    p = dataclasses.replace(p, capability=(9, 0), aligned16=True)
    family = dispatch.select(p)
    assert family.name == "hopper" and dispatch.select(p, "hopper").name == "hopper"
    ran = []
    monkeypatch.setattr(portable, "FAMILY", types.SimpleNamespace(
        forward=lambda *a: ran.append("portable")))
    monkeypatch.setattr(hopper_fwd, "hopper_forward", lambda *a: ran.append("hopper"))
    family.forward(q, k, v, p)
    assert ran == ["hopper"]  # d64: the Hopper forward (measured faster since 2026-11-24)
    assert hopper_bwd.supports(p) is None  # the Gluon backward takes them
    assert hopper_bwd.auto_mode(dataclasses.replace(p, causal=True)) == "atomic"
    assert hopper_bwd.auto_mode(dataclasses.replace(p, causal=True, deterministic=True)) == (
        "kernel-dq")
    for d in (128, 96, 256, 192):
        qd, kd, vd, _, _ = _packed([3, 4], [3, 4], 2, 2, d, torch.bfloat16)
        pd = check_varlen_inputs(qd, kd, vd, cu_q, cu_k, 4, 4, causal=True, softmax_scale=None)
        pd = dataclasses.replace(pd, capability=(9, 0), aligned16=True)
        assert dispatch.select(pd).name == "hopper", d
        assert hopper_bwd.supports(pd) is None
        # d72..128: the atomic dQ too (since its FA3 order); above, the deterministic path
        fast = "atomic" if d <= 128 else "kernel-dq"
        assert hopper_bwd.auto_mode(pd) == fast
        assert hopper_bwd.auto_mode(dataclasses.replace(pd, deterministic=True)) == "kernel-dq"
    windowed = dataclasses.replace(p, window_left=8)
    assert "without window" in dict(dispatch.explain(windowed))["hopper"]


def test_hopper_varlen_empty_tensors_return_before_the_kernel():
    """max_seqlen_k / max_seqlen_q may exceed every length: with no key rows (or no query
    rows) at all, the Hopper packed forward returns zeros / LSE -inf (or empty tensors)
    without building a TMA descriptor over an empty tensor (which CUDA refuses)."""
    from diyfa.attention import hopper_fwd
    from diyfa.attention.checks import check_varlen_inputs

    q, _, _, cu_q, _ = _packed([3, 4], [1, 1], 2, 2, 64, torch.bfloat16)
    k = torch.zeros(0, 2, 64, dtype=torch.bfloat16, device=q.device)
    cu_k = torch.zeros(3, dtype=torch.int32, device=q.device)
    p = check_varlen_inputs(q, k, k, cu_q, cu_k, 4, 1, causal=False, softmax_scale=None)
    out, lse2 = hopper_fwd._packed_forward(q, k, k, p)
    assert (out == 0).all() and out.shape == q.shape
    assert lse2.shape == (2, 7) and (lse2 == float("-inf")).all()
    q0 = q[:0]
    cu0 = torch.zeros(3, dtype=torch.int32, device=q.device)
    _, k1, _, _, cu_k1 = _packed([1, 1], [5, 6], 2, 2, 64, torch.bfloat16)
    p0 = check_varlen_inputs(q0, k1, k1, cu0, cu_k1, 3, 6, causal=False, softmax_scale=None)
    out0, lse0 = hopper_fwd._packed_forward(q0, k1, k1, p0)
    assert out0.shape == (0, 2, 64) and lse0.shape == (2, 0)
    assert p.batch == 2 and p.seqlen_q == 4 and p.total_q == 7
    assert p.q_strides == (0, q.stride(1), q.stride(0), q.stride(2))


def _bad(over):
    q, k, v, cu_q, cu_k = _packed([3, 4], [5, 2], 4, 2, 16, torch.float16)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4,
                max_seqlen_k=5)  # fmt: skip
    args.update(over(args))
    return args


@pytest.mark.parametrize("over, err, match", [
    (lambda a: dict(q=a["q"][None]), ValueError, "q must be 3-D \\(total_tokens, heads"),
    (lambda a: dict(cu_seqlens_q=a["cu_seqlens_q"].long()), TypeError,
     "cu_seqlens_q.dtype is torch.int64; accepted: int32"),
    (lambda a: dict(cu_seqlens_k=a["cu_seqlens_k"][None]), ValueError, "cu_seqlens_k must be 1-D"),
    (lambda a: dict(cu_seqlens_q=torch.tensor([0, 3, 6], dtype=torch.int32, device=DEVICE)),
     ValueError, "cu_seqlens_q must start at 0 and end at the packed rows \\(7\\), got 0 .. 6"),
    (lambda a: dict(cu_seqlens_k=torch.tensor([0, 5, 6], dtype=torch.int32, device=DEVICE)),
     ValueError, "cu_seqlens_k must start at 0 and end at the packed rows \\(7\\), got 0 .. 6"),
    (lambda a: dict(cu_seqlens_k=torch.tensor([0, 8, 7], dtype=torch.int32,
                                              device=DEVICE)), ValueError, "non-decreasing"),
    (lambda a: dict(max_seqlen_q=3), ValueError,
     "max_seqlen_q=3 is less than the longest sequence in cu_seqlens_q \\(4\\)"),
    (lambda a: dict(max_seqlen_k=-1), TypeError, "max_seqlen_k must be an int >= 0"),
    (lambda a: dict(max_seqlen_k=5.0), TypeError, "max_seqlen_k must be an int >= 0"),
    (lambda a: dict(cu_seqlens_k=torch.tensor([0, 7], dtype=torch.int32, device=DEVICE),
                    max_seqlen_k=7), ValueError, "same number of sequences, got 2 and 1"),
    (lambda a: dict(k=torch.randn(7, 3, 16, device=DEVICE, dtype=torch.float16),
                    v=torch.randn(7, 3, 16, device=DEVICE, dtype=torch.float16)),
     ValueError, "q heads \\(4\\) must be a multiple of k/v heads \\(3\\)"),
    (lambda a: dict(cu_seqlens_q=[0, 3, 7]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
    (lambda a: dict(cu_seqlens_q=torch.tensor([0, 99, 3, 99, 7, 99], dtype=torch.int32,
                                              device=DEVICE)[::2]),
     ValueError, "cu_seqlens_q must be contiguous"),
], ids=["4d-q", "int64", "2d-cu", "wrong-total", "wrong-total-k", "decreasing", "max-short",
        "max-negative", "max-float", "count", "heads", "list", "strided"])
def test_varlen_bad_input_is_a_clear_error(over, err, match):
    with pytest.raises(err, match=match):
        diyfa.flash_attention_varlen(**_bad(over))


def test_checked_lengths_are_kept_and_bad_ones_raise_every_time():
    """checks._checked_values keeps lengths that passed (the same tuple back for the same
    contents, packed rows and max_seqlen: no list, no check) and never bad ones: each call
    with them raises again; another max_seqlen is checked anew."""
    from diyfa.attention import checks

    good = torch.tensor([0, 3, 7], dtype=torch.int32)
    a = checks._checked_values("cu_seqlens_q", good, 7, 4, "max_seqlen_q")
    b = checks._checked_values("cu_seqlens_q", good.clone(), 7, 4, "max_seqlen_q")
    assert a == (0, 3, 7) and a is b
    for _ in range(2):
        with pytest.raises(ValueError, match="max_seqlen_q=3 is less than the longest"):
            checks._checked_values("cu_seqlens_q", good, 7, 3, "max_seqlen_q")
        with pytest.raises(ValueError, match="non-decreasing"):
            checks._checked_values("cu_seqlens_k", torch.tensor([0, 8, 7], dtype=torch.int32),
                                   7, 8, "max_seqlen_k")  # fmt: skip


def test_packed_lengths_are_remembered_by_tensor_and_version(monkeypatch):
    """checks.HostLengths copies a cu_seqlens tensor's values only if it has not read that
    tensor before at the same version (PyTorch moves it on every in-place write): a tensor
    read before and unchanged is neither copied nor waited for (``_fresh`` empty); an
    in-place write, another tensor with the same values, REMEMBER_LENGTHS off or an
    inference tensor are read afresh; lengths that fail their check are never remembered; a
    freed tensor's entry goes with it."""
    from diyfa.attention import checks

    def lengths(cu, total=7, longest=5):
        return checks.HostLengths([("cu_seqlens_q", cu, total, longest, "max_seqlen_q"),
                                   ("cu_seqlens_k", cu, total, longest, "max_seqlen_k")])

    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE)
    first = lengths(cu)
    assert len(first._fresh) == 2 and first.values() == ((0, 3, 7), (0, 3, 7))
    again = lengths(cu)
    assert again._fresh == [] and again._event is None
    assert again.values() == ((0, 3, 7), (0, 3, 7))
    cu[1] = 2  # in place: the version moves
    moved = lengths(cu)
    assert len(moved._fresh) == 2 and moved.values() == ((0, 2, 7), (0, 2, 7))
    assert lengths(cu.clone())._fresh != []
    cu[1] = 9  # not non-decreasing: raises on every call, never remembered
    for _ in range(2):
        bad = lengths(cu)
        assert bad._fresh != []
        with pytest.raises(ValueError, match="non-decreasing"):
            bad.values()
    cu[1] = 3
    lengths(cu).values()
    with pytest.raises(ValueError, match="max_seqlen_q=3 is less than the longest"):
        lengths(cu, longest=3).values()  # remembered values are checked against each call
    monkeypatch.setattr(checks, "REMEMBER_LENGTHS", False)
    assert lengths(cu)._fresh != []
    monkeypatch.setattr(checks, "REMEMBER_LENGTHS", True)
    with torch.inference_mode():
        frozen = torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE)
        for _ in range(2):
            read = lengths(frozen)
            assert read._fresh != [] and read.values() == ((0, 3, 7), (0, 3, 7))
    gone = torch.tensor([0, 2, 7], dtype=torch.int32, device=DEVICE)
    lengths(gone).values()
    key = (id(gone), None)
    assert key in checks._REMEMBERED
    del gone  # freed: forgotten with it
    assert key not in checks._REMEMBERED


def test_packed_replays_prepare_the_last_lengths_first():
    """hopper_fwd._ByLengths: the replay used last is prepared before the lengths' wait and
    launched if the lengths are its own; other lengths take their own replay (run); unknown
    ones none (False), and bad lengths raise before any launch."""
    from diyfa.attention import hopper_fwd

    log = []

    class FakeReplay:
        def __init__(self, name):
            self.name = name

        def prepare(self, roles):
            log.append(("prepare", self.name))
            return [self.name]

        def launch(self, runs):
            log.append(("launch", *runs))

        def run(self, roles):
            log.append(("run", self.name))
            return True

    class Lengths:
        def __init__(self, values):
            self._values = values

        def values(self):
            log.append(("wait",))
            if self._values is None:
                raise ValueError("bad lengths")
            return self._values

    kept = hopper_fwd._ByLengths()
    kept.put(((0, 5), (0, 5)), FakeReplay("a"))
    kept.put(((0, 9), (0, 9)), FakeReplay("b"))
    assert kept.run({}, Lengths(((0, 9), (0, 9))))
    assert log == [("prepare", "b"), ("wait",), ("launch", "b")]
    log.clear()
    assert kept.run({}, Lengths(((0, 5), (0, 5))))
    assert log == [("prepare", "b"), ("wait",), ("run", "a")] and kept.last[1].name == "a"
    log.clear()
    assert not kept.run({}, Lengths(((0, 6), (0, 6))))
    log.clear()
    with pytest.raises(ValueError, match="bad lengths"):
        kept.run({}, Lengths(None))
    assert ("launch", "a") not in log and not any(e[0] == "run" for e in log)


@pytest.mark.parametrize("family", ["portable", "hopper", "hopper-named"])
@pytest.mark.parametrize("bad", ["max-short", "decreasing", "no-keys-claimed"])
def test_varlen_lengths_are_checked_before_any_launch(family, bad, monkeypatch):
    """The checks copy the lengths to the host without waiting (checks.HostLengths: nothing
    read yet when they return); every family's forward and backward reads and checks them
    before it launches anything, the Hopper forward after setting its launch up and before
    any early return (max_seqlen_k 0 against sequences that have keys). Kernel launches are
    stubbed to fail: the ValueError must come first."""
    import dataclasses

    from diyfa.attention import checks, hopper_bwd, hopper_fwd, portable

    q, k, v, cu_q, cu_k = _packed([3, 4], [5, 2], 4, 2, 128, torch.bfloat16)
    max_q, max_k = 4, 5
    if bad == "max-short":
        max_k, match = 4, "max_seqlen_k=4 is less than the longest sequence"
    elif bad == "decreasing":
        cu_k, match = torch.tensor([0, 8, 7], dtype=torch.int32, device=DEVICE), "non-decreasing"
    else:
        max_k, match = 0, "max_seqlen_k=0 is less than the longest sequence"
    p = checks.check_varlen_inputs(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                   softmax_scale=None)  # fmt: skip
    assert isinstance(p.cu_host, checks.HostLengths) and p.cu_host._values is None
    p = dataclasses.replace(p, capability=(9, 0), aligned16=True)

    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched before the lengths were checked")

    for module in (portable, hopper_fwd, hopper_bwd):
        monkeypatch.setattr(module, "launch", no_launch, raising=False)
    monkeypatch.setattr(portable, "_launch", no_launch)
    monkeypatch.setattr(hopper_fwd, "kernel_limits", lambda index: {"sm_count": 132})
    fam = {"portable": portable.FAMILY, "hopper": hopper_fwd.FAMILY,
           "hopper-named": hopper_fwd.FAMILY.named}[family]  # fmt: skip
    with pytest.raises(ValueError, match=match):
        fam.forward(q, k, v, p)
    p = dataclasses.replace(p, cu_host=checks.check_varlen_inputs(
        q, k, v, cu_q, cu_k, max_q, max_k, causal=True, softmax_scale=None).cu_host)
    out, lse2 = torch.zeros(7, 4, 128, dtype=torch.bfloat16), torch.zeros(4, 7)
    with pytest.raises(ValueError, match=match):
        fam.backward(out, q, k, v, out, lse2, p)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["hopper", "portable"])
def test_gpu_varlen_remembered_lengths_queue_without_waiting(backend):
    """With a cu_seqlens tensor read before and unchanged, a packed call queues its kernels
    without waiting for the GPU: it returns while a long kernel queued before it still runs
    (and gives the same output as with a fresh read); after an in-place write to the tensor
    the call waits for its copy again and runs the new lengths (bitwise what a new tensor of
    them gives; the Hopper forward's work list comes from the host's copy)."""
    if backend == "hopper" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper forward needs sm90")
    q, k, v, cu_q, cu_k = _packed([300, 1000, 77], [500, 1000, 90], 8, 2, 128, torch.bfloat16,
                                  device="cuda")  # fmt: skip
    q, k, v = (t.detach() for t in (q, k, v))

    def run():
        return diyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, 1000, 1000, causal=True,
                                            backend=backend)  # fmt: skip

    first = run()
    torch.cuda.synchronize()
    busy = torch.cuda.Event()
    torch.cuda._sleep(500_000_000)  # ~0.3 s of one SM
    busy.record()
    out = run()
    assert not busy.query(), "the call waited for the GPU"
    torch.cuda.synchronize()
    assert torch.equal(out, first)
    cu_q.copy_(torch.tensor([0, 700, 1300, 1377], dtype=torch.int32))  # in place
    torch.cuda._sleep(500_000_000)
    busy.record()
    moved = run()
    assert busy.query(), "the call did not wait for the new lengths"
    fresh = diyfa.flash_attention_varlen(q, k, v, cu_q.clone(), cu_k, 1000, 1000, causal=True,
                                         backend=backend)  # fmt: skip
    assert torch.equal(moved, fresh) and not torch.equal(moved, first)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_varlen(dtype, causal):
    g = torch.Generator().manual_seed(3)
    lens_q = torch.randint(0, 3000, (9,), generator=g).tolist()
    lens_k = [n + int(m) for n, m in zip(lens_q, torch.randint(0, 500, (9,), generator=g),
                                         strict=True)]  # fmt: skip
    _run_and_check(lens_q, lens_k, 8, 2, 128, dtype, causal, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lens_q, lens_k, h, hk, d, dtype", [
    ([5, 0, 1700, 333, 1, 2048], [9, 3, 1700, 20, 0, 4100], 8, 2, 128, torch.bfloat16),
    ([1000, 64, 129], [1000, 64, 4000], 4, 4, 64, torch.float16),
    ([300, 77], [257, 700], 4, 1, 256, torch.bfloat16),
    ([513, 2], [513, 90], 2, 2, 96, torch.float16),
    ([1, 700, 0, 1025], [64, 700, 5, 1030], 8, 2, 192, torch.float16),
], ids=["d128-gqa-empty", "d64", "d256-mqa", "d96", "d192-gqa-empty"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
def test_gpu_hopper_varlen(lens_q, lens_k, h, hk, d, dtype, causal, deterministic, monkeypatch):
    """Packed sequences through the Hopper forward (backend="hopper": batch-of-one TMA views,
    rows and keys offset per sequence, O by a masked store) and the Gluon backward (atomic
    dQ by TMA reduce-adds into a (1, heads, total, d) workspace, or the portable dQ kernel
    when deterministic and above d128; a sequence's last key block's dK/dV by masked stores):
    zero-length sequences on both sides, tiles that run past a sequence into the next one,
    seqlen_q != seqlen_k both ways, GQA/MQA, d64..256."""
    from diyfa.attention import hopper_bwd

    monkeypatch.setattr(hopper_bwd, "WIDE_DQ_ATOMIC", True)  # ("fast" above d128: atomic too)
    _run_and_check(lens_q, lens_k, h, hk, d, dtype, causal, device="cuda", backend="hopper",
                   deterministic=deterministic)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lens_q, lens_k, h, hk, d, dtype", [
    ([5, 0, 1700, 333, 1, 2048], [9, 3, 1700, 20, 0, 4100], 8, 2, 128, torch.bfloat16),
    ([1000, 64, 129, 7], [1000, 64, 300, 2500], 4, 4, 64, torch.bfloat16),
    ([5, 0, 1700, 333, 1, 2048], [9, 3, 1700, 20, 0, 4100], 8, 2, 128, torch.float16),
], ids=["d128-gqa-empty", "d64", "d128-gqa-empty-fp16"])
def test_gpu_hopper_varlen_frozen_max_at_any_length(lens_q, lens_k, h, hk, d, dtype, causal,
                                                    monkeypatch):
    """Packed 16-bit sequences through the frozen max (hopper_fwd.FROZEN_MAX) whatever their
    lengths, in inference without the LSE: out against the per-sequence float64 reference
    by the 2x rule. With the LSE returned and gradients, the running max."""
    from .test_hopper_attention import _frozen_runs, _spy_launches

    seen = _spy_launches(monkeypatch)
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, h, hk, d, dtype, "cuda")
    with torch.no_grad():
        out = diyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                           causal=causal, backend="hopper")  # fmt: skip
    assert seen and all(_frozen_runs(seen))
    do = torch.randn_like(out)
    ref, _, _ = _reference(q, k, v, cu_q, cu_k, causal, torch.float64, do)
    pt, _, _ = _reference(q, k, v, cu_q, cu_k, causal, dtype, do)
    _check("out", out, pt, ref, 2, dtype)
    seen.clear()
    _run_and_check(lens_q, lens_k, h, hk, d, dtype, causal, device="cuda",
                   backend="hopper")  # fmt: skip
    assert seen and not any(_frozen_runs(seen))


@pytest.mark.gpu
def test_gpu_hopper_varlen_confines_bad_values():
    """inf and NaN in one sequence's K and V stay in it: the Hopper packed forward's last
    key block of sequence 0 runs into sequence 1's rows (TMA clips only at the tensor's end),
    whose V rows it zeroes before P @ V; sequence 0's output equals a clean run's."""
    from diyfa.attention import hopper_fwd as hf

    q, k, v, cu_q, cu_k = _packed([100, 50], [70, 90], 4, 2, 128, torch.bfloat16, "cuda")
    clean = diyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, 100, 90, backend="hopper")
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[70:75], v2[70:72], v2[72:74] = float("nan"), float("inf"), float("nan")
    dirty = diyfa.flash_attention_varlen(q, k2, v2, cu_q, cu_k, 100, 90, backend="hopper")
    assert torch.equal(dirty[:100], clean[:100])
    # The frozen max (hopper_fwd.FROZEN_MAX, here at any length; inference without the
    # LSE): sequence 1's rows come out NaN, so the call's second launch redoes it all with
    # the running max, which the clean run above took
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():  # (no LSE read: frozen)
        mp.setattr(hf, "FROZEN_MIN_KEYS", ((128, 0),))
        mp.setattr(hf, "FROZEN_MIN_PAIRS", 0)
        dirty = diyfa.flash_attention_varlen(q, k2, v2, cu_q, cu_k, 100, 90, backend="hopper")
    assert torch.equal(dirty[:100], clean[:100])


_COMPILE_VARLEN = """
from diyfa.attention import portable as P

for kernel in ("attn_fwd", "attn_bwd_dq", "attn_bwd_dkdv"):
    P.compile_for_hopper(kernel, VARLEN=True)
print("compiled")
"""


def test_varlen_kernels_compile_for_hopper():
    """The interpreter runs the varlen kernels but does not compile them: compile the three
    (VARLEN, causal) for sm90 with Triton's bundled toolchain, in a fresh process (the
    interpreter leaves Triton's language module patched)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_VARLEN], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
