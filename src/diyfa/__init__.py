"""diyfa: DIY FlashAttention — FlashAttention and matmul in Python/Triton, with the tools to
measure, analyse and tune them.

Importing ``diyfa`` compiles and launches nothing: the kernel modules load on first use.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it (loaded lazily)
_LAZY = {
    "flash_attention": "diyfa.attention",
    "flash_attention_with_lse": "diyfa.attention",
    "flash_attention_varlen": "diyfa.attention",
    "flash_attention_with_kvcache": "diyfa.attention",
    "scaled_dot_product_attention": "diyfa.attention",
    "key_major_values": "diyfa.attention",
    "triton_matmul": "diyfa.ops.matmul",
    "check_hopper_features": "diyfa.device",
    "device_info": "diyfa.device",
    "measure_ceilings": "diyfa.device",
    "attention_flops": "diyfa.flops",
    "attention_bytes": "diyfa.flops",
    "matmul_flops": "diyfa.flops",
    "matmul_bytes": "diyfa.flops",
    "arithmetic_intensity": "diyfa.flops",
    "attention_ref": "diyfa.reference",
    "matmul_ref": "diyfa.reference",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'diyfa' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
