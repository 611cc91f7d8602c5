"""The lean launch path's specialisation key against Triton's own (CPU), and its launches (GPU).

FastLauncher reuses a compiled kernel whenever two calls have equal keys, so the key must
never merge two argument values that Triton would compile differently.
"""

import itertools

import pytest
import torch
import triton
import triton.language as tl
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor

from diyfa._launcher import FastLauncher, spec_key


def _native():
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    return lambda arg: native_specialize_impl(backend, arg, False, True, True)


def _values():
    base = torch.zeros(64, dtype=torch.float16)
    ints = [0, 1, 2, 15, 16, 17, 32, 48, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16,
            2**40, 2**63 - 16, 2**63, 2**63 + 16, -(2**31), -(2**31) - 1, -(2**40)]  # fmt: skip
    floats = [0.0, 1.0, 0.125, 16.0, -3.5]
    tensors = [base, base[1:], base[8:], torch.zeros(8, dtype=torch.bfloat16),
               torch.zeros(8, dtype=torch.float32), torch.zeros(8, dtype=torch.float8_e4m3fn),
               torch.zeros(8, dtype=torch.int32)]  # fmt: skip
    m16, b16 = torch.zeros(64, 64, dtype=torch.float16), torch.zeros(64, 64, dtype=torch.bfloat16)
    descs = [TensorDescriptor.from_tensor(m16, [32, 32]),
             TensorDescriptor.from_tensor(m16, [32, 64]),
             TensorDescriptor.from_tensor(m16[:32], [32, 32]),  # same dtype and block: one kernel
             TensorDescriptor.from_tensor(b16, [32, 32]),
             TensorDescriptor(m16[None], [1, 64, 64], [4096, 64, 1], [1, 32, 32])]  # fmt: skip
    # Gluon's descriptors also carry the shared-memory layout, part of the kernel's type
    lay = gl.NVMMASharedLayout.get_default_for
    gluon_descs = [GluonDescriptor.from_tensor(m16, [32, 32], lay([32, 32], gl.float16)),
                   GluonDescriptor.from_tensor(m16[:32], [32, 32], lay([32, 32], gl.float16)),
                   GluonDescriptor.from_tensor(m16, [32, 64], lay([32, 64], gl.float16)),
                   GluonDescriptor.from_tensor(m16, [32, 64], lay([32, 32], gl.float16)),
                   GluonDescriptor.from_tensor(m16, [32, 32], lay([32, 32], gl.float16, True)),
                   GluonDescriptor.from_tensor(b16, [32, 32], lay([32, 32], gl.bfloat16))]
    return ints + floats + [True, False, None] + tensors + descs + gluon_descs


def test_spec_key_never_merges_what_triton_distinguishes():
    native = _native()
    values = _values()
    seen = 0
    for a, b in itertools.combinations(values, 2):
        if spec_key(a) == spec_key(b):
            seen += 1
            assert native(a) == native(b), (a, b, spec_key(a), native(a), native(b))
    assert seen > 10  # the check compared real collisions (e.g. 16 and 32, 0.0 and 1.0)


def test_spec_key_separates_alignment_width_and_one():
    base = torch.zeros(64, dtype=torch.float16)
    assert spec_key(base) != spec_key(base[1:])  # 16-byte aligned vs 2-byte aligned
    assert spec_key(1) != spec_key(17)  # 1 is compiled in as a constant
    assert spec_key(16) != spec_key(17)
    assert spec_key(16) != spec_key(2**32)  # i32 vs i64
    assert spec_key(2**63) != spec_key(2**62 + 16)  # u64 vs i64
    assert spec_key(True) != spec_key(1) and spec_key(False) != spec_key(0.0)


def _copy(X, Y, n, stride, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs * stride, mask=offs < n), mask=offs < n)


_copy_kernel = triton.jit(_copy)


def test_fast_launcher_key_keeps_constexpr_values_apart():
    """BLOCK is compiled in: 64 and 128 are different kernels though both are multiples of
    16 (the bug this guards against reused a head_dim-64 kernel for head_dim 128)."""
    from triton.runtime.jit import JITFunction

    launch = FastLauncher(JITFunction(_copy))
    x, y = torch.zeros(64), torch.zeros(64)
    assert launch.key([x, y, 32, 1, 64]) != launch.key([x, y, 32, 1, 128])
    assert launch.key([x, y, 32, 1, 64]) != launch.key([x, y, 32, 1, True])
    assert launch.key([x, y, 32, 1, 64]) == launch.key([x, y, 48, 1, 64])  # n: both % 16
    assert launch.key([x, y, 32, 1, 64]) != launch.key([x, y, 33, 1, 64])
    assert launch.key([x, y, 32, 1, 64]) != launch.key([x[1:], y, 32, 1, 64])


def test_fast_launcher_key_agrees_with_spec_key():
    """The launch path's inline key gives, argument by argument, what spec_key (checked
    against Triton's own specialisation above) and the constexpr key give."""
    from triton.runtime.jit import JITFunction

    from diyfa._launcher import _constexpr_key

    launch = FastLauncher(JITFunction(_copy))
    for v in _values():
        for kind in ("X", "BLOCK"):  # a specialised parameter, a constexpr one
            values = [v if name == kind else 16 for name in launch.names]
            got = launch.key(values)[launch.names.index(kind)]
            want = (_constexpr_key if kind == "BLOCK" else spec_key)(v)
            assert got == want, (kind, v, got, want)


def test_fast_launcher_refuses_unmodelled_specialisation():
    # JITFunction directly: under the interpreter triton.jit returns an interpreted function.
    from triton.runtime.jit import JITFunction

    with pytest.raises(ValueError, match="n has specialisation options"):
        FastLauncher(JITFunction(_copy, do_not_specialize=["n"]))
    assert FastLauncher(JITFunction(_copy)).names == ("X", "Y", "n", "stride", "BLOCK")


@pytest.mark.gpu
def test_fast_launcher_switches_kernels_with_alignment_and_strides():
    """Aligned, then misaligned and odd-strided arguments: each launch must be right."""
    launch = FastLauncher(_copy_kernel)
    x = torch.randn(4096, device="cuda")
    cases = [(0, 1, 1024, 128), (0, 1, 1024, 128), (1, 1, 1000, 128), (3, 3, 999, 128),
             (0, 16, 64, 128), (0, 1, 1024, 64), (0, 1, 1024, 128), (5, 1, 1, 128),
             (0, 1, 1000, 32)]  # (offset, stride, n, BLOCK)
    for offset, stride, n, block in cases:
        src = x[offset:]
        y = torch.full((n,), -1.0, device="cuda")
        launch((triton.cdiv(n, block),), dict(X=src, Y=y, n=n, stride=stride, BLOCK=block), 4, 1)
        torch.testing.assert_close(y, src[: n * stride : stride], rtol=0, atol=0)
    assert len(launch._compiled) >= 4  # distinct specialisations were compiled, not merged
    before = launch.slow_launches
    y = torch.empty(1024, device="cuda")
    for _ in range(3):  # a key seen before takes the fast path
        launch((8,), dict(X=x, Y=y, n=1024, stride=1, BLOCK=128), 4, 1)
    assert launch.slow_launches == before
    torch.testing.assert_close(y, x[:1024], rtol=0, atol=0)


def test_launch_hooks_are_detected():
    from triton import knobs

    from diyfa._launcher import _hooked

    assert not _hooked(knobs.runtime.launch_enter_hook)  # nothing installed by default
    assert not _hooked(None)

    def hook(*args):
        pass

    chain = type(knobs.runtime.launch_enter_hook)()
    chain.add(hook)
    assert _hooked(chain) and _hooked(hook)


def test_host_cdiv_and_next_power_of_2_match_triton():
    from diyfa._launcher import cdiv, next_power_of_2

    for n in [1, 2, 3, 15, 16, 17, 1000, 1023, 1024, 1025, 4097, 2**31 + 5]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 16, 64, 128):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


def _copy_jit():
    from triton.runtime.jit import JITFunction

    return JITFunction(_copy)  # (triton.jit gives an interpreted function on the CPU)


def _recorded(monkeypatch):
    """Replay without a GPU: device 0, compiled kernels replaced by a recorder of the values
    each launch would get."""
    from diyfa import _launcher

    ran = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_launcher, "run_compiled",
                        lambda kernel, grid, device, values: ran.append((kernel, grid, values)))
    return ran


def test_replay_puts_each_role_where_the_recording_had_it(monkeypatch):
    """Tensors, views of them (a transposed base: the same address) and descriptors over
    views are matched to roles by address; each replay gets the new call's tensors there,
    descriptors rebased with the recorded shape, strides and block; constants stay."""
    from diyfa._launcher import Replay

    ran = _recorded(monkeypatch)
    _COPY = _copy_jit()
    lay = gl.NVMMASharedLayout.get_default_for([32, 32], gl.float16)

    def call():
        x = torch.zeros(64, 64, dtype=torch.float16)
        y = torch.zeros(64, 64, dtype=torch.float16)
        return x, y

    const = torch.zeros(16)
    x, y = call()
    desc = GluonDescriptor.from_tensor(x[:, :32], [32, 32], lay)  # a view of x
    args = dict(X=y.t(), Y=const, n=7, stride=3, BLOCK=32)  # Y: a constant
    launches = [(_COPY, "k1", (2,), args),
                (_COPY, "k2", (3, 1), dict(args, X=desc.base, Y=x))]
    replay = Replay.record(launches, dict(x=x, y=y), constants=(const,))
    assert replay is not None
    del x, y, desc
    x2, y2 = call()
    assert replay.run(dict(x=x2, y=y2))
    (k1, g1, v1), (k2, g2, v2) = ran
    assert (k1, g1, k2, g2) == ("k1", (2,), "k2", (3, 1))
    assert v1[0] is y2 and v1[1] is const and v1[2:] == [7, 3, 32]
    assert v2[0] is x2 and v2[1] is x2

    # a descriptor slot: rebased on the new tensor, its geometry kept
    ran.clear()
    x, y = call()
    desc = GluonDescriptor.from_tensor(x[:, :32], [32, 32], lay)
    replay = Replay.record([(_COPY, "k", (1,), dict(args, X=desc))], dict(x=x, y=y),
                           constants=(const,))  # fmt: skip
    x2, y2 = call()
    assert replay.run(dict(x=x2, y=y2))
    new = ran[0][2][0]
    assert type(new) is GluonDescriptor and new is not desc and new.base is x2
    assert (new.shape, new.strides, new.block_shape, new.layout) == (
        desc.shape, desc.strides, desc.block_shape, desc.layout)
    assert replay.launches[0][3][0] is None  # the recording keeps no tensor of its call


def test_replay_refuses_what_it_cannot_tell_apart(monkeypatch):
    """Nothing is recorded for a tensor outside the roles or two roles at one address; a
    replay whose tensor has another 16-byte alignment, or that runs inside compile_only,
    launches nothing."""
    from diyfa._launcher import Replay, compile_only

    ran = _recorded(monkeypatch)
    _COPY = _copy_jit()
    x, y, other = (torch.zeros(64, dtype=torch.float16) for _ in range(3))
    args = dict(X=x, Y=y, n=7, stride=1, BLOCK=32)
    assert Replay.record([(_COPY, "k", (1,), args)], dict(x=x)) is None  # y unknown
    assert Replay.record([(_COPY, "k", (1,), args)], dict(x=x, y=y, z=x)) is None
    replay = Replay.record([(_COPY, "k", (1,), args)], dict(x=x, y=y))
    store = torch.zeros(65, dtype=torch.float16)
    assert not replay.run(dict(x=store[1:], y=other))  # 2-byte aligned: another kernel
    with compile_only():
        assert not replay.run(dict(x=other, y=x))
    assert ran == []
    assert replay.run(dict(x=other, y=x))
    assert ran[0][2][:2] == [other, x]


def test_direct_replay_passes_the_c_launcher_what_tritons_wrapper_would(monkeypatch):
    """A replay calls the compiled kernel's C launcher itself (``_launcher._Direct``): the
    arguments must be those Triton's own Python launcher (Triton 3.6's descriptor-expanding
    wrapper, used here as it is) passes, tensors by address; a descriptor's map is encoded
    once per address; scratch memory or an unknown launcher shape leave the replay on
    ``run_compiled``."""
    from types import SimpleNamespace

    from triton.backends.nvidia import driver as nv

    from diyfa import _launcher
    from diyfa._launcher import Replay

    encoded = []

    def encode(desc, meta):  # stands in for cuTensorMapEncodeTiled (needs the driver)
        encoded.append(desc.base.data_ptr())
        return [("map", desc.base.data_ptr(), tuple(desc.block_shape)), *desc.shape,
                *desc.strides]  # fmt: skip

    monkeypatch.setattr(nv, "make_tensordesc_arg", encode)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    ran = _recorded(monkeypatch)
    got = []
    _COPY = _copy_jit()
    # _copy(X, Y, n, stride, BLOCK): X a descriptor, Y a pointer
    inner = nv.wrap_handle_tensordesc(lambda *a: got.append(a),
                                      {0: "tensordesc<fp16[32, 32]>", 1: "*fp16", 2: "i32",
                                       3: "i32", 4: "constexpr"},
                                      [dict(fp4_padded=False)])  # fmt: skip
    kernel = SimpleNamespace(run=SimpleNamespace(launch=inner, global_scratch_size=0,
                                                 profile_scratch_size=0,
                                                 launch_cooperative_grid=False,
                                                 launch_pdl=True),
                             function=1234, packed_metadata=(4, 1, 0))  # fmt: skip
    lay = gl.NVMMASharedLayout.get_default_for([32, 32], gl.float16)

    def call():
        x = torch.zeros(64, 64, dtype=torch.float16)
        return x, torch.zeros(64, dtype=torch.float16)

    x, y = call()
    desc = GluonDescriptor.from_tensor(x, [32, 32], lay)
    replay = Replay.record([(_COPY, kernel, (3, 2), dict(X=desc, Y=y, n=7, stride=3,
                                                          BLOCK=32))],
                           dict(x=x, y=y))  # fmt: skip
    assert replay is not None and type(replay.launches[0][5]) is _launcher._Direct
    calls = [call() for _ in range(3)]
    for x2, y2 in calls + calls[:1]:
        assert replay.run(dict(x=x2, y=y2))
        # what Triton's launcher passes for the same call, tensors as their addresses
        want = []
        new = GluonDescriptor.from_tensor(x2, [32, 32], lay)
        inner(3, 2, 1, 77, 1234, False, True, None, None, (4, 1, 0), None, None, None, new, y2,
              7, 3, 32)  # fmt: skip
        want = got.pop()
        have = got.pop()
        assert have == tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in want)
    assert ran == []  # nothing went through run_compiled
    # one encoding per address: the recording's three calls, the fourth a kept map (the
    # reference calls through `inner` encode every time)
    assert encoded.count(calls[0][0].data_ptr()) == 2 + 1

    # scratch memory, or a launcher of another shape: run_compiled as before
    for run in (SimpleNamespace(**{**vars(kernel.run), "global_scratch_size": 64}),
                SimpleNamespace(**{**vars(kernel.run), "launch": lambda *a: None})):
        other = SimpleNamespace(run=run, function=1, packed_metadata=(4, 1, 0))
        replay = Replay.record([(_COPY, other, (1,), dict(X=desc, Y=y, n=7, stride=3,
                                                           BLOCK=32))],
                               dict(x=x, y=y))  # fmt: skip
        assert replay.launches[0][5] is None
        assert replay.run(dict(x=x, y=y)) and ran[-1][0] is other
