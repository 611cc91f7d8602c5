"""Property-based tests (hypothesis): random shapes, options, strides and dtypes against the
float64 references, by the rules of the hand-written tests.

- flash_attention: batch, heads, GQA ratio, seqlen_q / seqlen_k (0 and 1 included), head
  dim 1..256, causal, window_size, softcap, ALiBi slopes, sinks, dropout, softmax_scale,
  layout, strides (slices of packed tensors, transposed views, expanded k/v, a strided head
  dim), dtype, block sizes; forward, LSE and every gradient by test_attention's 2x / 3x
  rule, or (a third of the examples) an inference call, out only (no gradient, no LSE: the
  Hopper forward's frozen max where it applies; DIYFA_FROZEN_MAX=always runs it at any
  size).
- flash_attention_varlen: random sequence lengths (zero-length ones too), forward, LSE and
  gradients per sequence.
- flash_attention_with_kvcache: contiguous and paged caches (random page sizes, shuffled
  block tables whose unused entries point nowhere), append or not, splits; forward and LSE
  by the 2x rule, and the cache holds exactly the appended rows afterwards.
- triton_matmul: shapes (0 included), batches, transposed and sliced operands, dtypes (fp8
  too), every epilogue (scales, bias, activation, out_dtype), by test_matmul's rule.
- flash_attention on float8_e4m3fn inputs (forward only): shapes, GQA, causal, windows,
  softcap, layouts, per-tensor or per-head descales, outlier channels; within 2x a PyTorch
  emulation of the recipe plus P's e4m3 rounding (test_fp8_attention).

Profiles (tests/conftest.py): ``ci`` (default; derandomized, small shapes, the interpreter on
the CPU), ``deep`` (the same shapes, 10x the examples, a fresh seed each run) and ``gpu``
(``DIYFA_FUZZ_PROFILE=gpu``: thousands of examples, lengths up to 16k, CUDA;
``benchmarks/gpu_fuzz.sh`` runs it in one device call). ``DIYFA_FUZZ_SECONDS`` bounds each
test's time (past it a test that has not failed ends as skipped, with its example count) and
``DIYFA_FUZZ_SUMMARY`` names a JSON-lines file that gets each test's example count.

Every failure found here is a named regression test in tests/test_fuzz_regressions.py.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import json
import math
import os
import random
import time
from dataclasses import dataclass
from unittest import mock

import pytest
import torch

pytest.importorskip("hypothesis")
from hypothesis import assume, given, reject, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import UnsatisfiedAssumption  # noqa: E402

import diyfa  # noqa: E402
from diyfa import tuning  # noqa: E402
from diyfa.attention import checks  # noqa: E402
from diyfa.ops.matmul import triton_matmul  # noqa: E402
from diyfa.reference import attention_ref, dropout_mask, matmul_ref  # noqa: E402

from .conftest import DEVICE, FUZZ_PROFILE, HAS_CUDA  # noqa: E402
from .test_attention import FLOOR, half_ulp, rounding_slack  # noqa: E402
from .test_attention import _check as _check_nonempty  # noqa: E402
from .test_fp8_attention import E4M3, _emulate, check_fp8_lse, fp8_score_error  # noqa: E402
from .test_matmul import _act  # noqa: E402

# Random inputs make the interpreter's numpy overflow on lanes the kernels compute and never
# store: key rows past a sequence's end (zeros loaded, P = 2^(0 - lse) overflows, then cast to
# fp16 and multiplied: inf / NaN in rows of dK / dV that are not written), scores masked after
# exp2. The results are checked; these warnings are about discarded lanes.
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered in (cast|exp2):RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered in (matmul|multiply|subtract|add)"
                               ":RuntimeWarning"),
]

GPU = FUZZ_PROFILE == "gpu"
if GPU and not HAS_CUDA:
    pytest.skip("the gpu fuzz profile needs CUDA (its shapes are far too large for the "
                "interpreter)", allow_module_level=True)  # fmt: skip

# Examples per test: the ci numbers keep the whole file under a minute on 2 CPU cores.
_CI = dict(attention=100, varlen=25, kvcache=30, matmul=80, fp8_attention=30)
EXAMPLES = {
    "ci": _CI,
    "deep": {name: 10 * n for name, n in _CI.items()},
    "gpu": dict(attention=4000, varlen=2000, kvcache=2000, matmul=3000, fp8_attention=2000),
}[FUZZ_PROFILE]


def _seconds(spec: str) -> dict[str, float]:
    """DIYFA_FUZZ_SECONDS: one number for every test, or per test ("attention=140,
    varlen=110,kvcache=90,matmul=70"; a test not named gets no limit)."""
    if "=" not in spec:
        return collections.defaultdict(lambda: float(spec))
    limits = collections.defaultdict(lambda: math.inf)
    for part in spec.split(","):
        name, _, value = part.partition("=")
        limits[name.strip()] = float(value)
    return limits


SECONDS = _seconds(os.environ.get("DIYFA_FUZZ_SECONDS", "inf"))
MAX_LEN = 16384 if GPU else 48
# b * h * seqlen_q * seqlen_k bound: the float64 reference holds a few score matrices.
MAX_SCORES = 2**28 if GPU else 2**14
DTYPES = [torch.float16, torch.bfloat16, torch.float32]

_started: dict[str, float] = {}
_examples: dict[str, int] = {}
_failed: set[str] = set()
_paths: dict[str, dict[str, int]] = {}  # test -> {kernel path: examples}
# Where a gpu run's time goes: test -> {"compiling": [examples, seconds], "compiled": [...]},
# an example "compiling" when Triton compiled (or loaded from its disk cache) a kernel in it.
_timing: dict[str, dict[str, list]] = {}
_compiles = [0]
if HAS_CUDA:
    from triton import knobs

    def _count_compile(**_):  # Triton's JITHook, called after each compile
        _compiles[0] += 1

    knobs.runtime.jit_post_compile_hook = _count_compile


def _count_path(test: str, path: str) -> None:
    counts = _paths.setdefault(test, {})
    counts[path] = counts.get(path, 0) + 1


def _attention_path(problem) -> str:
    """Which kernels "auto" runs for a problem: "<forward family> / <backward>"."""
    from diyfa.attention import hopper_bwd
    from diyfa.attention.dispatch import select

    fwd = select(problem).name
    bwd = "portable"
    if fwd == "hopper" and hopper_bwd.supports(problem) is None:
        mode = hopper_bwd.auto_mode(problem)
        bwd = f"gluon {mode}" if mode else "portable"
    return f"fwd {fwd} / bwd {bwd}"


_oom: dict[str, list] = {}  # test -> cases given up for GPU memory (gpu profile)
_failures: dict[str, str] = {}  # test -> its first failure: the error and the case


def _example(test: str, run, case) -> None:
    """``run(case)``: one example of ``test``, counted. Past DIYFA_FUZZ_SECONDS (gpu profile)
    the test ends as skipped with the count, unless it has failed: then hypothesis shrinks
    the failure as usual (its own limit: about five minutes).

    On the GPU the jobs of benchmarks/gpu_fuzz.sh share one device, and the float64
    references of large cases take gigabytes for a moment: a CUDA out-of-memory error is
    retried once after the cache is emptied and a pause, then the example is given up
    (rejected, not counted as passed; the summary lists it). The cache is emptied after
    every example, so no job holds memory it is not using."""
    start = _started.setdefault(test, time.monotonic())
    if time.monotonic() - start >= SECONDS[test] and test not in _failed:
        pytest.skip(f"DIYFA_FUZZ_SECONDS ({SECONDS[test]:g} s) spent: "
                    f"{_examples.get(test, 0)} examples passed")  # fmt: skip
    t0, compiles0 = time.monotonic(), _compiles[0]
    try:
        for attempt in range(2 if GPU else 1):
            out_of_memory = False
            try:
                run(case)
                break
            except torch.OutOfMemoryError:
                if not GPU:
                    raise
                out_of_memory = True  # handled below, once the traceback's tensors are gone
            except UnsatisfiedAssumption:
                raise
            except Exception as e:
                _failed.add(test)
                # Kept now: a run cut while hypothesis shrinks still names a failing case.
                _failures.setdefault(test, f"{type(e).__name__}: {str(e)[:400]} | {case!r}")
                raise
            gc.collect()
            torch.cuda.empty_cache()
            if attempt == 0:
                time.sleep(3)  # other jobs' peaks pass
        if out_of_memory:
            _oom.setdefault(test, []).append(repr(case))
            reject()
        _examples[test] = _examples.get(test, 0) + 1
    finally:
        kind = "compiling" if _compiles[0] > compiles0 else "compiled"
        spent = _timing.setdefault(test, {}).setdefault(kind, [0, 0.0])
        spent[0] += 1
        spent[1] += time.monotonic() - t0
        if GPU:
            torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _summary(request):
    """With DIYFA_FUZZ_SUMMARY set: one JSON line per fuzz test (examples run, seconds, whether
    one failed), appended as each test ends (a run cut short keeps what it finished)."""
    yield
    path = os.environ.get("DIYFA_FUZZ_SUMMARY")
    test = request.node.name.removeprefix("test_fuzz_")
    if path and test in _started:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, "examples": _examples.get(test, 0),
                                "seconds": round(time.monotonic() - _started[test], 1),
                                "failed": test in _failed, "paths": _paths.get(test, {}),
                                "timing": _timing.get(test, {}),
                                "out_of_memory": _oom.get(test, []),
                                "first_failure": _failures.get(test),
                                "pool_seed": POOL_SEED if CLASSES else None,
                                "classes": [_class_name(c) for c in POOLS.get(test, [])]})
                    + "\n")  # fmt: skip


def _check(name, ours, pt, ref, factor, dtype, slack=None):
    """test_attention's rule, also for empty tensors (nothing to compare but the shape).
    ``slack``: elementwise allowances for the roundings the rule cannot see on tiny problems
    (test_attention.rounding_slack), plus half an ulp of 16-bit results."""
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    if not ours.numel():
        return
    if slack is None:
        _check_nonempty(name, ours, pt, ref, factor, dtype)
        return
    if not torch.isfinite(ours).all():
        pytest.fail(f"{name}: non-finite values at {torch.nonzero(~torch.isfinite(ours))[:5]}")
    ref = ref.double()
    pt_err = (pt.double() - ref).abs().max().item()
    err = (ours.double() - ref).abs() - slack.double() - half_ulp(ref, dtype)
    bound = factor * pt_err + FLOOR[dtype]
    if err.max().item() > bound:
        where = tuple(torch.nonzero(err == err.max())[0].tolist())
        pytest.fail(f"{name}: max error beyond the rounding slack {err.max().item():.3e} "
                    f"at {where} exceeds {factor}x PyTorch's {pt_err:.3e} + {FLOOR[dtype]:.0e}")


def _through(view, leaf, slack):
    """``slack`` for a view's values, as the comparison sees them: summed into the leaf the
    way the view's gradient is (an expanded view sums), then seen through the view again."""
    zero = torch.zeros_like(leaf, dtype=torch.float64, requires_grad=True)
    (into,) = torch.autograd.grad(view(zero), zero, slack, allow_unused=True)
    return view(into if into is not None else torch.zeros_like(zero))


def _check_lse(lse, ref_lse):
    """-inf exactly where the reference's row sees no key; elsewhere close (the LSE comes
    from fp32 scores of the inputs' exact values)."""
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), "LSE finite where the reference's is not"
    assert torch.isneginf(lse[~seen]).all()
    if seen.any():
        err = (lse[seen].double() - ref_lse[seen]).abs() / (1 + ref_lse[seen].abs())
        assert err.max().item() < 1e-4, f"LSE relative error {err.max().item():.3e}"


# ------------------------------------------------------------------------------ strategies
def _seqlen(top=MAX_LEN):
    if GPU:
        return st.one_of(st.integers(0, min(64, top)), st.integers(0, min(1024, top)),
                         st.integers(0, top))  # fmt: skip
    return st.one_of(st.integers(1, top), st.sampled_from([0, 1, 1, 2]))


def _head_dim():
    common = [16, 32, 40, 64, 80, 96, 128, 160, 192, 256]
    if GPU:  # every distinct head dim is a compile: mostly the usual ones
        return st.one_of(st.sampled_from(common), st.integers(1, 256))
    return st.one_of(st.integers(1, 64), st.integers(1, 64), st.integers(1, 64),
                     st.sampled_from(common + [1, 2, 3, 255]))  # fmt: skip


_SIDE = st.one_of(st.integers(0, 8), st.integers(0, MAX_LEN))  # a bounded window side


def _window(causal, sides):
    """(left, right) for a class's window sides ((left bounded, right bounded) or None: no
    window); with causal=True a bounded right side is 0."""
    if sides is None:
        return st.just((-1, -1))
    left = _SIDE if sides[0] else st.just(-1)
    right = (st.just(0) if causal else _SIDE) if sides[1] else st.just(-1)
    return st.tuples(left, right)


def _softcap(on):
    return st.floats(0.5, 50.0) if on else st.just(0.0)


_SCALE = st.one_of(st.none(), st.none(), st.floats(0.0, 2.0))
# Pinned BLOCK_M x BLOCK_N: small tiles make short sequences cross many blocks under the
# interpreter; on the GPU every pinned pair is a compile of its own, so mostly the defaults.
_BLOCKS = st.one_of(*([st.none()] * (3 if GPU else 1)),
                    st.tuples(st.sampled_from([16, 32, 64]), st.sampled_from([16, 32, 64])))


@contextlib.contextmanager
def _pinned_blocks(blocks):
    """Pin the portable kernels' BLOCK_M x BLOCK_N (None: the defaults / autotuning)."""
    if blocks is None:
        yield
        return
    bm, bn = blocks
    with (tuning.pinned("attn_fwd", BLOCK_M=bm, BLOCK_N=bn),
          tuning.pinned("attn_bwd_dq", BLOCK_M=bm, BLOCK_N=bn),
          tuning.pinned("attn_bwd_dkdv", BLOCK_M=bm, BLOCK_N=bn)):  # fmt: skip
        yield


# ----------------------------------------------------------------------------- kernel classes
@dataclass(frozen=True)
class KernelClass:
    """The draws that decide which kernels a case compiles (each new combination compiles
    its own: seconds on the GPU, a minute for fp32 at large head dims)."""

    dtype: torch.dtype
    d: int
    causal: bool
    window: tuple | None  # (left bounded, right bounded), or None: no window
    softcap: bool
    blocks: tuple | None  # attention's pinned BLOCK_M x BLOCK_N; the KV cache: (paged, splits)


def _free_class(test: str):
    """A freely drawn class (the ci and deep profiles: the interpreter compiles nothing)."""
    if test == "kvcache":
        extra = st.tuples(st.booleans(), st.sampled_from([0, 0, 1, 2, 3, 5]))
        window, softcap = st.none(), st.just(False)
    else:
        extra = _BLOCKS
        window = st.one_of(st.none(), st.tuples(st.booleans(), st.booleans()).map(
            lambda w: w if any(w) else None))  # (no side bounded) is no window
        softcap = st.sampled_from([False, False, True])
    return st.builds(KernelClass, dtype=st.sampled_from(DTYPES), d=_head_dim(),
                     causal=st.booleans(), window=window, softcap=softcap,
                     blocks=extra)  # fmt: skip


def _random_class(test: str, rng: random.Random) -> KernelClass:
    """One class drawn as :func:`_free_class` draws it, from ``rng``."""
    common = [16, 32, 40, 64, 80, 96, 128, 160, 192, 256]
    d = rng.choice(common) if rng.random() < 0.5 else rng.randint(1, 256)
    if test == "kvcache":
        return KernelClass(rng.choice(DTYPES), d, rng.random() < 0.5, None, False,
                           (rng.random() < 0.5, rng.choice([0, 0, 1, 2, 3, 5])))  # fmt: skip
    window = None if rng.random() < 0.5 else (rng.random() < 0.5, rng.random() < 0.5)
    window = window if window and any(window) else None  # (no side bounded) is no window
    blocks = (None if rng.random() < 0.75
              else (rng.choice([16, 32, 64]), rng.choice([16, 32, 64])))  # fmt: skip
    return KernelClass(rng.choice(DTYPES), d, rng.random() < 0.5, window,
                       rng.random() < 1 / 3, blocks)  # fmt: skip


_HOPPER_DIMS = [64, 72, 80, 96, 128, 160, 192, 256]


def _hopper_class_ok(kc: KernelClass) -> bool:
    """Whether the Hopper family can take the class (the case's strides and scale decide
    the rest)."""
    return (kc.dtype in (torch.float16, torch.bfloat16) and kc.d % 8 == 0
            and 64 <= kc.d <= 256 and kc.blocks is None)  # fmt: skip


def _hopper_class(test: str, rng: random.Random) -> KernelClass:
    """A class the Hopper family takes (fp16/bf16, head dim a multiple of 8 in 64..256, the
    default tiles); variants as :func:`_random_class` draws them."""
    kc = _random_class(test, rng)
    return KernelClass(rng.choice([torch.float16, torch.bfloat16]), rng.choice(_HOPPER_DIMS),
                       kc.causal, kc.window, kc.softcap, None)  # fmt: skip


# The gpu profile draws each test's classes from a pool of DIYFA_FUZZ_CLASSES (default 4)
# chosen at random once per process (seed DIYFA_FUZZ_POOL_SEED; benchmarks/gpu_fuzz.sh gives
# each job its own), and everything else freely: shapes (0 and 1 included), batch, heads,
# GQA, strides, layouts, window widths, softcap values, scales, values. Drawing the classes
# freely too, a run spent its time compiling (H200, 2026-11-23: 5 jobs x 60 s gave 54
# attention examples); with a pool each job compiles its few classes once and then runs
# examples, and N jobs cover N x 4 classes per test, a different set each run.
CLASSES = int(os.environ.get("DIYFA_FUZZ_CLASSES", "4" if GPU else "0"))
POOL_SEED = int(os.environ.get("DIYFA_FUZZ_POOL_SEED", str(random.SystemRandom().randrange(2**31))))
# In attention's and varlen's pools the first class is one the Hopper family takes (random
# classes seldom are: 15 of 1,251 examples ran a Hopper kernel, fuzz-summary_ba90c48), and
# attention's cases of such a class run with backend="hopper" half of the time.
# DIYFA_FUZZ_HOPPER_CLASSES: that many of the pool's first classes (e.g. all of them, to
# fuzz the Hopper forward's frozen max with DIYFA_FROZEN_MAX=always).
HOPPER_CLASSES = int(os.environ.get("DIYFA_FUZZ_HOPPER_CLASSES", "1"))
POOLS = {test: [(_hopper_class if i < HOPPER_CLASSES and test != "kvcache" else _random_class)(
                    test, random.Random(f"{POOL_SEED}-{test}-{i}"))
                for i in range(CLASSES)]
         for test in ("attention", "varlen", "kvcache")}  # fmt: skip


def _class_name(c: KernelClass) -> str:
    return (f"{str(c.dtype).removeprefix('torch.')} d{c.d}{' causal' if c.causal else ''}"
            f"{f' window{c.window}' if c.window else ''}{' softcap' if c.softcap else ''}"
            f"{f' {c.blocks}' if c.blocks else ''}")  # fmt: skip


def _kernel_class(test: str):
    return st.sampled_from(POOLS[test]) if CLASSES else _free_class(test)


# ------------------------------------------------------------------ tensors in many strides
def _sliced(t_shape):
    """(leaf shape, view): the values of a ``t_shape`` tensor as a view with a strided last
    axis, odd offsets and padded rows (not 16-byte aligned)."""
    *lead, d = t_shape
    leaf = [n + 1 for n in lead] + [2 * d + 1]
    return leaf, lambda t: t[tuple(slice(1, None) for _ in lead) + (slice(1, None, 2),)]


def _other(layout):
    return "bshd" if layout == "bhsd" else "bhsd"


def _shape(layout, b, h, s, d):
    return (b, h, s, d) if layout == "bhsd" else (b, s, h, d)


def _ident(t):
    return t


def _swap(t):
    return t.transpose(1, 2)


@dataclass(frozen=True)
class AttnCase:
    b: int
    h: int
    hk: int
    sq: int
    sk: int
    d: int
    dtype: torch.dtype
    causal: bool
    window: tuple
    softcap: float
    scale: float | None
    layout: str
    q_style: str
    kv_style: str
    blocks: tuple | None
    q_mag: float
    seed: int
    backend: str = "auto"  # "hopper": the Hopper family by name (its forward and backward)
    dropout: float = 0.0  # dropout_p; the reference takes reference.dropout_mask's mask
    # inference: under torch.no_grad, the LSE not returned (the Hopper forward's frozen max
    # where it applies: hopper_fwd.FROZEN_MAX, DIYFA_FROZEN_MAX=always at any size); out only
    infer: bool = False
    alibi: bool = False  # ALiBi slopes (heads,) in (0.01, 1], drawn from the seed
    sinks: bool = False  # sink logits (heads,), N(0, 1) from the seed (no gradient checked)


def _attention_tensors(c: AttnCase):
    """leaves {name: fp32 CPU tensor} and views {q/k/v: (leaf name, view function)} giving
    q, k, v of the case's shapes in the layout asked for and the strides of its styles."""
    g = torch.Generator().manual_seed(c.seed)
    leaves, views = {}, {}

    def add(name, leaf_shape, fn, mag=1.0):
        leaves[name] = torch.randn(leaf_shape, generator=g) * mag
        views[name] = (name, fn)

    if c.q_style == "packed" and c.kv_style == "packed":  # one (b, s, 3, h, d) projection
        leaves["qkv"] = torch.randn(c.b, c.sq, 3, c.h, c.d, generator=g)
        for i, name in enumerate("qkv"):
            views[name] = ("qkv", lambda t, i=i: (t[:, :, i] if c.layout == "bshd"
                                                  else t[:, :, i].transpose(1, 2)))
        return leaves, views
    for name, heads, s, style, mag in (("q", c.h, c.sq, c.q_style, c.q_mag),
                                       ("k", c.hk, c.sk, c.kv_style, 1.0),
                                       ("v", c.hk, c.sk, c.kv_style, 1.0)):  # fmt: skip
        shape = _shape(c.layout, c.b, heads, s, c.d)
        if style == "contiguous":
            add(name, shape, _ident, mag)
        elif style == "transposed":  # the other layout's contiguous tensor, seen transposed
            add(name, _shape(_other(c.layout), c.b, heads, s, c.d), _swap, mag)
        elif style == "sliced":
            add(name, *_sliced(shape), mag)
        elif style == "expanded":  # one batch entry and one head, broadcast (stride 0)
            one = _shape(c.layout, 1, 1, s, c.d)
            add(name, one, lambda t, shape=shape: t.expand(shape), mag)
        elif style == "packed":  # k and v: slices of one (b, s, 2, hk, d) tensor
            if "kv" not in leaves:
                leaves["kv"] = torch.randn(c.b, s, 2, heads, c.d, generator=g)
            i = "kv".index(name) if name != "q" else 0
            views[name] = ("kv", lambda t, i=i: (t[:, :, i] if c.layout == "bshd"
                                                 else t[:, :, i].transpose(1, 2)))
        else:
            raise AssertionError(style)
    return leaves, views


@st.composite
def attention_cases(draw):
    kc = draw(_kernel_class("attention"))
    sq, sk = draw(_seqlen()), draw(_seqlen())
    max_bh = max(1, MAX_SCORES // max(1, sq * sk))
    hk = draw(st.integers(1, min(2 if not GPU else 4, max_bh)))
    group = draw(st.integers(1, max(1, min(3 if not GPU else 8, max_bh // hk))))
    h = hk * group
    b = draw(st.integers(1, max(1, min(2 if not GPU else 4, max_bh // h))))
    layout = draw(st.sampled_from(["bhsd", "bshd"]))
    styles = ["contiguous", "contiguous", "transposed", "sliced"]
    q_style = draw(st.sampled_from(styles + (["packed"] if sq == sk and h == hk else [])))
    if q_style == "packed":
        kv_style = "packed"
    else:
        kv_style = draw(st.sampled_from(styles + ["expanded", "packed"]))
    return AttnCase(b=b, h=h, hk=hk, sq=sq, sk=sk, d=kc.d, dtype=kc.dtype, causal=kc.causal,
                    window=draw(_window(kc.causal, kc.window)), softcap=draw(_softcap(kc.softcap)),
                    scale=draw(_SCALE), layout=layout, q_style=q_style, kv_style=kv_style,
                    blocks=kc.blocks, q_mag=draw(st.sampled_from([1.0, 1.0, 3.0])),
                    seed=draw(st.integers(0, 2**16)),
                    backend=draw(st.sampled_from(["auto", "hopper"]) if _hopper_class_ok(kc)
                                 else st.just("auto")),
                    dropout=draw(st.sampled_from([0.0, 0.0, 0.0, 0.2, 0.5])),
                    infer=draw(st.sampled_from([False, False, True])),
                    alibi=draw(st.sampled_from([False, False, False, True])),
                    sinks=draw(st.sampled_from([False, False, False, True])))  # fmt: skip


def run_attention_case(c: AttnCase, grads: bool = True, backend: str | None = None) -> None:
    """flash_attention on the case against float64: out and LSE, then dq, dk, dv of the
    leaves (seen through the same views), by the 2x / 3x rule. ``backend``: the case's
    unless given; "hopper" where the Hopper family cannot run the case (strides TMA cannot
    address, a scale of 0, no sm90 GPU) runs "auto" instead."""
    backend = backend or c.backend
    grads = grads and not c.infer
    leaves, views = _attention_tensors(c)
    leaves = {n: t.to(c.dtype) for n, t in leaves.items()}  # the values every side sees
    g = torch.Generator().manual_seed(c.seed + 1)

    def inputs(dtype):
        ls = {n: t.to(DEVICE, dtype).clone().requires_grad_(grads) for n, t in leaves.items()}
        return ls, [views[n][1](ls[views[n][0]]) for n in "qkv"]

    ours_l, (q, k, v) = inputs(c.dtype)
    gv = torch.Generator().manual_seed(c.seed + 3)
    variants = {}
    if c.alibi:
        variants["alibi_slopes"] = (torch.rand(c.h, generator=gv) * 0.99 + 0.01).to(DEVICE)
    if c.sinks:
        variants["sinks"] = torch.randn(c.h, generator=gv).to(DEVICE, c.dtype)
    problem = checks.check_inputs(q, k, v, causal=c.causal, softmax_scale=c.scale,
                                  layout=c.layout, align="bottom_right", window_size=c.window,
                                  softcap=c.softcap, **variants)  # fmt: skip
    if backend == "hopper":
        from diyfa.attention import hopper_bwd, hopper_fwd

        if hopper_fwd.supports(problem) is not None:
            backend = "auto"
        else:
            bwd = "gluon" if hopper_bwd.supports(problem) is None else "portable"
            _count_path("attention", f"fwd hopper / bwd {bwd} (backend='hopper')")
    if backend == "auto":
        _count_path("attention", _attention_path(problem))
    drop = {}
    if c.dropout:
        drop = dict(dropout_p=c.dropout, generator=torch.Generator().manual_seed(c.seed + 2))
    with _pinned_blocks(c.blocks), torch.set_grad_enabled(not c.infer):
        got = diyfa.flash_attention(q, k, v, causal=c.causal, softmax_scale=c.scale,
                                    layout=c.layout, return_lse=not c.infer, backend=backend,
                                    window_size=c.window, softcap=c.softcap, **drop,
                                    **variants)  # fmt: skip
        out, lse = (got, None) if c.infer else got
        assert out.shape == q.shape and out.dtype == c.dtype and out.device == q.device
        do = torch.randn(out.shape, generator=g).to(DEVICE, c.dtype)
        if grads:
            out.backward(do)
    window = None if c.window == (-1, -1) else c.window
    kw = dict(causal=c.causal, softmax_scale=c.scale, window=window, softcap=c.softcap,
              layout=c.layout, **variants)  # fmt: skip
    ref_l, ref_in = inputs(torch.float64)
    pt_l, pt_in = inputs(c.dtype)
    ref_kw = dict(kw)
    if c.dropout:  # the kernels' mask (reference.dropout_mask), for every (batch, head)
        seed = int(torch.randint(0, 2**62, (), generator=torch.Generator().manual_seed(
            c.seed + 2)))
        mask = torch.stack([torch.stack([dropout_mask(seed, i * c.h + j, c.sq, c.sk, c.dropout)
                                         for j in range(c.h)]) for i in range(c.b)])
        ref_kw.update(dropout_p=c.dropout, dropout_mask=mask.to(DEVICE))
    ref, ref_lse = attention_ref(*ref_in, compute_dtype=torch.float64, return_lse=True,
                                 **dict(ref_kw, sinks=_double(variants.get("sinks"))))
    pt = attention_ref(*pt_in, compute_dtype=c.dtype, **ref_kw)
    # (dropout: the kept probabilities are scaled by 1 / (1 - p), and so are their roundings)
    slack = dict(zip(("out", "q", "k", "v"), (x / (1.0 - c.dropout) for x in rounding_slack(
        *ref_in, do, c.dtype, **kw)), strict=True))  # fmt: skip
    _check("out", out, pt, ref, 2, c.dtype, slack["out"])
    if c.infer:
        return
    _check_lse(lse, ref_lse)
    if not grads:
        return
    ref.backward(do.double())
    pt.backward(do)
    for name in "qkv":
        leaf, fn = views[name]
        if ours_l[leaf].grad is None:  # empty problem: nothing flowed back
            assert ref_l[leaf].grad is None or not ref_l[leaf].grad.any()
            continue
        _check("d" + name, fn(ours_l[leaf].grad), fn(pt_l[leaf].grad), fn(ref_l[leaf].grad), 3,
               c.dtype, _through(fn, ref_l[leaf], slack[name]))  # fmt: skip


def _double(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.double()


@settings(max_examples=EXAMPLES["attention"])
@given(case=attention_cases())
def test_fuzz_attention(case):
    _example("attention", run_attention_case, case)


# ---------------------------------------------------------------------------------- varlen
@dataclass(frozen=True)
class VarlenCase:
    lens_q: tuple
    lens_k: tuple
    extra_q: int  # max_seqlen_q beyond the longest sequence (allowed)
    extra_k: int
    h: int
    hk: int
    d: int
    dtype: torch.dtype
    causal: bool
    window: tuple
    softcap: float
    scale: float | None
    sliced: bool
    blocks: tuple | None
    seed: int


@st.composite
def varlen_cases(draw):
    kc = draw(_kernel_class("varlen"))
    n = draw(st.integers(1, 4 if not GPU else 16))
    top = min(MAX_LEN, math.isqrt(MAX_SCORES // n))  # all sequences' scores within bounds
    lens_q = tuple(draw(st.lists(_seqlen(top), min_size=n, max_size=n)))
    lens_k = tuple(draw(st.lists(_seqlen(top), min_size=n, max_size=n)))
    scores = max(1, sum(a * b for a, b in zip(lens_q, lens_k, strict=True)))
    max_h = max(1, MAX_SCORES // scores)
    hk = draw(st.integers(1, min(2 if not GPU else 4, max_h)))
    h = hk * draw(st.integers(1, max(1, min(3, max_h // hk))))
    return VarlenCase(lens_q=lens_q, lens_k=lens_k, extra_q=draw(st.sampled_from([0, 0, 3])),
                      extra_k=draw(st.sampled_from([0, 0, 5])), h=h, hk=hk, d=kc.d,
                      dtype=kc.dtype, causal=kc.causal,
                      window=draw(_window(kc.causal, kc.window)),
                      softcap=draw(_softcap(kc.softcap)), scale=draw(_SCALE),
                      sliced=draw(st.booleans()), blocks=kc.blocks,
                      seed=draw(st.integers(0, 2**16)))  # fmt: skip


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()],
                        dtype=torch.int32, device=DEVICE)  # fmt: skip


def run_varlen_case(c: VarlenCase, grads: bool = True) -> None:
    """flash_attention_varlen against per-sequence float64 attention: out, LSE, gradients."""
    g = torch.Generator().manual_seed(c.seed)
    shapes = {"q": (sum(c.lens_q), c.h, c.d), "k": (sum(c.lens_k), c.hk, c.d),
              "v": (sum(c.lens_k), c.hk, c.d)}  # fmt: skip
    fn = _ident
    if c.sliced:
        leaf_shapes = {n: _sliced(s)[0] for n, s in shapes.items()}
        fn = _sliced(shapes["q"])[1]  # the same slicing for 3-D shapes of any size
    else:
        leaf_shapes = shapes
    leaves = {n: torch.randn(s, generator=g).to(c.dtype) for n, s in leaf_shapes.items()}

    def inputs(dtype):
        ls = {n: t.to(DEVICE, dtype).clone().requires_grad_(grads) for n, t in leaves.items()}
        return ls, [fn(ls[n]) for n in "qkv"]

    cu_q, cu_k = _cu(c.lens_q), _cu(c.lens_k)
    max_q, max_k = max(c.lens_q) + c.extra_q, max(c.lens_k) + c.extra_k
    ours_l, (q, k, v) = inputs(c.dtype)
    _count_path("varlen", _attention_path(checks.check_varlen_inputs(
        q, k, v, cu_q, cu_k, max_q, max_k, causal=c.causal, softmax_scale=c.scale,
        window_size=c.window, softcap=c.softcap)))  # fmt: skip
    with _pinned_blocks(c.blocks):
        out, lse = diyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k,
                                                causal=c.causal, softmax_scale=c.scale,
                                                return_lse=True, window_size=c.window,
                                                softcap=c.softcap)  # fmt: skip
        assert out.shape == q.shape and out.dtype == c.dtype
        do = torch.randn(out.shape, generator=g).to(DEVICE, c.dtype)
        if grads:
            out.backward(do)
    window = None if c.window == (-1, -1) else c.window

    def per_sequence(dtype):
        ls, (rq, rk, rv) = inputs(dtype)
        outs, lses = [], []
        cq, ck = cu_q.tolist(), cu_k.tolist()
        for i in range(len(c.lens_q)):
            qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
            o, s = attention_ref(rq[qs][None], rk[ks][None], rv[ks][None], causal=c.causal,
                                 softmax_scale=c.scale, window=window, softcap=c.softcap,
                                 layout="bshd", compute_dtype=dtype,
                                 return_lse=True)  # fmt: skip
            outs.append(o[0])
            lses.append(s[0])
        o = torch.cat(outs)
        if grads:
            (o * do.to(dtype)).sum().backward()
        return ls, o, torch.cat(lses, dim=1)

    ref_l, ref, ref_lse = per_sequence(torch.float64)
    pt_l, pt, _ = per_sequence(c.dtype)
    # The rounding slack per sequence: rows of out and dq, rows of dk and dv.
    slack = {"out": [], "q": [], "k": [], "v": []}
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(c.lens_q)):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        parts = rounding_slack(q[qs][None], k[ks][None], v[ks][None], do[qs][None], c.dtype,
                               causal=c.causal, softmax_scale=c.scale, window=window,
                               softcap=c.softcap, layout="bshd")  # fmt: skip
        for name, part in zip(slack, parts, strict=True):
            slack[name].append(part[0])
    slack = {name: torch.cat(parts) for name, parts in slack.items()}
    _check("out", out, pt, ref, 2, c.dtype, slack["out"])
    _check_lse(lse, ref_lse)
    if grads:
        for name in "qkv":
            _check("d" + name, fn(ours_l[name].grad), fn(pt_l[name].grad),
                   fn(ref_l[name].grad), 3, c.dtype, slack[name])  # fmt: skip


@settings(max_examples=EXAMPLES["varlen"])
@given(case=varlen_cases())
def test_fuzz_varlen(case):
    _example("varlen", run_varlen_case, case)


# --------------------------------------------------------------------------------- kvcache
@dataclass(frozen=True)
class KVCase:
    lens: tuple  # cached tokens per sequence before the append
    sq: int
    s_new: int
    h: int
    hk: int
    d: int
    dtype: torch.dtype
    causal: bool
    scale: float | None
    page: int  # 0: a contiguous cache
    spare: int  # rows (contiguous) or pages (paged) beyond what the sequences need
    packed: bool  # k_cache / v_cache: slices of one (..., 2, kv_heads, d) tensor
    splits: int
    seed: int


@st.composite
def kvcache_cases(draw):
    kc = draw(_kernel_class("kvcache"))
    paged, splits = kc.blocks
    b = draw(st.integers(1, 3 if not GPU else 8))
    top = 80 if not GPU else MAX_LEN
    lens = tuple(draw(st.lists(st.one_of(st.integers(0, top), st.sampled_from([0, 1])),
                               min_size=b, max_size=b)))  # fmt: skip
    sq = draw(st.integers(1, 6 if not GPU else 64))
    s_new = draw(st.sampled_from([0, 0, 1, sq, 3]))
    hk = draw(st.integers(1, 2 if not GPU else 8))
    h = hk * draw(st.integers(1, 4))
    return KVCase(lens=lens, sq=sq, s_new=s_new, h=h, hk=hk, d=kc.d, dtype=kc.dtype,
                  causal=kc.causal, scale=draw(_SCALE),
                  page=draw(st.sampled_from([1, 3, 16, 32, 64])) if paged else 0,
                  spare=draw(st.sampled_from([0, 1, 7])), packed=draw(st.booleans()),
                  splits=splits,
                  seed=draw(st.integers(0, 2**16)))  # fmt: skip


def run_kvcache_case(c: KVCase) -> None:
    """flash_attention_with_kvcache against float64 attention over each sequence's cache
    after the append: out by the 2x rule, LSE, and the cache rows written (only those)."""
    g = torch.Generator().manual_seed(c.seed)
    b, d, hk = len(c.lens), c.d, c.hk
    total = [n + c.s_new for n in c.lens]
    longest = max(total)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, c.dtype)

    q = rnd(b, c.sq, c.h, d)
    k_new = rnd(b, c.s_new, hk, d) if c.s_new else None
    v_new = rnd(b, c.s_new, hk, d) if c.s_new else None
    if c.page == 0:  # contiguous (batch, max_len, kv_heads, d)
        rows = longest + c.spare
        store = rnd(b, rows, 2, hk, d) if c.packed else None
        k_cache = store[:, :, 0] if c.packed else rnd(b, rows, hk, d)
        v_cache = store[:, :, 1] if c.packed else rnd(b, rows, hk, d)
        table = None
    else:  # paged: shuffled pages, unused table entries pointing far outside the pool
        per_seq = max(1, -(-longest // c.page))
        pool = b * per_seq + c.spare
        store = rnd(pool, c.page, 2, hk, d) if c.packed else None
        k_cache = store[:, :, 0] if c.packed else rnd(pool, c.page, hk, d)
        v_cache = store[:, :, 1] if c.packed else rnd(pool, c.page, hk, d)
        perm = torch.randperm(pool, generator=g)[: b * per_seq].view(b, per_seq)
        for i, n in enumerate(total):
            perm[i, -(-n // c.page):] = 10**6  # never read: past every sequence's end
        table = perm.to(DEVICE, torch.int32)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    seqlens = torch.tensor(c.lens, dtype=torch.int32, device=DEVICE)

    def logical(cache, i, n):  # sequence i's first n rows, (1, n, kv_heads, d)
        if table is None:
            return cache[i:i + 1, :n]
        idx = torch.arange(n, device=DEVICE)
        return cache[table[i, idx // c.page].long(), idx % c.page][None]

    with torch.no_grad():
        out, lse = diyfa.flash_attention_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, block_table=table,
            causal=c.causal, softmax_scale=c.scale, num_splits=c.splits,
            return_lse=True)  # fmt: skip
    _count_path("kvcache", f"{'paged' if table is not None else 'contiguous'}, num_splits "
                f"{c.splits or 'auto'}{', append' if c.s_new else ''}")  # fmt: skip
    assert out.shape == q.shape and out.dtype == c.dtype
    assert torch.equal(seqlens.cpu(), torch.tensor(c.lens, dtype=torch.int32))
    # The cache: the new rows at lens[i].., everything else as before.
    want_k, want_v = before_k.clone(), before_v.clone()
    for i, n in enumerate(c.lens):
        for j in range(c.s_new):
            pos = n + j
            if table is None:
                want_k[i, pos], want_v[i, pos] = k_new[i, j], v_new[i, j]
            else:
                page = int(table[i, pos // c.page])
                want_k[page, pos % c.page] = k_new[i, j]
                want_v[page, pos % c.page] = v_new[i, j]
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    outs = {torch.float64: [], c.dtype: []}
    lses, slack = [], []
    for i, n in enumerate(total):
        ki, vi = logical(k_cache, i, n), logical(v_cache, i, n)
        slack.append(rounding_slack(q[i:i + 1], ki, vi, torch.zeros_like(q[i:i + 1]), c.dtype,
                                    causal=c.causal, softmax_scale=c.scale, window=None,
                                    softcap=0.0, layout="bshd")[0])  # fmt: skip
        for dtype in outs:
            o, s = attention_ref(q[i:i + 1], ki, vi, causal=c.causal, softmax_scale=c.scale,
                                 layout="bshd", compute_dtype=dtype,
                                 return_lse=True)  # fmt: skip
            outs[dtype].append(o)
            if dtype == torch.float64:
                lses.append(s)
    ref, pt = torch.cat(outs[torch.float64]), torch.cat(outs[c.dtype])
    _check("out", out, pt, ref, 2, c.dtype, torch.cat(slack))
    _check_lse(lse, torch.cat(lses))


@settings(max_examples=EXAMPLES["kvcache"])
@given(case=kvcache_cases())
def test_fuzz_kvcache(case):
    _example("kvcache", run_kvcache_case, case)


# ---------------------------------------------------------------------------------- matmul
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
_MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7}


@dataclass(frozen=True)
class MatmulCase:
    batch: int | None
    m: int
    n: int
    k: int
    dtype_a: torch.dtype
    dtype_b: torch.dtype
    layout_a: str
    layout_b: str
    out_dtype: torch.dtype | None
    scale_a: str  # "none", "tensor", "row", "row1" ((M, 1) / (1, N)), "batch"
    scale_b: str
    bias: torch.dtype | None
    activation: str | None
    precision: str
    kernel: str
    seed: int


@st.composite
def matmul_cases(draw):
    top = 80 if not GPU else 4096
    dims = st.one_of(st.integers(1, top), st.sampled_from([0, 1, 16, 17]))
    batch = draw(st.one_of(st.none(), st.integers(1, 3)))
    dtype = draw(st.sampled_from(DTYPES + FP8))
    dtype_b = draw(st.sampled_from(FP8)) if dtype in FP8 else dtype
    fp8 = dtype in FP8
    scale_modes = ["tensor", "row", "row1"] + (["batch"] if batch else [])
    scale = st.sampled_from(scale_modes if fp8 else ["none", "none", *scale_modes])
    kernels = ["auto", "portable", "tma"] + (["ws"] if GPU else [])
    return MatmulCase(batch=batch, m=draw(dims), n=draw(dims), k=draw(dims), dtype_a=dtype,
                      dtype_b=dtype_b,
                      layout_a=draw(st.sampled_from(["row", "transposed", "sliced"])),
                      layout_b=draw(st.sampled_from(["row", "transposed", "sliced"])),
                      out_dtype=draw(st.sampled_from([None, None, *DTYPES])),
                      scale_a=draw(scale), scale_b=draw(scale),
                      bias=draw(st.sampled_from([None, None, *DTYPES])),
                      activation=draw(st.sampled_from([None, "relu", "gelu", "silu"])),
                      precision=draw(st.sampled_from(["tf32", "ieee"])),
                      kernel=draw(st.sampled_from(kernels)),
                      seed=draw(st.integers(0, 2**16)))  # fmt: skip


def _matrix(lead, rows, cols, layout, g):
    """fp32 values (lead..., rows, cols) and a view of them in ``layout``: "row" (row-major),
    "transposed" (column-major) or "sliced" (every other column of a wider tensor)."""
    x = torch.randn(*lead, rows, cols, generator=g)
    if layout == "transposed":
        return x, lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "sliced":
        def sliced(t):
            wide = torch.zeros(*lead, rows + 1, 2 * cols + 3, dtype=t.dtype, device=t.device)
            wide[..., 1:, 3::2] = t
            return wide[..., 1:, 3::2]
        return x, sliced
    return x, lambda t: t.contiguous()


def _scale(mode, lead, rows, side, g):
    """A fp32 scale: "tensor" one element, "row" (rows,), "row1" (rows, 1) for a and
    (1, rows) for b, "batch" (batch, rows)."""
    if mode == "none":
        return None
    if mode == "tensor":
        return torch.rand((), generator=g) + 0.5
    if mode == "batch":
        return torch.rand(*lead, rows, generator=g) + 0.5
    s = torch.rand(rows, generator=g) + 0.5
    if mode == "row1":
        return s[:, None] if side == "a" else s[None, :]
    return s


def _as_factor(s, mode, side):
    """A scale as a factor broadcasting over the (lead..., M, N) product."""
    if s is None:
        return 1.0
    if mode == "tensor":
        return s.reshape(())
    s = s if mode == "batch" else s.reshape(-1)  # (batch, rows) or (rows,)
    return s[..., :, None] if side == "a" else s[..., None, :]


def _half_ulp(ref, dtype):
    if dtype not in _MANTISSA_BITS:
        return 0.0
    _, exp = torch.frexp(ref.abs())
    return torch.ldexp(torch.ones_like(ref), exp - 2 - _MANTISSA_BITS[dtype])


def _tf32_truncated(x: torch.Tensor) -> torch.Tensor:
    """fp32 values with the 13 mantissa bits TF32 drops cleared (round toward zero), in
    a fresh contiguous tensor."""
    bits = x.contiguous().view(torch.int32) & ~0x1FFF
    return bits.view(torch.float32)


def _fp32_product(a: torch.Tensor, b: torch.Tensor, tf32: bool) -> torch.Tensor:
    """torch.matmul of fp32 operands with cuBLAS's TF32 allowed or not."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        return torch.matmul(a, b)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def run_matmul_case(c: MatmulCase) -> None:
    """triton_matmul against float64 by test_matmul's rule: error beyond half an output ulp
    at most 2x the error of PyTorch in the inputs' precision (for fp8: the exact fp32
    product rounded once), plus 1e-6 for fp32 outputs."""
    g = torch.Generator().manual_seed(c.seed)
    lead = () if c.batch is None else (c.batch,)
    xa, fa = _matrix(lead, c.m, c.k, c.layout_a, g)
    xb, fb = _matrix(lead, c.k, c.n, c.layout_b, g)
    a = fa(xa.to(DEVICE, c.dtype_a))
    b = fb(xb.to(DEVICE, c.dtype_b))
    sa = _scale(c.scale_a, lead, c.m, "a", g)
    sb = _scale(c.scale_b, lead, c.n, "b", g)
    sa = None if sa is None else sa.to(DEVICE)
    sb = None if sb is None else sb.to(DEVICE)
    bias = None if c.bias is None else (torch.randn(c.n, generator=g) * 2).to(DEVICE, c.bias)
    fp8 = c.dtype_a in FP8
    out_dtype = c.out_dtype or (torch.bfloat16 if fp8 else c.dtype_a)
    # fp8 on a GPU: the accurate accumulation (partial sums promoted to fp32 every 32
    # products, cuBLAS's default), judged against the exact product rounded to bf16 (below).
    # The default fast accumulation drifts on long sums by design (matmul.fp8_accumulation;
    # test_matmul's test_gpu_fp8_vs_scaled_mm judges it against cuBLAS's own fast mode).
    env = {"DIYFA_FP8_ACC": "32"} if fp8 and HAS_CUDA else {}
    try:
        with mock.patch.dict(os.environ, env):
            out = triton_matmul(a, b, out_dtype=c.out_dtype, scale_a=sa, scale_b=sb, bias=bias,
                                activation=c.activation, precision=c.precision,
                                kernel=c.kernel)  # fmt: skip
    except ValueError as e:  # a forced kernel that cannot run these operands says so
        assert c.kernel in ("tma", "ws") and f"kernel='{c.kernel}'" in str(e), e
        assume(False)
    assert out.shape == (*lead, c.m, c.n) and out.dtype == out_dtype and out.is_contiguous()
    fac_a, fac_b = _as_factor(sa, c.scale_a, "a"), _as_factor(sb, c.scale_b, "b")

    def epilogue(prod, dtype):
        fa_, fb_ = (f if isinstance(f, float) else f.to(dtype) for f in (fac_a, fac_b))
        x = prod * fa_ * fb_
        if bias is not None:
            x = x + bias.to(dtype)
        return _act(x, c.activation)

    ref = epilogue(matmul_ref(a, b), torch.float64)
    if c.dtype_a == torch.float32 and c.precision == "tf32" and HAS_CUDA:
        # Triton's TF32 dot truncates the operands to TF32 (docs/matmul.md; against cuBLAS's
        # rounded TF32 it is a known 2.5x, test_matmul.py::test_gpu_fp32's strict xfail),
        # and cuBLAS runs some shapes (K = 1, vectors) in exact fp32 whatever allow_tf32
        # says: the yardstick is the documented product, the truncated operands
        # multiplied in exact fp32.
        prod = _fp32_product(_tf32_truncated(a), _tf32_truncated(b), tf32=False)
    elif fp8 or c.dtype_a == torch.float32:
        prod = _fp32_product(a.float(), b.float(), tf32=c.precision == "tf32" and not fp8)
    else:
        prod = torch.matmul(a, b).float()  # PyTorch in the inputs' precision
    baseline = epilogue(prod, torch.float32).to(out_dtype)
    if fp8 and HAS_CUDA:  # an fp8 wgmma sums its 32 products in reduced precision even when
        baseline = baseline.to(torch.bfloat16).to(out_dtype)  # promoted: test_fp8's rule
    if out.numel() == 0:
        return
    err = (out.double() - ref).abs() - _half_ulp(ref, out_dtype)
    allowed = 2 * (baseline.double() - ref).abs().max().item()
    allowed += 1e-6 if out_dtype == torch.float32 else 0.0
    worst = err.max().item()
    assert worst <= allowed, (f"max error beyond half an output ulp {worst:.4g} > allowed "
                              f"{allowed:.4g} (2x torch's error)")  # fmt: skip


@settings(max_examples=EXAMPLES["matmul"])
@given(case=matmul_cases())
def test_fuzz_matmul(case):
    _example("matmul", run_matmul_case, case)


# --------------------------------------------------------------------------- fp8 attention
@dataclass(frozen=True)
class Fp8Case:
    b: int
    h: int
    hk: int
    sq: int
    sk: int
    d: int
    causal: bool
    window: tuple
    softcap: float
    layout: str
    per_head: bool  # descales per (batch, kv head), else per tensor
    outliers: bool  # a few head-dim channels of q and k 20x larger
    seed: int


@st.composite
def fp8_cases(draw):
    sq, sk = draw(_seqlen()), draw(_seqlen())
    max_bh = max(1, MAX_SCORES // max(1, sq * sk))
    hk = draw(st.integers(1, min(2 if not GPU else 4, max_bh)))
    h = hk * draw(st.integers(1, max(1, min(3, max_bh // hk))))
    b = draw(st.integers(1, max(1, min(2, max_bh // h))))
    causal = draw(st.booleans())
    sides = draw(st.one_of(st.none(), st.tuples(st.booleans(), st.booleans()).map(
        lambda w: w if any(w) else None)))  # fmt: skip
    d = draw(st.sampled_from([16, 32, 64, 128, 256]) if GPU else st.one_of(
        st.integers(1, 64), st.sampled_from([16, 64, 128])))  # fmt: skip
    return Fp8Case(b=b, h=h, hk=hk, sq=sq, sk=sk, d=d, causal=causal,
                   window=draw(_window(causal, sides)), softcap=draw(_softcap(draw(
                       st.sampled_from([False, False, True])))),
                   layout=draw(st.sampled_from(["bhsd", "bshd"])), per_head=draw(st.booleans()),
                   outliers=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))  # fmt: skip


def run_fp8_case(c: Fp8Case) -> None:
    """The fp8 forward against float64 attention of the dequantised inputs: out within 2x a
    PyTorch emulation of the recipe (test_fp8_attention) plus the rounding of P to e4m3 (3
    mantissa bits: 2^-4 of each term of P @ |V|, which the emulation, rounding P against the
    row's global maximum where the kernel uses the running one, need not share) and half a
    bf16 ulp; LSE as for 16-bit inputs, plus the bound of the tensor cores' reduced-precision
    fp8 sums (test_fp8_attention.check_fp8_lse)."""
    g = torch.Generator().manual_seed(c.seed)

    def make(heads, s):
        shape = (c.b, heads, s, c.d) if c.layout == "bhsd" else (c.b, s, heads, c.d)
        return torch.randn(shape, generator=g)

    q, k, v = make(c.h, c.sq), make(c.hk, c.sk), make(c.hk, c.sk)
    if c.outliers:
        q[..., : max(1, c.d // 16)] *= 20
        k[..., : max(1, c.d // 16)] *= 20
    heads_dim = 1 if c.layout == "bhsd" else 2
    seq_dim = 3 - heads_dim

    def quant(x, group):  # amax scaling to 448; per (batch, kv head) takes a group's max
        if not c.per_head:
            amax = x.abs().amax() if x.numel() else torch.tensor(0.0)
            sc = (amax / 448).clamp_min(1e-12).reshape(1)
            return (x / sc).to(E4M3), sc, sc
        amax = (x.abs().amax(dim=(seq_dim, 3)) if x.numel()
                else torch.zeros(c.b, x.shape[heads_dim]))  # an empty sequence: any scale
        amax = amax.view(c.b, c.hk, group).amax(-1)  # (batch, kv heads)
        sc = (amax / 448).clamp_min(1e-12)
        full = sc.repeat_interleave(group, 1)  # per head
        shape = full[:, :, None, None] if c.layout == "bhsd" else full[:, None, :, None]
        return (x / shape).to(E4M3), sc.contiguous(), shape

    group = c.h // c.hk
    (q8, qs, qb), (k8, ks, kb), (v8, vs, vb) = quant(q, group), quant(k, 1), quant(v, 1)
    with torch.no_grad():
        out, lse = diyfa.flash_attention(
            q8.to(DEVICE), k8.to(DEVICE), v8.to(DEVICE), causal=c.causal, layout=c.layout,
            window_size=c.window, softcap=c.softcap, q_descale=qs.to(DEVICE),
            k_descale=ks.to(DEVICE), v_descale=vs.to(DEVICE), return_lse=True)  # fmt: skip
    qd, kd, vd = q8.double() * qb.double(), k8.double() * kb.double(), v8.double() * vb.double()
    window = None if c.window == (-1, -1) else c.window
    kw = dict(causal=c.causal, layout=c.layout, softcap=c.softcap, window=window)
    ref, ref_lse = attention_ref(qd, kd, vd, compute_dtype=torch.float64, return_lse=True, **kw)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    check_fp8_lse(lse, ref_lse, qd, kd, scale=c.d**-0.5, layout=c.layout, causal=c.causal,
                  window=window)  # fmt: skip
    if not out.numel():
        return
    emu = _emulate(qd, kd, vd, causal=c.causal, scale=c.d**-0.5, layout=c.layout,
                   window=window, softcap=c.softcap)  # fmt: skip
    # The P @ |V| bound of P's rounding: float64 probabilities of the reference's scores;
    # and of the scores' own error (fp8 sums, check_fp8_lse's bound d per row): each
    # probability then moves by at most a factor e^(+-2d).
    p_abs_v = attention_ref(qd, kd, vd.abs(), compute_dtype=torch.float64, **kw)
    d_row = fp8_score_error(qd, kd, scale=c.d**-0.5, layout=c.layout, causal=c.causal,
                            window=window)  # fmt: skip
    d_row = d_row[..., None] if c.layout == "bhsd" else d_row.transpose(1, 2)[..., None]
    slack = (2.0**-4 + torch.expm1(2 * d_row)) * p_abs_v + half_ulp(ref, torch.bfloat16)
    err = ((out.double().cpu() - ref) .abs() - slack).max().item()
    emu_err = (emu.double() - ref).abs().max().item()
    assert torch.isfinite(out).all()
    assert err <= 2 * emu_err + FLOOR[torch.bfloat16], (
        f"fp8 error beyond P's rounding {err:.3e} > 2x the emulation's {emu_err:.3e}")


@settings(max_examples=EXAMPLES["fp8_attention"])
@given(case=fp8_cases())
def test_fuzz_fp8_attention(case):
    _example("fp8_attention", run_fp8_case, case)


def test_profiles_are_registered():
    """conftest.py registers both profiles and loads the one DIYFA_FUZZ_PROFILE names."""
    ci, gpu = settings.get_profile("ci"), settings.get_profile("gpu")
    assert ci.derandomize and ci.deadline is None and ci.database is None
    assert gpu.max_examples >= 1000 and not gpu.derandomize
    assert settings.default.max_examples == settings.get_profile(FUZZ_PROFILE).max_examples
