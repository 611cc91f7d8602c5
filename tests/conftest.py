"""Test setup: without a GPU, kernels run under the Triton interpreter; `gpu` tests skip.

TRITON_INTERPRET must be set before any kernel module (diyfa.ops.*, diyfa.attention.portable)
is imported: Triton decides at decoration time whether a kernel is compiled or interpreted.

Hypothesis profiles (tests/test_fuzz.py), chosen by ``DIYFA_FUZZ_PROFILE``:
    ci   (default) few examples per test, small shapes, derandomized: CI runs the same
         examples every time, on the CPU under the interpreter.
    deep the ci shapes with 10x the examples and a fresh seed each run: bug hunting on a
         CPU (minutes to an hour).
    gpu  thousands of examples per test, lengths up to 16k, a fresh seed each run
         (``--hypothesis-seed=N`` repeats one); needs CUDA (``benchmarks/gpu_fuzz.sh``).
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if HAS_CUDA else "cpu"

FUZZ_PROFILE = os.environ.get("DIYFA_FUZZ_PROFILE", "ci")
try:
    from hypothesis import HealthCheck, settings
except ImportError:  # hypothesis is a dev extra: only tests/test_fuzz.py needs it
    settings = None
if settings is not None:
    _FUZZ_COMMON = dict(
        deadline=None,  # interpreter and first-call compile times vary far more than any limit
        database=None,  # no .hypothesis/ directory: failures become named regression tests
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.filter_too_much],
    )  # fmt: skip
    settings.register_profile("ci", max_examples=40, derandomize=True, **_FUZZ_COMMON)
    settings.register_profile("deep", max_examples=400, derandomize=False, **_FUZZ_COMMON)
    settings.register_profile("gpu", max_examples=2000, derandomize=False, **_FUZZ_COMMON)
    if FUZZ_PROFILE not in ("ci", "deep", "gpu"):
        raise ValueError(f"DIYFA_FUZZ_PROFILE must be 'ci', 'deep' or 'gpu', got "
                         f"{FUZZ_PROFILE!r}")  # fmt: skip
    settings.load_profile(FUZZ_PROFILE)


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (this machine has none; CPU tests run "
                            "the same kernels under the Triton interpreter)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return DEVICE
