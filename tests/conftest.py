"""Test setup: without a GPU, kernels run under the Triton interpreter; `gpu` tests skip.

TRITON_INTERPRET must be set before any kernel module (diyfa.ops.*, diyfa.attention.portable)
is imported: Triton decides at decoration time whether a kernel is compiled or interpreted.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if HAS_CUDA else "cpu"


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
