"""What the GPU is and what it can do.

``device_info()`` reads the present device (name, compute capability, SMs, shared memory,
registers, L2) and derives feature flags (TMA, wgmma, warp specialization, fp8, bf16) and the
datasheet peaks for known GPUs. ``measure_ceilings()`` measures what the GPU really reaches:
the cuBLAS matmul rate and device-to-device copy bandwidth. Without a GPU every function
returns a well-formed answer that says so; nothing here raises for a missing GPU.

Datasheet peaks are dense (no sparsity) tensor-core TFLOPS with fp32 accumulation and memory
bandwidth in TB/s, from the vendors' datasheets. They are leads; measured ceilings are truth.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass, field

# (substring of the device name, lower case) -> dense TFLOPS per dtype and HBM TB/s.
# Order matters: the first matching entry wins, so the more specific names come first.
DATASHEET = [
    ("h100 pcie", {"bf16": 756, "fp16": 756, "fp8": 1513, "tf32": 378, "fp32": 51, "tbps": 2.0}),
    ("h100 nvl", {"bf16": 835, "fp16": 835, "fp8": 1671, "tf32": 418, "fp32": 60, "tbps": 3.9}),
    ("h100", {"bf16": 989, "fp16": 989, "fp8": 1979, "tf32": 494, "fp32": 67, "tbps": 3.35}),
    ("h200", {"bf16": 989, "fp16": 989, "fp8": 1979, "tf32": 494, "fp32": 67, "tbps": 4.8}),
    ("h800", {"bf16": 989, "fp16": 989, "fp8": 1979, "tf32": 494, "fp32": 67, "tbps": 3.35}),
    ("b200", {"bf16": 2250, "fp16": 2250, "fp8": 4500, "tf32": 1100, "fp32": 75, "tbps": 8.0}),
    ("a100", {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5, "tbps": 2.0}),
    ("a10g", {"bf16": 70, "fp16": 70, "tf32": 35, "fp32": 31.2, "tbps": 0.6}),
    ("a10", {"bf16": 125, "fp16": 125, "tf32": 62.5, "fp32": 31.2, "tbps": 0.6}),
    ("l40s", {"bf16": 362, "fp16": 362, "fp8": 733, "tf32": 183, "fp32": 91.6, "tbps": 0.864}),
    ("l4", {"bf16": 121, "fp16": 121, "fp8": 242, "tf32": 60, "fp32": 30.3, "tbps": 0.3}),
    ("4090", {"bf16": 165, "fp16": 165, "fp8": 330, "tf32": 82.6, "fp32": 82.6, "tbps": 1.008}),
    ("3090", {"bf16": 71, "fp16": 71, "tf32": 35.6, "fp32": 35.6, "tbps": 0.936}),
]


def datasheet_peaks(name: str) -> dict | None:
    """Datasheet peaks for a device name (e.g. 'NVIDIA H100 80GB HBM3'), or None if unknown."""
    lname = name.lower()
    for key, peaks in DATASHEET:
        if key in lname:
            return dict(peaks)
    return None


@dataclass
class DeviceInfo:
    available: bool
    reason: str = ""
    name: str | None = None
    compute_capability: tuple[int, int] | None = None
    sm_count: int | None = None
    shared_memory_per_block: int | None = None
    shared_memory_per_block_optin: int | None = None
    shared_memory_per_sm: int | None = None
    registers_per_sm: int | None = None
    max_threads_per_sm: int | None = None
    l2_cache_bytes: int | None = None
    total_memory_bytes: int | None = None
    tma_available: bool = False
    wgmma_available: bool = False
    warp_specialization_available: bool = False
    fp8_available: bool = False
    bf16_available: bool = False
    datasheet: dict | None = field(default=None)
    interpreter: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


def interpreter_enabled() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_info(device: int | None = None) -> DeviceInfo:
    """Facts about a CUDA device (default: the current one). Never raises for a missing GPU."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return DeviceInfo(available=False, reason="torch is not installed")
    if not torch.cuda.is_available():
        return DeviceInfo(
            available=False,
            reason="no CUDA GPU visible to torch "
            f"(torch {torch.__version__}); kernels can only run in the Triton interpreter",
            interpreter=interpreter_enabled(),
        )
    idx = torch.cuda.current_device() if device is None else device
    p = torch.cuda.get_device_properties(idx)
    cc = (p.major, p.minor)
    return DeviceInfo(
        available=True,
        name=p.name,
        compute_capability=cc,
        sm_count=p.multi_processor_count,
        shared_memory_per_block=getattr(p, "shared_memory_per_block", None),
        shared_memory_per_block_optin=getattr(p, "shared_memory_per_block_optin", None),
        shared_memory_per_sm=getattr(p, "shared_memory_per_multiprocessor", None),
        registers_per_sm=getattr(p, "regs_per_multiprocessor", None),
        max_threads_per_sm=getattr(p, "max_threads_per_multi_processor", None),
        l2_cache_bytes=getattr(p, "L2_cache_size", None),
        total_memory_bytes=p.total_memory,
        # TMA and wgmma arrived with Hopper (sm_90); warp specialization in Triton needs them.
        tma_available=cc >= (9, 0),
        wgmma_available=cc[0] == 9,
        warp_specialization_available=cc >= (9, 0),
        fp8_available=cc >= (8, 9),
        bf16_available=cc >= (8, 0),
        datasheet=datasheet_peaks(p.name),
        interpreter=interpreter_enabled(),
    )


def require_kernel_device(t, names: str) -> None:
    """Raise ValueError unless tensor ``t`` (standing for ``names``, e.g. "q, k, v") is where
    the Triton kernels can run: a CUDA GPU, or the CPU under the Triton interpreter."""
    if t.device.type == "cpu":
        if not interpreter_enabled():
            raise ValueError(
                f"{names} are CPU tensors: the Triton kernels need a CUDA GPU, or the Triton "
                "interpreter (set TRITON_INTERPRET=1 before importing diyfa) for small CPU runs"
            )
    elif t.device.type != "cuda":
        raise ValueError(
            f"{names} are on device {t.device}; accepted: cuda (or cpu with TRITON_INTERPRET=1)"
        )


@functools.cache
def kernel_limits(device_index: int) -> dict:
    """What launchers need per launch, cached: the driver queries behind it cost about a
    millisecond, which uncached would be paid on every kernel launch.

    Returns ``capability_major``, ``max_shared_mem`` (bytes a block may opt into) and
    ``sm_count`` for the CUDA device ``device_index``.
    """
    import torch
    import triton

    props = triton.runtime.driver.active.utils.get_device_properties(device_index)
    return {
        "capability_major": torch.cuda.get_device_capability(device_index)[0],
        "max_shared_mem": props["max_shared_mem"],
        "sm_count": props["multiprocessor_count"],
    }


@functools.cache
def cuda_capability(device_index: int) -> tuple[int, int]:
    """(major, minor) compute capability of the CUDA device ``device_index``, cached (read on
    every attention call to choose a kernel family)."""
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    return (major, minor)


def check_hopper_features(device: int | None = None) -> dict:
    """The seed's API: which Hopper features the present GPU has.

    Returns a dict with ``is_hopper``, ``tma_available``, ``wgmma_available``,
    ``warp_specialization_available``, ``fp8_available``, ``bf16_available``,
    ``compute_capability``, ``device_name`` and, without a GPU, ``reason``.
    """
    info = device_info(device)
    return {
        "is_hopper": bool(info.compute_capability and info.compute_capability[0] == 9),
        "tma_available": info.tma_available,
        "wgmma_available": info.wgmma_available,
        "warp_specialization_available": info.warp_specialization_available,
        "fp8_available": info.fp8_available,
        "bf16_available": info.bf16_available,
        "compute_capability": info.compute_capability,
        "device_name": info.name,
        "reason": info.reason,
    }


def measure_ceilings(size: int = 8192, copy_bytes: int = 2 << 30) -> dict:
    """Measure the cuBLAS matmul rate (TFLOPS per dtype) and device copy bandwidth (TB/s).

    Random normal inputs, median of ``triton.testing.do_bench``. Bandwidth counts bytes read
    plus bytes written. Without a GPU: ``{"available": False, "reason": ...}``.
    """
    import torch

    if not torch.cuda.is_available():
        return {"available": False, "reason": device_info().reason}
    from triton.testing import do_bench

    out: dict = {"available": True, "size": size, "matmul_tflops": {}}
    for dtype in (torch.float16, torch.bfloat16):
        a = torch.randn(size, size, device="cuda", dtype=dtype)
        b = torch.randn(size, size, device="cuda", dtype=dtype)
        ms = do_bench(lambda a=a, b=b: torch.matmul(a, b), warmup=50, rep=200, return_mode="median")
        out["matmul_tflops"][str(dtype).removeprefix("torch.")] = 2 * size**3 / ms / 1e9
        del a, b
    src = torch.empty(copy_bytes // 2, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median")
    out["copy_tbps"] = 2 * src.numel() / ms / 1e9
    return out
