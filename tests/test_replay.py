"""Repeated calls replay their launches (diyfa._launcher.Replay): GPU tests.

A call whose signature (problem, options, dO's strides) was seen before runs the kept
launches with its own tensors. These tests check that the replayed results are bitwise
those of the full path, that replays happen where expected, and that a call the
recording cannot serve (another alignment) takes the full path.
"""

import pytest
import torch

import diyfa
from diyfa import _launcher


def _inputs(seed, layout, device="cuda", dtype=torch.bfloat16):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def make(h, s):
        shape = (2, h, s, 64) if layout == "bhsd" else (2, s, h, 64)
        return torch.randn(shape, generator=g).to(device, dtype).requires_grad_()

    q, k, v = make(4, 300), make(2, 333), make(2, 333)
    do = torch.randn(q.shape, generator=g).to(device, dtype)
    return q, k, v, do


def count_replays(monkeypatch) -> list:
    """A list that gets, from now on, True for each replay's launch (``Replay.launch``:
    ``Replay.run``'s, or a prepared one's, as the packed forward's after the lengths'
    wait) and False for each ``Replay.run`` that sent the call down the full path."""
    runs = []
    run, launch = _launcher.Replay.run, _launcher.Replay.launch

    def counted(self, roles):
        done = run(self, roles)
        if not done:
            runs.append(False)
        return done

    def launched(self, prepared):
        runs.append(True)
        launch(self, prepared)

    monkeypatch.setattr(_launcher.Replay, "run", counted)
    monkeypatch.setattr(_launcher.Replay, "launch", launched)
    return runs


CASES = [("portable", False, "bhsd", False), ("portable", True, "bshd", False),
         ("hopper", False, "bshd", False), ("hopper", True, "bhsd", False),
         ("hopper", False, "bhsd", True), ("hopper", True, "bshd", True)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("backend,causal,layout,deterministic", CASES)
def test_gpu_repeated_calls_replay_their_launches(backend, causal, layout, deterministic,
                                                  monkeypatch):  # fmt: skip
    if backend == "hopper" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper family needs an sm90 GPU")
    runs = count_replays(monkeypatch)
    setups = [_inputs(seed, layout) for seed in range(3)]
    q, k, v, do = _inputs(3, layout)  # compiled and configs chosen: every launch lean
    diyfa.flash_attention(q, k, v, causal=causal, layout=layout, backend=backend,
                          deterministic=deterministic).backward(do)  # fmt: skip
    runs.clear()
    results = []
    for replay in (True, False):
        _launcher.forget_replays()
        results.append([])
        for q, k, v, do in setups:
            q.grad = k.grad = v.grad = None
            out = diyfa.flash_attention(q, k, v, causal=causal, layout=layout,
                                        backend=backend, deterministic=deterministic)
            out.backward(do)
            results[-1].append((out.detach(), q.grad, k.grad, v.grad))
            if not replay:
                _launcher.forget_replays()
        if replay:
            assert runs == [True] * 4, runs  # forward and backward of the 2nd and 3rd calls
    assert len(runs) == 4  # the second pass replayed nothing
    atomic = backend == "hopper" and not deterministic  # dQ's order of additions varies
    for a, b in zip(*results, strict=True):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if atomic and i == 1:
                torch.testing.assert_close(x, y, rtol=1e-2, atol=1e-2)
            else:
                assert torch.equal(x, y), i


@pytest.mark.gpu
def test_gpu_replay_passes_over_another_alignment(monkeypatch):
    """The signature says whether all of q, k, v are 16-byte aligned; which one is not is a
    specialisation of its own: a call with another misaligned tensor does not run the kept
    launches, the full path does (and gives the right result)."""
    runs = count_replays(monkeypatch)
    _launcher.forget_replays()
    q, k, v, _ = (t.detach() for t in _inputs(0, "bhsd"))

    def odd(t):  # the same values 2 bytes past a 16-byte boundary
        store = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")
        return store[1:].view(t.shape).copy_(t)

    want = diyfa.flash_attention(q, odd(k), v, backend="portable")  # recorded
    assert torch.equal(diyfa.flash_attention(q, odd(k), v, backend="portable"), want)
    got = diyfa.flash_attention(odd(q), k, v, backend="portable")
    assert runs == [True, False]
    torch.testing.assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shared_cu", [True, False], ids=["one-cu", "two-cu"])
def test_gpu_packed_forward_replays_per_lengths(causal, shared_cu, monkeypatch):
    """The packed Hopper forward keeps its launch per shapes and lengths: a second call with
    the same lengths (other tensors, other cu_seqlens tensors holding them) replays it and
    gives bitwise the first call's result on the same values; a call with other lengths
    but the same shapes takes the full path, and is right (against the calls of a fresh
    process: the replays forgotten)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper forward needs an sm90 GPU")
    runs = count_replays(monkeypatch)
    g = torch.Generator(device="cpu").manual_seed(5)
    total, h, hk, d = 1000, 4, 2, 128
    q, k, v = (torch.randn(total, n, d, generator=g).to("cuda", torch.bfloat16)
               for n in (h, hk, hk))  # fmt: skip

    def cu(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                            device="cuda")  # fmt: skip

    def call(lengths, q=q, k=k, v=v):
        cu_q = cu(lengths)
        cu_k = cu_q if shared_cu else cu(lengths)
        return diyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, 700, 700, causal=causal,
                                            backend="hopper")  # fmt: skip

    a, b = [300, 700], [650, 350]
    _launcher.forget_replays()
    first = call(a)
    runs.clear()
    again = call(a, q.clone(), k.clone(), v.clone())
    assert runs == [True], runs
    assert torch.equal(again, first)
    other = call(b)
    assert runs == [True], runs  # no launch kept for these lengths: the full path
    _launcher.forget_replays()
    assert torch.equal(other, call(b))
    assert torch.equal(first, call(a))


@pytest.mark.gpu
def test_gpu_plain_calls_reuse_their_checks(monkeypatch):
    """A call on the GPU whose signature passed the checks before skips them
    (checks.checked_before): the same Problem (with the call's own sinks), no check_inputs;
    any difference the checks look at (an option's type, a window side's, an alignment, a
    dtype, the sinks' dtype, the deterministic flag) takes the full checks, so bad input
    still gets its error."""
    import diyfa.attention as attention
    from diyfa.attention import checks

    monkeypatch.setattr(checks, "_CHECKED", {})  # nothing checked before this test
    calls = []
    check = attention.check_inputs
    monkeypatch.setattr(attention, "check_inputs",
                        lambda *a, **kw: calls.append(1) or check(*a, **kw))  # fmt: skip
    q, k, v, _ = (t.detach() for t in _inputs(0, "bhsd"))
    want = diyfa.flash_attention(q, k, v, causal=True)
    assert len(calls) == 1
    for _ in range(2):
        assert torch.equal(diyfa.flash_attention(q.clone(), k, v, causal=True), want)
    assert len(calls) == 1  # checked once
    with pytest.raises(TypeError, match="causal"):
        diyfa.flash_attention(q, k, v, causal=1)  # equal to True, but not a bool
    store = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    odd = store[1:].view(q.shape).copy_(q)  # 2 bytes past a 16-byte boundary
    torch.testing.assert_close(diyfa.flash_attention(odd, k, v, causal=True), want)
    with pytest.raises(TypeError, match="share a dtype"):
        diyfa.flash_attention(q.half(), k, v, causal=True)
    capped = diyfa.flash_attention(q, k, v, causal=True, softcap=30.0)  # a variant's options
    assert torch.equal(diyfa.flash_attention(q, k, v, causal=True, softcap=30.0), capped)
    assert len(calls) == 1 + 4  # (checked once)
    sinks = [torch.nn.Parameter(torch.randn(4, device="cuda")) for _ in range(2)]  # (a model's)
    got = [diyfa.flash_attention(q, k, v, causal=True, window_size=(1, 0), sinks=s)
           for s in sinks]  # fmt: skip
    assert len(calls) == 1 + 5  # the sinks' first call
    with pytest.raises(TypeError, match="window_size"):  # equal to (1, 0), but not ints
        diyfa.flash_attention(q, k, v, causal=True, window_size=(True, 0), sinks=sinks[0])
    with pytest.raises(TypeError, match="sinks.dtype"):
        diyfa.flash_attention(q, k, v, causal=True, window_size=(1, 0),
                              sinks=sinks[0].detach().int())  # fmt: skip
    monkeypatch.setattr(checks, "_CHECKED", {})
    for s, want in zip(sinks, got, strict=True):  # each call's own sinks, fully checked now
        assert torch.equal(diyfa.flash_attention(q, k, v, causal=True, window_size=(1, 0),
                                                 sinks=s), want)  # fmt: skip
    assert not torch.equal(got[0], got[1])
    with pytest.raises(ValueError, match="layout"):
        diyfa.flash_attention(q, k, v, causal=True, layout=["bhsd"])  # unhashable: checked


def test_replay_key_holds_the_layout_of_sinks_and_slopes():
    """Sinks and ALiBi slopes are a call's own tensors: the replay key holds their dtype,
    shape and strides, not the tensors, so calls with other sinks or slopes of the same kind
    share a key and the replay binds theirs (``own_roles``); another shape or dtype, or no
    sinks, is another key. Packed sequences, fp8 and dropout stay unreplayed."""
    import types

    from diyfa.attention import checks, portable

    from .conftest import DEVICE

    gpu = types.SimpleNamespace(is_cuda=True)  # (the key is None off the GPU)
    q, k, v, _ = (t.detach() for t in _inputs(0, "bhsd", device=DEVICE))

    def key(**kw):
        p = checks.check_inputs(q, k, v, causal=True, softmax_scale=None, layout="bhsd",
                                align="bottom_right", **kw)  # fmt: skip
        return p, portable.replay_key("fwd", gpu, p)

    def vec(fill, *shape, dtype=torch.float32):
        return torch.full(shape, fill, dtype=dtype, device=DEVICE)

    plain = key()[1]
    p1, k1 = key(sinks=vec(0.0, 4))
    p2, k2 = key(sinks=vec(1.0, 4))
    assert k1 == k2 and hash(k1) == hash(k2) and k1 != plain
    assert portable.own_roles({}, p2)["sinks"] is p2.sinks
    assert key(sinks=vec(0.0, 4, dtype=torch.bfloat16))[1] != k1
    p3, k3 = key(alibi_slopes=vec(1.0, 4))
    assert k3 == key(alibi_slopes=vec(0.0, 4))[1] != key(alibi_slopes=vec(1.0, 2, 4))[1]
    assert set(portable.own_roles({}, p3)) == {"slopes"}
    assert k1[1].sinks is None and k3[1].alibi_slopes is None  # (no tensor kept in a key)
    assert key(dropout_p=0.1)[1] is None


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["portable", "hopper"])
@pytest.mark.parametrize("variant", ["sinks", "alibi"])
def test_gpu_sinks_and_slopes_replay(backend, variant, monkeypatch):
    """Calls with sinks or ALiBi slopes replay their launches too, each with its own sinks or
    slopes: forward and backward (deterministic: bitwise comparable) of the second and third
    calls replayed, and bitwise what the full path gives them (the sinks' gradient too)."""
    if backend == "hopper" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper family needs an sm90 GPU")
    runs = count_replays(monkeypatch)

    def setup(seed):
        q, k, v, do = _inputs(seed, "bshd")
        g = torch.Generator(device="cpu").manual_seed(100 + seed)
        own = torch.randn(4, generator=g).to("cuda")
        if variant == "alibi":
            own = own.abs() / 4
        return q, k, v, do, own.requires_grad_(variant == "sinks")

    def call(q, k, v, do, own):
        kw = {"sinks": own} if variant == "sinks" else {"alibi_slopes": own}
        q.grad = k.grad = v.grad = own.grad = None
        out = diyfa.flash_attention(q, k, v, causal=True, layout="bshd", backend=backend,
                                    deterministic=True, **kw)  # fmt: skip
        out.backward(do)
        return out.detach(), q.grad, k.grad, v.grad, own.grad

    call(*setup(3))  # compiled and configs chosen
    setups = [setup(seed) for seed in range(3)]
    _launcher.forget_replays()
    runs.clear()
    replayed = [call(*s) for s in setups]
    assert runs == [True] * 4, runs  # forward and backward of the 2nd and 3rd calls
    for s, got in zip(setups, replayed, strict=True):
        _launcher.forget_replays()
        for i, (x, y) in enumerate(zip(got, call(*s), strict=True)):
            assert (x is None and y is None) or torch.equal(x, y), i
