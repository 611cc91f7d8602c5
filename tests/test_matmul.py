"""Tests of diyfa.triton_matmul (both kernels) against a float64 reference.

The rule (flash-attention's): the kernel's max error against ``matmul_ref`` in float64 must be
at most 2x the error PyTorch makes in the same precision (plus 1e-6 for fp32, where both can
be exact). On the CPU the real kernels run under the Triton interpreter on small shapes; the
`gpu` tests take the large shapes, TF32, fp8 against cuBLAS and the Hopper TMA path.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from diyfa.ops import matmul as mm
from diyfa.ops import matmul_ws as mm_ws
from diyfa.ops.matmul import triton_matmul
from diyfa.reference import matmul_ref

HAS_CUDA = torch.cuda.is_available()
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
FP32_FLOOR = 1e-6


def _check_fp32(m: int, k: int, n: int, precision: str, device) -> None:
    """fp32 product judged against torch in the same mode: TF32 vs torch's TF32, ieee vs
    torch's exact fp32."""
    a = _randn(m, k, dtype=torch.float32, device=device)
    b = _randn(k, n, dtype=torch.float32, device=device, seed=1)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        baseline = torch.matmul(a, b)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    _check(triton_matmul(a, b, precision=precision), matmul_ref(a, b), baseline,
           floor=FP32_FLOOR)  # fmt: skip


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _randn(*shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed + 1000 * len(shape) + sum(shape))
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


_MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7}


def _half_ulp(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | float:
    """Half a unit in the last place of ``dtype`` at each reference value: what rounding the
    exact result to a 16-bit output costs any implementation. Near a power of two a tiny
    accumulation difference decides between two grids (bf16 at 511.9: half-ulp 1 below 512,
    2 above), so a max-error rule without it fails on rounding, not on the sum."""
    if dtype not in _MANTISSA_BITS:
        return 0.0
    _, exp = torch.frexp(ref.abs())
    return torch.ldexp(torch.ones_like(ref), exp - 2 - _MANTISSA_BITS[dtype])


def _check(out, ref, baseline, *, floor=0.0, what=""):
    """out's error against ref must be <= 2x baseline's max error (+ floor), plus half an ulp
    of a 16-bit output format at each element (see _half_ulp)."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    err = (out.double() - ref).abs() - _half_ulp(ref, out.dtype)
    allowed = 2 * (baseline.double() - ref).abs().max().item() + floor
    worst = err.max().item() if err.numel() else 0.0
    if not worst <= allowed:  # also catches NaN
        where = np.unravel_index(int(err.argmax()), tuple(err.shape))
        pytest.fail(
            f"{what}: max error beyond half an output ulp {worst:.4g} at {where} > allowed "
            f"{allowed:.4g} (2x torch's error + {floor}); mean {err.mean().item():.4g}"
        )


def _floor(dtype) -> float:
    return FP32_FLOOR if dtype == torch.float32 else 0.0


def _act(x, activation):
    if activation == "relu":
        return F.relu(x)
    if activation == "gelu":
        return F.gelu(x, approximate="tanh")
    if activation == "silu":
        return F.silu(x)
    return x


# --------------------------------------------------------------------------------------------
# Portable kernel: shapes, dtypes, layouts, batches, epilogue
# --------------------------------------------------------------------------------------------
SHAPES = [(1, 17, 33), (17, 1, 100), (33, 100, 1), (100, 33, 17), (257, 17, 33), (17, 257, 100)]


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_odd_shapes(shape, dtype, device):
    M, N, K = shape
    a = _randn(M, K, dtype=dtype, device=device)
    b = _randn(K, N, dtype=dtype, device=device, seed=1)
    _check(triton_matmul(a, b), matmul_ref(a, b), torch.matmul(a, b), floor=_floor(dtype),
           what=f"{shape} {dtype}")  # fmt: skip


def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as ``t`` (rows, cols) in another memory layout."""
    if layout == "transposed":  # column-major
        return t.t().contiguous().t()
    if layout == "sliced":  # every other column of a wider tensor, at an offset
        wide = torch.zeros(t.shape[0] + 1, 2 * t.shape[1] + 3, dtype=t.dtype, device=t.device)
        wide[1:, 3::2] = t
        return wide[1:, 3::2]
    return t


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_name)
@pytest.mark.parametrize("layout_a", ["row", "transposed", "sliced"])
@pytest.mark.parametrize("layout_b", ["row", "transposed", "sliced"])
def test_strided_operands(layout_a, layout_b, dtype, device):
    a = _randn(45, 70, dtype=dtype, device=device)
    b = _randn(70, 38, dtype=dtype, device=device, seed=1)
    a2, b2 = _layout(a, layout_a), _layout(b, layout_b)
    assert torch.equal(a2, a) and torch.equal(b2, b)
    _check(triton_matmul(a2, b2), matmul_ref(a, b), torch.matmul(a, b),
           what=f"a {layout_a}, b {layout_b}")  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_batched(dtype, device):
    a = _randn(3, 40, 33, dtype=dtype, device=device)
    b = _randn(3, 50, 33, dtype=dtype, device=device, seed=1).transpose(1, 2)  # column-major
    _check(triton_matmul(a, b), matmul_ref(a, b), torch.matmul(a, b), floor=_floor(dtype))


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "silu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=_name)
def test_bias_and_activation(activation, dtype, device):
    a = _randn(37, 29, dtype=dtype, device=device)
    b = _randn(29, 41, dtype=dtype, device=device, seed=1)
    bias = _randn(41, dtype=dtype, device=device, seed=2)
    out = triton_matmul(a, b, bias=bias, activation=activation)
    ref = _act(matmul_ref(a, b) + bias.double(), activation)
    _check(out, ref, _act(torch.matmul(a, b) + bias, activation), floor=_floor(dtype),
           what=f"bias + {activation}")  # fmt: skip


def test_scales_and_out_dtype(device):
    """Optional scales on fp16 inputs, per-row a and per-tensor b, written out in fp32."""
    a = _randn(33, 40, dtype=torch.float16, device=device)
    b = _randn(40, 19, dtype=torch.float16, device=device, seed=1)
    sa = torch.rand(33, 1, device=device) + 0.5
    sb = torch.tensor([0.75], device=device)
    out = triton_matmul(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    ref = matmul_ref(a, b) * sa.double() * 0.75
    baseline = torch.matmul(a.float(), b.float()) * sa * sb  # fp32 accumulation, no rounding
    _check(out, ref, baseline, floor=FP32_FLOOR)


@pytest.mark.parametrize("precision", ["tf32", "ieee"])
def test_fp32_precision(precision, device):
    """Under the interpreter both precisions are exact; on the GPU TF32 is judged against
    torch's TF32 and ieee against torch's exact fp32."""
    _check_fp32(65, 48, 33, precision, device)


def test_empty_and_k_zero(device):
    a = torch.zeros(0, 5, device=device, dtype=torch.float16)
    b = torch.zeros(5, 7, device=device, dtype=torch.float16)
    assert triton_matmul(a, b).shape == (0, 7)
    a = torch.zeros(4, 0, device=device, dtype=torch.float16)
    b = torch.zeros(0, 7, device=device, dtype=torch.float16)
    bias = torch.arange(7, device=device, dtype=torch.float32) - 3
    out = triton_matmul(a, b, bias=bias, activation="relu")
    assert torch.equal(out.float(), F.relu(bias).expand(4, 7))


# --------------------------------------------------------------------------------------------
# fp8 (interpreter on the CPU; the GPU tests compare with torch._scaled_mm)
# --------------------------------------------------------------------------------------------
def _fp8_case(dtype_a, dtype_b, M, N, K, per_row, device, b_col_major=True):
    a = (_randn(M, K, dtype=torch.float32, device=device) * 2).to(dtype_a)
    b_t = (_randn(N, K, dtype=torch.float32, device=device, seed=1) * 2).to(dtype_b)
    b = b_t.t() if b_col_major else b_t.t().contiguous()
    if per_row:
        sa = torch.rand(M, device=device) * 0.5 + 0.25
        sb = torch.rand(N, device=device) * 0.5 + 0.25
    else:
        sa, sb = torch.tensor(0.3, device=device), torch.tensor(1.7, device=device)
    ref = matmul_ref(a, b) * sa.double().reshape(-1, 1) * sb.double().reshape(1, -1)
    # What an exact fp32 accumulation rounded once to bf16 gives: the best a kernel can do.
    exact = (torch.matmul(a.float(), b.float()) * sa.reshape(-1, 1) * sb.reshape(1, -1))
    return a, b, sa, sb, ref, exact.to(torch.bfloat16)


FP8_PAIRS = [(torch.float8_e4m3fn, torch.float8_e4m3fn), (torch.float8_e5m2, torch.float8_e5m2),
             (torch.float8_e4m3fn, torch.float8_e5m2)]  # fmt: skip


@pytest.mark.parametrize("per_row", [False, True], ids=["per-tensor", "per-row"])
@pytest.mark.parametrize("pair", FP8_PAIRS, ids=lambda p: f"{_name(p[0])}x{_name(p[1])}")
def test_fp8(pair, per_row, device):
    a, b, sa, sb, ref, baseline = _fp8_case(*pair, 40, 48, 96, per_row, device)
    out = triton_matmul(a, b, scale_a=sa, scale_b=sb)
    assert out.dtype == torch.bfloat16
    _check(out, ref, baseline, what=f"fp8 {pair} per_row={per_row}")


# --------------------------------------------------------------------------------------------
# The Hopper TMA kernel (forced; under the interpreter it runs anywhere)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("subtile", [False, True], ids=["whole-store", "subtiled-store"])
@pytest.mark.parametrize("layout", ["rr", "rc", "cr", "cc"])
def test_tma_kernel_layouts(layout, subtile, device, monkeypatch):
    if not HAS_CUDA:
        cfg = (32, 32, 32, 2, 4, 1, subtile)
        monkeypatch.setitem(mm.INTERPRETER_DEFAULTS, "tma", cfg)
    dtype = torch.bfloat16
    a = _randn(72, 40, dtype=dtype, device=device)
    b = _randn(40, 88, dtype=dtype, device=device, seed=1)
    a2 = a if layout[0] == "r" else _layout(a, "transposed")
    b2 = b if layout[1] == "r" else _layout(b, "transposed")
    bias = _randn(88, dtype=torch.float32, device=device, seed=2)
    out = triton_matmul(a2, b2, bias=bias, activation="silu", kernel="tma")
    _check(out, F.silu(matmul_ref(a, b) + bias.double()), F.silu(torch.matmul(a, b) + bias),
           what=f"tma {layout}")  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_name)
def test_tma_kernel_batched(dtype, device):
    a = _randn(3, 40, 56, dtype=dtype, device=device)
    b = _randn(3, 56, 72, dtype=dtype, device=device, seed=1)
    sa = torch.rand(3, 40, device=device) + 0.5  # per-row, per batch
    out = triton_matmul(a, b, scale_a=sa, kernel="tma")
    ref = matmul_ref(a, b) * sa.double()[..., None]
    _check(out, ref, torch.matmul(a, b) * sa[..., None].to(dtype))


def test_tma_kernel_fp8(device):
    a, b, sa, sb, ref, baseline = _fp8_case(torch.float8_e4m3fn, torch.float8_e4m3fn, 48, 80,
                                            160, True, device)  # fmt: skip
    _check(triton_matmul(a, b, scale_a=sa, scale_b=sb, kernel="tma"), ref, baseline)


def _fake_gpu(monkeypatch, launches: list, replays: list) -> None:
    """Run the GPU launch path on the CPU: the device facts claim an sm90 with 3 SMs, the
    lean launch and the replays run the kernel under the interpreter."""
    def fake_launch(fn, grid, args, meta, num_warps, num_stages):
        launches.append(({k: v.block_shape for k, v in args.items() if k.endswith("_desc")},
                         dict(meta)))  # fmt: skip
        fn[grid](**args, **meta)
        return fn  # stands in for the compiled kernel

    class InterpretedLauncher:  # FastLauncher's view of a kernel, for interpreted ones
        def __init__(self, fn):
            self.names = tuple(inspect.signature(fn.fn).parameters)

        def lean_ok(self):
            return True

    def fake_run_compiled(fn, grid, device, values):
        names = InterpretedLauncher(fn).names
        replays.append(dict(zip(names, values, strict=True)))
        fn[grid](**replays[-1])

    monkeypatch.setattr(mm, "_device_facts", lambda t: (9, 227 * 1024, 3))
    monkeypatch.setattr(mm, "ws_small", lambda M, N, num_sms: True)  # Gluon: GPU only
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(mm, "fast_launch", fake_launch)
    monkeypatch.setattr(mm, "run_compiled", fake_run_compiled)
    monkeypatch.setattr(mm, "launcher_for", InterpretedLauncher)
    monkeypatch.setattr(mm.tuning, "autotune_enabled", lambda: False)
    monkeypatch.setattr(mm, "_chosen", {})
    monkeypatch.setattr(mm, "_replays", {})


@pytest.mark.skipif(HAS_CUDA, reason="CPU check of the GPU launch path (the GPU runs it for real)")
@pytest.mark.parametrize("batch", [None, 1, 3])
def test_gpu_launch_path_under_the_interpreter(batch, monkeypatch):
    """The code a GPU runs after the first call, on the CPU: the config choice remembered,
    descriptors given the config's block shapes, one lean launch; from the second call on
    (autotuning off) a replay with the new call's tensors, holding none of the first call's."""
    launches, replays = [], []
    _fake_gpu(monkeypatch, launches, replays)
    # under the interpreter default_config takes the interpreter's entry
    monkeypatch.setitem(mm.INTERPRETER_DEFAULTS, "tma", (32, 64, 32, 2, 4, 1, True, False))
    lead = () if batch is None else (batch,)
    for seed in range(4):  # new data each call: a replay must read the new tensors
        a = _randn(*lead, 72, 40, dtype=torch.float16, device="cpu", seed=seed)
        b = _randn(*lead, 88, 40, dtype=torch.float16, device="cpu", seed=seed + 9)
        b = b.transpose(-1, -2)
        bias = _randn(88, dtype=torch.float32, device="cpu", seed=seed + 5)
        out = triton_matmul(a, b, bias=bias, activation="relu")
        _check(out, torch.relu(matmul_ref(a, b) + bias.double()),
               torch.relu(torch.matmul(a, b) + bias.half()), what=f"batch={batch} call {seed}")
    assert len(launches) == 1 and len(replays) == 3 and len(mm._chosen) == 1
    blocks, meta = launches[-1]
    lead = [1] if batch not in (None, 1) else []
    assert meta["BLOCK_K"] == 32 and meta["EPILOGUE_SUBTILE"] is True
    assert blocks == {"a_desc": lead + [32, 32], "b_desc": lead + [64, 32],
                      "c_desc": lead + [32, 32]}  # fmt: skip
    assert replays[-1]["BIAS"] is bias and replays[-1]["a_desc"].base is a
    (replay,) = mm._replays.values()
    assert not any(isinstance(v, torch.Tensor) for v in replay.values)
    assert all(d.base is None for d in replay.descs.values())


# --------------------------------------------------------------------------------------------
# Warp-specialised Gluon kernel (matmul_ws.py): GPU only; on the CPU its compile and dispatch
# --------------------------------------------------------------------------------------------
_WS_COMPILE = """
import json, sys, torch
from diyfa.ops import matmul_ws as w
k = w.compile_for_hopper(getattr(torch, sys.argv[1]), sys.argv[2] == "kmajor",
                         sys.argv[3] == "stream-k")
print(json.dumps({"shared": k.metadata.shared, "ptx": k.asm["ptx"]}))
"""


@pytest.mark.parametrize("b_layout, tail", [("row-major", "dp"), ("kmajor", "dp"),
                                            ("row-major", "stream-k")])
def test_ws_kernel_compiles_for_hopper(b_layout, tail):
    """The Gluon kernel compiles for sm90a (no GPU needed), fits an H100/H200 block's shared
    memory (227 KB), and is what it says: wgmma MMAs, TMA loads, per-partition register
    budgets, nothing spilled. In a fresh process: running kernels under the interpreter leaves
    Triton's language module patched for the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    dtype = "bfloat16" if b_layout == "kmajor" else "float16"
    done = subprocess.run([sys.executable, "-c", _WS_COMPILE, dtype, b_layout, tail], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["shared"] <= 227 * 1024
    ptx = result["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32" in ptx
    assert "cp.async.bulk.tensor.2d.shared::cluster.global" in ptx  # TMA loads
    assert f"setmaxnreg.inc.sync.aligned.u32 \t{mm_ws.CONSUMER_REGS};" in ptx
    assert f"setmaxnreg.dec.sync.aligned.u32 \t{mm_ws.LOADER_REGS};" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx  # nothing spilled to local memory
    assert ("atom.global.gpu.release.exch" in ptx) == (tail == "stream-k")  # the tail's flags


@pytest.mark.skipif(HAS_CUDA, reason="CPU check of the dispatch (the GPU runs it for real)")
def test_ws_dispatch(monkeypatch):
    """On an sm90 with 132 SMs, "auto" sends plain fp16/bf16 products with enough tiles to the
    warp-specialised kernel, with the right descriptors; fused epilogues, fp8, batches and
    small problems go to the Triton TMA kernel; kernel="ws" refuses what it cannot run."""
    launched = []

    def fake_launch(fn, grid, args, meta, num_warps, num_stages):
        launched.append((fn, grid, {**args, **meta}, num_warps))
        return fn

    monkeypatch.setattr(mm, "_device_facts", lambda t: (9, 227 * 1024, 132))
    monkeypatch.setattr(mm, "fast_launch", fake_launch)
    monkeypatch.setattr(mm.tuning, "autotune_enabled", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(mm, "_chosen", {})
    monkeypatch.setattr(mm, "_replays", {})
    monkeypatch.setattr(mm, "_Replay", lambda *args: None)  # nothing launched to replay
    a = torch.empty(2048, 1024, dtype=torch.bfloat16)
    w = torch.empty(3072, 1024, dtype=torch.bfloat16)  # nn.Linear weight: b = w.t()
    b = torch.empty(1024, 3072, dtype=torch.bfloat16)

    def kernel_of(*args, **kwargs):
        mm.forget_choices()
        triton_matmul(*args, **kwargs)
        return launched[-1]

    fn, grid, args, num_warps = kernel_of(a, b)
    assert fn is mm._matmul_ws_kernel and grid == (132,) and num_warps == 4
    assert args["B_KMAJOR"] is False and args["b_desc"].block_shape == [64, 256]
    assert args["a_desc"].block_shape == [128, 64] and args["c_desc"].block_shape == [64, 256]
    assert (args["M"], args["N"], args["K"]) == (2048, 3072, 1024)
    fn, _, args, _ = kernel_of(a, w.t())
    assert fn is mm._matmul_ws_kernel and args["B_KMAJOR"] is True
    assert args["b_desc"].shape == [3072, 1024] and args["b_desc"].block_shape == [256, 64]
    assert kernel_of(a.unsqueeze(0), b.unsqueeze(0))[0] is mm._matmul_ws_kernel  # batch of 1
    one = torch.ones(())
    for kwargs in ({"bias": torch.zeros(3072)}, {"activation": "relu"},
                   {"scale_a": one, "scale_b": one}, {"out_dtype": torch.float32}):
        assert kernel_of(a, b, **kwargs)[0] is mm._matmul_tma_kernel, kwargs
    assert kernel_of(a.t().contiguous().t(), b)[0] is mm._matmul_tma_kernel  # column-major a
    assert kernel_of(a[:512, :512], b[:512, :512])[0] is mm._matmul_tma_kernel  # small
    assert kernel_of(a.expand(2, -1, -1), b.expand(2, -1, -1))[0] is mm._matmul_tma_kernel
    f8 = a.to(torch.float8_e4m3fn)
    assert kernel_of(f8, b.to(torch.float8_e4m3fn), scale_a=one,
                     scale_b=one)[0] is mm._matmul_tma_kernel  # fmt: skip
    # kernel="ws" takes small problems too, and refuses what it cannot run
    assert kernel_of(a[:512, :512], b[:512, :512], kernel="ws")[0] is mm._matmul_ws_kernel
    with pytest.raises(ValueError, match="kernel='ws' cannot run these inputs: it has no "
                                         "scales, bias or activation"):
        triton_matmul(a, b, bias=torch.zeros(3072, dtype=torch.bfloat16), kernel="ws")
    with pytest.raises(ValueError, match="kernel='ws' cannot run these inputs: a must be "
                                         "row-major"):
        triton_matmul(a.t().contiguous().t(), b, kernel="ws")
    with pytest.raises(ValueError, match="cannot run these inputs: .* not a multiple of 16"):
        triton_matmul(torch.empty(2048, 1004, dtype=torch.bfloat16), b[:1004], kernel="ws")
    monkeypatch.setattr(mm, "_device_facts", lambda t: (8, 163 * 1024, 108))
    with pytest.raises(ValueError, match=r"kernel='ws' needs a Hopper GPU \(sm90\), got sm8x"):
        triton_matmul(a, b, kernel="ws")


@pytest.mark.skipif(HAS_CUDA, reason="the GPU case is test_gpu_ws_kernel")
def test_ws_needs_a_gpu():
    a = torch.ones(64, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="kernel='ws' needs a Hopper GPU .* the interpreter"):
        triton_matmul(a, a, kernel="ws")


@pytest.mark.skipif(HAS_CUDA, reason="CPU check of the GPU launch path (the GPU runs it for real)")
def test_replays_never_skip_a_check(monkeypatch):
    """A call differing from a replayed one in anything but its data pointers goes through
    the checks (and a launch of its own)."""
    launches, replays = [], []
    _fake_gpu(monkeypatch, launches, replays)
    a = _randn(40, 48, dtype=torch.bfloat16, device="cpu")
    b = _randn(48, 56, dtype=torch.bfloat16, device="cpu", seed=1)
    for _ in range(3):
        triton_matmul(a, b)
    assert len(replays) == 2
    with pytest.raises(ValueError, match="bias must have shape"):
        triton_matmul(a, b, bias=torch.zeros(55))
    with pytest.raises(TypeError, match="a and b must share a dtype"):
        triton_matmul(a, b.half())
    with pytest.raises(ValueError, match="inner dimensions differ"):
        triton_matmul(a[:, :40], b)
    with pytest.raises(ValueError, match="activation must be one of"):
        triton_matmul(a, b, activation="tanh")
    # a sliced (differently strided, unaligned) a is a new key: validated and launched
    _check(triton_matmul(a[:, 1:], b[1:]), matmul_ref(a[:, 1:], b[1:]),
           torch.matmul(a[:, 1:], b[1:]))  # fmt: skip
    assert len(replays) == 2 and len(launches) == 2


@pytest.mark.parametrize("shape", [(72, 200, 88, 1), (224, 72, 32, 1), (40, 104, 136, 3),
                                   (96, 33 * 8, 96, 2)],
                         ids=["tail-tile-in-4-parts", "3-tail-tiles", "batched", "batched-2"])
def test_tma_stream_k_tail(shape, device, monkeypatch):
    """The TMA kernel's stream-K tail: tiles beyond the last whole wave shared out by K steps
    (under the interpreter 4 programs and 32x32 tiles: the first case splits its one tail tile
    over all 4 programs). Every flag raised is lowered again."""
    if not HAS_CUDA:
        monkeypatch.setitem(mm.INTERPRETER_DEFAULTS, "tma", (32, 32, 32, 2, 4, 1, False))
    monkeypatch.setattr(mm, "TMA_STREAM_K", True)  # off by default (measured slower)
    mm.forget_choices()  # replays hold the workspace of their launch
    M, K, N, batch = shape
    lead = (batch,) if batch > 1 else ()
    a = _randn(*lead, M, K, dtype=torch.float16, device=device)
    b = _randn(*lead, K, N, dtype=torch.float16, device=device, seed=1)
    bias = _randn(N, dtype=torch.float32, device=device, seed=2)
    out = triton_matmul(a, b, bias=bias, activation="gelu", kernel="tma")
    _check(out, F.gelu(matmul_ref(a, b) + bias.double(), approximate="tanh"),
           F.gelu(torch.matmul(a, b) + bias.half(), approximate="tanh"))  # fmt: skip
    for _, flags in mm._stream_k_buffers.values():
        assert int(flags.count_nonzero()) == 0


def test_tma_refuses_misaligned(device):
    a = _randn(16, 33, dtype=torch.float16, device=device)  # row stride 66 bytes
    b = _randn(33, 16, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match=r"kernel='tma' cannot run .* multiple of 16 bytes"):
        triton_matmul(a, b, kernel="tma")
    with pytest.raises(ValueError, match="fp32 inputs run on the portable kernel"):
        triton_matmul(a.float()[:, :32], b.float()[:32], kernel="tma")
    # the default kernel choice takes them (portable)
    _check(triton_matmul(a, b), matmul_ref(a, b), torch.matmul(a, b))


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------
def _t(*shape, dtype=torch.float16, device="cpu"):
    return torch.ones(*shape, dtype=dtype, device=device)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda d: (_t(4, 5, device=d), _t(6, 7, device=d), {}), ValueError,
         r"inner dimensions differ: a \(4, 5\) has K=5, b \(6, 7\) has K=6"),
        (lambda d: (_t(4, device=d), _t(4, 7, device=d), {}), ValueError, "a must be 2-D"),
        (lambda d: (_t(1, 2, 4, 5, device=d), _t(5, 7, device=d), {}), ValueError,
         "a must be 2-D .* or 3-D"),
        (lambda d: (_t(2, 4, 5, device=d), _t(5, 7, device=d), {}), ValueError, "same rank"),
        (lambda d: (_t(2, 4, 5, device=d), _t(3, 5, 7, device=d), {}), ValueError,
         "batch sizes differ: a has 2, b has 3"),
        (lambda d: (_t(4, 5, device=d), _t(5, 7, dtype=torch.bfloat16, device=d), {}), TypeError,
         "a and b must share a dtype .* a=float16, b=bfloat16"),
        (lambda d: (_t(4, 5, dtype=torch.int32, device=d), _t(5, 7, device=d), {}), TypeError,
         "a.dtype is torch.int32; accepted: float16"),
        (lambda d: ([[1.0]], _t(1, 1, device=d), {}), TypeError,
         "a must be a torch.Tensor, got list"),
        (lambda d: (_t(4, 5, dtype=torch.float8_e4m3fn, device=d),
                    _t(5, 7, dtype=torch.float8_e4m3fn, device=d), {}), ValueError,
         "fp8 inputs need scale_a and scale_b .* missing: scale_a, scale_b"),
        (lambda d: (_t(4, 5, dtype=torch.float8_e4m3fn, device=d),
                    _t(5, 7, dtype=torch.float8_e4m3fn, device=d),
                    {"scale_a": _t(1, dtype=torch.float32, device=d)}), ValueError,
         "missing: scale_b"),
        (lambda d: (_t(4, 5, device=d), _t(5, 7, device=d),
                    {"scale_a": _t(1, device=d)}), TypeError, "scale_a.dtype is torch.float16"),
        (lambda d: (_t(4, 5, device=d), _t(5, 7, device=d),
                    {"scale_a": _t(5, dtype=torch.float32, device=d)}), ValueError,
         r"scale_a has shape \(5,\); accepted: one element \(per-tensor\) or per-row of a: \(4,\)"),
        (lambda d: (_t(4, 5, device=d), _t(5, 7, device=d),
                    {"scale_b": _t(4, dtype=torch.float32, device=d)}), ValueError,
         r"scale_b has shape \(4,\); accepted: .* per-column of b: \(7,\)"),
        (lambda d: (_t(4, 5, device=d), _t(5, 7, device=d), {"bias": _t(4, device=d)}),
         ValueError, r"bias must have shape \(7,\) \(N of b\), got \(4,\)"),
        (lambda d: (_t(4, 5, device=d), _t(5, 7, device=d), {"bias": _t(1, 7, device=d)}),
         ValueError, r"bias must have shape \(7,\)"),
        (lambda d: (_t(4, 5, device=d), _t(5, 7, device=d), {"activation": "tanh"}),
         ValueError, "activation must be one of .* got 'tanh'"),
        (lambda d: (_t(4, 5, device=d), _t(5, 7, device=d), {"precision": "fp64"}),
         ValueError, "precision must be one of .* got 'fp64'"),
        (lambda d: (_t(4, 5, device=d), _t(5, 7, device=d), {"kernel": "cublas"}),
         ValueError, "kernel must be one of .* got 'cublas'"),
        (lambda d: (_t(4, 5, device=d), _t(5, 7, device=d), {"out_dtype": torch.int8}),
         TypeError, "out_dtype is torch.int8; accepted"),
    ],
    ids=["inner-dims", "rank-1", "rank-4", "rank-mix", "batch", "mixed-dtype", "int-dtype",
         "not-tensor", "fp8-no-scales", "fp8-one-scale", "scale-dtype", "scale-a-shape",
         "scale-b-shape", "bias-shape", "bias-2d", "activation", "precision", "kernel",
         "out-dtype"],
)  # fmt: skip
def test_bad_input(make, error, match, device):
    a, b, kwargs = make(device)
    with pytest.raises(error, match=match):
        triton_matmul(a, b, **kwargs)


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-tensor error without the interpreter")
def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CPU tensors: the Triton kernels need a CUDA GPU"):
        triton_matmul(_t(4, 5), _t(5, 7))


# --------------------------------------------------------------------------------------------
# Configs: defaults per architecture and pruning by shared memory (pure Python)
# --------------------------------------------------------------------------------------------
def test_block_k_scales_with_element_size():
    entry = (128, 256, 64, 8, 8, 3)
    assert mm.make_config(entry, 2).BLOCK_K == 64
    assert mm.make_config(entry, 1).BLOCK_K == 128
    assert mm.make_config(entry, 4).BLOCK_K == 32


def test_defaults_per_architecture(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ampere = mm.default_config("portable", 2, 2, 8, 163 * 1024)  # A100
    assert (ampere.BLOCK_M, ampere.BLOCK_N, ampere.BLOCK_K) == (128, 256, 64)
    assert (ampere.num_stages, ampere.num_warps) == (3, 8)
    hopper = mm.default_config("portable", 2, 2, 9, 227 * 1024)
    assert hopper.num_stages > ampere.num_stages
    small = mm.default_config("portable", 2, 2, 8, 99 * 1024)  # sm86/sm89: the seed's won't fit
    assert mm.smem_bytes(small, 2, 2) <= 99 * 1024
    tma = mm.default_config("tma", 1, 2, 9, 227 * 1024)
    assert tma.BLOCK_K == 128 and mm.smem_bytes(tma, 1, 2) <= 227 * 1024


def test_pruning_by_shared_memory():
    limit = 227 * 1024
    for kind in ("portable", "tma"):
        for elem, out in ((1, 2), (2, 2), (2, 4), (4, 4)):
            configs = mm.configs_for(kind, elem, out, limit)
            assert configs and all(mm.smem_bytes(c, elem, out) <= limit for c in configs)
    # fp32 output doubles the TMA store buffer: the 128x256 single-store config drops out
    tma_fp32_out = mm.configs_for("tma", 2, 4, limit)
    assert len(tma_fp32_out) < len(mm.configs_for("tma", 2, 2, limit))
    # nothing fits: one small 2-stage config remains
    (last,) = mm.configs_for("portable", 2, 2, 16 * 1024)
    assert last.num_stages == 2


# --------------------------------------------------------------------------------------------
# GPU: large shapes, TF32, fp8 against cuBLAS, the TMA path, LLM shapes
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["auto", "portable"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_name)
@pytest.mark.parametrize("shape", [(4096, 4096, 4096), (1000, 4097, 1000), (8192, 4096, 1024)],
                         ids=lambda s: "x".join(map(str, s)))  # fmt: skip
def test_gpu_large(shape, dtype, kernel):
    M, N, K = shape
    a, b = _randn(M, K, dtype=dtype, device="cuda"), _randn(K, N, dtype=dtype, device="cuda")
    _check(triton_matmul(a, b, kernel=kernel), matmul_ref(a, b), torch.matmul(a, b),
           what=f"{shape} {kernel}")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["rr", "rc", "cr", "cc"])
def test_gpu_tma_path(layout):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the TMA kernel is the Hopper (sm90) path")
    a = _randn(2048, 1024, dtype=torch.bfloat16, device="cuda")
    b = _randn(1024, 3072, dtype=torch.bfloat16, device="cuda", seed=1)
    a2 = a if layout[0] == "r" else _layout(a, "transposed")
    b2 = b if layout[1] == "r" else _layout(b, "transposed")
    bias = _randn(3072, dtype=torch.bfloat16, device="cuda", seed=2)
    out = triton_matmul(a2, b2, bias=bias, activation="gelu", kernel="tma")
    ref = F.gelu(matmul_ref(a, b) + bias.double(), approximate="tanh")
    _check(out, ref, F.gelu(torch.matmul(a, b) + bias, approximate="tanh"), what=layout)
    batched = triton_matmul(a.view(2, 1024, 1024), b[:, :1024].expand(2, 1024, 1024),
                            kernel="tma")  # fmt: skip
    _check(batched, matmul_ref(a.view(2, 1024, 1024), b[:, :1024].expand(2, 1024, 1024)),
           torch.matmul(a.view(2, 1024, 1024), b[:, :1024]), what="batched")  # fmt: skip


def _hopper() -> bool:
    return HAS_CUDA and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.parametrize("b_layout", ["row-major", "column-major"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_name)
@pytest.mark.parametrize("shape", [(4096, 4096, 4096), (1000, 3000, 2056), (257, 136, 72),
                                   (8192, 512, 8200), (130, 8192, 64)],
                         ids=lambda s: "x".join(map(str, s)))  # fmt: skip
def test_gpu_ws_kernel(shape, dtype, b_layout):
    """The warp-specialised kernel on edge tiles (M, N, K not multiples of the tile), a long
    K, a short one; b read in both layouts. The second call (new data) is a replay."""
    if not _hopper():
        pytest.skip("the warp-specialised kernel is the Hopper (sm90) path")
    M, N, K = shape
    for seed in (0, 1):
        a = _randn(M, K, dtype=dtype, device="cuda", seed=seed)
        b = _randn(K, N, dtype=dtype, device="cuda", seed=seed + 5)
        if b_layout == "column-major":
            b = b.t().contiguous().t()
        _check(triton_matmul(a, b, kernel="ws"), matmul_ref(a, b), torch.matmul(a, b),
               what=f"{shape} call {seed}")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096, 4096), (4096, 4096, 520), (4224, 4352, 1000),
                                   (1000, 3000, 2056)],
                         ids=lambda s: "x".join(map(str, s)))  # fmt: skip
def test_gpu_ws_stream_k_tail(shape, monkeypatch):
    """The warp-specialised kernel's stream-K tail (off by default): 4096^3 splits 116 tail
    tiles over 132 programs; K 520 (9 steps) splits tiles over up to three programs; 96 tiles
    (fewer than the SMs) take no tail. Every flag raised is lowered again."""
    if not _hopper():
        pytest.skip("the warp-specialised kernel is the Hopper (sm90) path")
    monkeypatch.setattr(mm, "WS_STREAM_K", True)
    mm.forget_choices()  # replays hold the workspace (or its absence) of their launch
    M, N, K = shape
    try:
        for b_layout in ("row-major", "column-major"):
            a = _randn(M, K, dtype=torch.bfloat16, device="cuda")
            b = _randn(K, N, dtype=torch.bfloat16, device="cuda", seed=1)
            if b_layout == "column-major":
                b = b.t().contiguous().t()
            _check(triton_matmul(a, b, kernel="ws"), matmul_ref(a, b), torch.matmul(a, b),
                   what=b_layout)  # fmt: skip
            for _, flags in mm._stream_k_buffers.values():
                assert int(flags.count_nonzero()) == 0
    finally:
        mm.forget_choices()


@pytest.mark.gpu
def test_gpu_ws_is_the_default_for_large_plain_products():
    if not _hopper():
        pytest.skip("the warp-specialised kernel is the Hopper (sm90) path")
    mm.forget_choices()
    a = _randn(4096, 2048, dtype=torch.bfloat16, device="cuda")
    w = _randn(4096, 2048, dtype=torch.bfloat16, device="cuda", seed=1)
    big = _randn(4096, 2048 + 64, dtype=torch.bfloat16, device="cuda", seed=2)[:, :2048]
    for x in (a, big, a.unsqueeze(0)):  # contiguous, a strided view, a batch of one
        y = w.t() if x.dim() == 2 else w.t().unsqueeze(0)
        _check(triton_matmul(x, y), matmul_ref(x, y), torch.matmul(x, y))
    assert [r.launcher.fn for r in mm._replays.values()] == [mm._matmul_ws_kernel] * 3


@pytest.mark.gpu
@pytest.mark.parametrize("precision", [
    pytest.param("tf32", marks=pytest.mark.xfail(strict=True, reason=(
        "Triton's TF32 dot truncates the fp32 operands where cuBLAS rounds them: measured on "
        "an H200, max error 0.129 vs cuBLAS TF32's 0.052 (2.5x, the rule allows 2x); "
        "documented in docs/matmul.md, use precision='ieee' for accuracy"))),
    "ieee",
])
def test_gpu_fp32(precision):
    _check_fp32(2048, 1024, 2048, precision, "cuda")


def _has_fp8() -> bool:
    return HAS_CUDA and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.parametrize("per_row", [False, True], ids=["per-tensor", "per-row"])
@pytest.mark.parametrize("kernel", ["auto", "portable"])
@pytest.mark.parametrize("acc", ["fast", "32"])
def test_gpu_fp8_vs_scaled_mm(per_row, kernel, acc, monkeypatch):
    """Each fp8 accumulation mode against cuBLAS in the same mode: the default fast one
    (reduced-precision sums) against use_fast_accum=True, DIYFA_FP8_ACC=32 (partial sums
    promoted every 32 products) against cuBLAS's default."""
    if not _has_fp8():
        pytest.skip("needs a GPU with fp8 (compute capability >= 8.9)")
    monkeypatch.setenv("DIYFA_FP8_ACC", acc)
    a, b, sa, sb, ref, _ = _fp8_case(torch.float8_e4m3fn, torch.float8_e4m3fn, 2048, 2048, 2048,
                                     per_row, "cuda")  # fmt: skip
    sa2 = sa.reshape(-1, 1) if per_row else sa
    sb2 = sb.reshape(1, -1) if per_row else sb
    baseline = torch._scaled_mm(a, b, scale_a=sa2, scale_b=sb2, out_dtype=torch.bfloat16,
                                use_fast_accum=acc == "fast")  # fmt: skip
    _check(triton_matmul(a, b, scale_a=sa, scale_b=sb, kernel=kernel), ref, baseline)


@pytest.mark.parametrize("value", ["0", "16", "48", "x", "-32"])
def test_fp8_accumulation_setting_is_checked(value, monkeypatch):
    monkeypatch.setenv("DIYFA_FP8_ACC", value)
    with pytest.raises(ValueError, match="DIYFA_FP8_ACC must be 'fast' or a multiple of 32"):
        mm.fp8_accumulation()
    monkeypatch.setenv("DIYFA_FP8_ACC", "64")
    assert mm.fp8_accumulation() == 64
    monkeypatch.delenv("DIYFA_FP8_ACC")
    assert mm.fp8_accumulation() is None  # the default: fast


@pytest.mark.gpu
def test_gpu_fp8_refused_without_fp8_tensor_cores():
    if _has_fp8():
        pytest.skip("this GPU has fp8")
    a = torch.ones(16, 16, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    with pytest.raises(ValueError, match="compute capability >= 8.9"):
        triton_matmul(a, a, scale_a=one, scale_b=one)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2048, 4096, 14336), (2048, 14336, 4096)],
                         ids=lambda s: "x".join(map(str, s)))  # fmt: skip
def test_gpu_llm_shapes(shape):
    M, N, K = shape
    a = _randn(M, K, dtype=torch.bfloat16, device="cuda")
    w = _randn(N, K, dtype=torch.bfloat16, device="cuda", seed=1)  # nn.Linear weight
    _check(triton_matmul(a, w.t()), matmul_ref(a, w.t()), torch.matmul(a, w.t()))


def test_replay_key_holds_the_fp8_accumulation(monkeypatch):
    """A replayed fp8 launch is the kernel compiled for the DIYFA_FP8_ACC it was made under:
    changing the setting must not replay it (an H200 benchmark measured 'fast' under 32)."""
    monkeypatch.setattr(mm, "_device_facts", lambda a: (9, 232448, 132))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    a = torch.ones(16, 32).to(torch.float8_e4m3fn)
    b = torch.ones(32, 16).to(torch.float8_e4m3fn)
    one = torch.ones(())

    def key():
        return mm._replay_key(a, b, None, one, one, None, None, "tf32", "auto")

    monkeypatch.setenv("DIYFA_FP8_ACC", "fast")
    fast = key()
    monkeypatch.setenv("DIYFA_FP8_ACC", "32")
    assert key() != fast and key() == key()
    h = torch.ones(16, 32, dtype=torch.float16)  # other dtypes ignore the setting

    def key16():
        return mm._replay_key(h, h.t(), None, None, None, None, None, "tf32", "auto")

    with_32 = key16()
    monkeypatch.setenv("DIYFA_FP8_ACC", "fast")
    assert key16() == with_32


_COMPILE_FP8 = """
import torch
from diyfa._compile import compile_for_sm90
from diyfa.ops import matmul as mm

for fp8_acc in (None, 32, 1024):  # fast, promoted every instruction, once per tile
    args = dict(SCALE_A="tensor", SCALE_B="tensor", HAS_BIAS=False, ACTIVATION=None,
                PRECISION="tf32", A_ROW_MAJOR=True, B_ROW_MAJOR=False, FP8_ACC=fp8_acc,
                BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8)
    tensors = dict(A=torch.float8_e4m3fn, B=torch.float8_e4m3fn, C=torch.bfloat16,
                   SCALE_A_PTR=torch.float32, SCALE_B_PTR=torch.float32, BIAS=torch.float32)
    values = {p.name: args[p.name] if p.name in args else
              torch.empty(16, dtype=tensors[p.name]) if p.name in tensors else 4096
              for p in mm._matmul_kernel.params}
    ptx = compile_for_sm90(mm._matmul_kernel, values, num_warps=8, num_stages=3).asm["ptx"]
    print(fp8_acc, ptx.count("wgmma.mma_async"), ptx.count("add.f32"))
"""


_COMPILE_FP32 = """
import torch
from diyfa._compile import compile_for_sm90
from diyfa.ops import matmul as mm

for precision in ("ieee64", "ieee", "tf32"):
    args = dict(SCALE_A=None, SCALE_B=None, HAS_BIAS=False, ACTIVATION=None,
                PRECISION=precision, A_ROW_MAJOR=True, B_ROW_MAJOR=True, FP8_ACC=None,
                BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8)
    tensors = ("A", "B", "C", "SCALE_A_PTR", "SCALE_B_PTR", "BIAS")
    values = {p.name: args[p.name] if p.name in args else
              torch.empty(16, dtype=torch.float32) if p.name in tensors else 4096
              for p in mm._matmul_kernel.params}
    ptx = compile_for_sm90(mm._matmul_kernel, values, num_warps=4, num_stages=2).asm["ptx"]
    print(precision, ptx.count("fma.rn.f32"), ptx.count(".f64.f64.f64.f64"),
          ptx.count("cvt.rn.f32.f64"), ptx.count("mma"),
          ptx.count("add.f32") + ptx.count("add.rn.f32"))

# The fp32 ieee default tile, an fp64 accumulator: ptxas's spill report.
import os, subprocess, tempfile, triton
cfg = mm.make_config(mm.IEEE_DEFAULT, 4)
args.update(PRECISION="ieee64", BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K)
values = {p.name: args[p.name] if p.name in args else
          torch.empty(16, dtype=torch.float32) if p.name in tensors else 4096
          for p in mm._matmul_kernel.params}
k = compile_for_sm90(mm._matmul_kernel, values, num_warps=cfg.num_warps,
                     num_stages=cfg.num_stages)
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
    f.write(k.asm["ptx"])
done = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                      capture_output=True, text=True)
spills = done.stderr.split(" bytes spill stores")[0].rsplit(" ", 1)[-1]
print("spills", spills, k.metadata.shared)
"""


def test_fp32_ieee_sums_in_fp64_on_hopper():
    """fp32 with precision="ieee" where fp64 is fast (the kernel's "ieee64"): the exact fp32
    products summed in fp64 (DMMA, the fp64 tensor-core mma, on sm90), rounded to fp32 once
    per output, not in fp32 chains (one K-long FMA chain had 2.2x cuBLAS's error at K = 426
    on an H200, per-tile fp32 partials still 9.4x at K = 3922: the GPU fuzz). Compiled for
    sm90: fp64 mma and no fp32 FMA, one fp64 -> fp32 rounding per output (64 x 64 tile,
    128 threads: 32 each); the default ieee tile (128 x 128, 8 warps) without spills. Where
    fp64 is slow ("ieee"): FMA chains into a per-tile partial, one add per output in the
    loop and one after it. tf32 stays on the tensor cores in fp32."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FP32], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r.split()[0]: [int(x) for x in r.split()[1:]] for r in done.stdout.splitlines()}
    assert rows["spills"][0] == 0 and rows["spills"][1] <= 232448, rows
    fma32, mma64, round64, _, _ = rows["ieee64"]
    assert fma32 == 0 and mma64 > 0 and round64 == 32, rows
    fma32, mma64, _, mma, add = rows["ieee"]
    assert fma32 == 32 * 32 and mma64 == 0 and mma == 0 and add == 2 * 32, rows
    assert rows["tf32"][0] == 0 and rows["tf32"][1] == 0 and rows["tf32"][3] > 0, rows


def test_fp8_accumulation_compiles_for_hopper():
    """The portable kernel's fp8 dot compiles for sm90 in each DIYFA_FP8_ACC mode, a setting
    above BLOCK_K included (clamped to one promotion per tile, where Triton would refuse it),
    and promotion adds fp32 additions the fast mode does not have."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FP8], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r.split()[0]: [int(x) for x in r.split()[1:]] for r in done.stdout.splitlines()}
    assert set(rows) == {"None", "32", "1024"}, done.stdout
    assert all(wgmma > 0 for wgmma, _ in rows.values()), rows
    assert rows["32"][1] > rows["1024"][1] > rows["None"][1], rows


def test_ieee_sums_in_fp64_only_where_fp64_is_fast(monkeypatch):
    """fp32 "ieee" runs the fp64-sum kernel ("ieee64") under the interpreter and on GPUs whose
    fp64 keeps up with fp32 (A100, H100/H200, B200); elsewhere (fp64 at 1/64 of fp32) the
    fp32 partial sums; other dtypes and tf32 pass through."""
    from diyfa.ops import matmul as mm

    a32 = torch.empty(2, 2)
    assert mm._kernel_precision("ieee", a32) == "ieee64"
    assert mm._kernel_precision("tf32", a32) == "tf32"
    assert mm._kernel_precision("ieee", a32.half()) == "ieee"

    class FakeCuda(torch.Tensor):
        is_cuda = True
        device = torch.device("cuda", 0)

    fake = torch.empty(2, 2).as_subclass(FakeCuda)
    monkeypatch.setattr(mm, "interpreter_enabled", lambda: False)
    for cap, want in (((9, 0), "ieee64"), ((8, 0), "ieee64"), ((8, 9), "ieee"), ((8, 6), "ieee"),
                      ((12, 0), "ieee")):  # fmt: skip
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d, c=cap: c)
        assert mm._kernel_precision("ieee", fake) == want, cap
