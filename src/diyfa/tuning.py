"""Launch configurations as data: config spaces per architecture, pruning, and the switches.

Every kernel has
- a *space* of candidate configs (used by autotuning on the GPU),
- a *default table* per architecture (used when autotuning is off, e.g. in tests), and
- a *pruning predicate* that drops configs whose shared memory cannot fit the device.

Tuned table: ``diyfa tune --write-table`` (the block-size experiment, GPU) writes its winners
to ``tuned_configs.json`` next to this file (or any path; ``DIYFA_TUNED_TABLE=path`` adds one
more, read after the packaged one). A tuned entry replaces the hand-set default for its
architecture, kernel and head-dim bucket, and joins the front of the autotuning space.

Switches:
- Autotuning is opt-in: ``DIYFA_AUTOTUNE=1`` turns it on (off, the default, a call uses the
  tuned table's entry, else the hand-set default: a first call compiles one config instead
  of benchmarking every one, seconds instead of tens of seconds). Its winners are kept on
  disk (:func:`cached_choice`), so a later process starts from them.
- ``with diyfa.tuning.pinned("attn_fwd", BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2):``
  pins one config for one kernel (tests, experiments).
- Under the Triton interpreter there is no autotuning: small default blocks keep it quick.

Autotuning winners are remembered per key (kernel, GPU, dtype, head dim, causal, sequence
bucket, ...) for the process and in ``$DIYFA_CACHE_DIR`` (default ``~/.cache/diyfa``),
``autotune.json``, for later processes; Triton's own compile cache (``~/.triton/cache``)
keeps the compiled kernels.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from pathlib import Path

import triton

from diyfa._launcher import forget_replays, next_power_of_2
from diyfa.device import interpreter_enabled

# Config = (BLOCK_M, BLOCK_N, num_warps, num_stages).
# Forward: a Q tile of BLOCK_M rows against K/V tiles of BLOCK_N keys.
# dK/dV: a K/V tile of BLOCK_N keys against Q tiles of BLOCK_M rows.
# dQ: a Q tile of BLOCK_M rows against K/V tiles of BLOCK_N keys.
SPACES = {
    # Winners on an H200 (2026-11-21, benchmarks/results/): 64x64/4 warps below ~2k tokens
    # per head, 128x64 or 128x128 with 8 warps above.
    "attn_fwd": [
        (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3),
    ],
    # dK/dV preferred BLOCK_N = 64 at every length measured.
    # head_dim 256 (dK and dV accumulators of BLOCK_N x 256 fp32 each) wants 8 warps to
    # spread the registers: the last configs of each list are for it.
    "attn_bwd_dkdv": [
        (32, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (32, 128, 4, 3), (64, 128, 8, 2),
        (32, 64, 8, 2), (64, 64, 8, 2),
    ],
    "attn_bwd_dq": [
        (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (128, 128, 8, 2), (64, 32, 4, 2),
        (64, 64, 8, 2), (128, 32, 8, 2),
    ],
}  # fmt: skip

# Default per architecture (major compute capability) and head-dim bucket (padded head dim).
DEFAULTS = {
    # Hopper (sm90): deeper pipelines, 8 warps on large tiles.
    9: {
        "attn_fwd": {64: (128, 64, 8, 3), 128: (128, 128, 8, 3), 256: (64, 64, 4, 2)},
        # d256 backward: 8 warps (the dK/dV and dQ accumulators spill with 4: measured on an
        # H200 with autotuning off, 2026-11-23, 86-102 TFLOPS against 218-242 autotuned).
        # The dQ kernel's 128-row tiles since 2026-11-24 (H200, bf16, one process, the whole
        # backward, benchmarks/portable_bwd_ab.py,
        # benchmarks/results/2026-11-24_h200_portable-bwd-d256-configs_61b9d35.txt, TFLOPS
        # 64-64-8-2 / 128-64-8-2: 2 x 8 x 8192 198 / 241, causal 178 / 212; 16 x 8 x 1024
        # 183 / 218, causal 136 / 153; the same gradients), then 32-key blocks and 3 stages
        # (..._portable-bwd-d256-configs-2_41ea514.txt, 128-64-8-2 / 128-32-8-3: 246 / 263,
        # causal 211 / 225; 1k 219 / 237, causal 155 / 166). dK/dV's 64-64-8-2 stayed the
        # best of twelve.
        "attn_bwd_dkdv": {64: (64, 64, 4, 2), 128: (64, 64, 4, 2), 256: (64, 64, 8, 2)},
        "attn_bwd_dq": {64: (128, 64, 8, 3), 128: (128, 64, 8, 3), 256: (128, 32, 8, 3)},
    },
    # Ampere (sm80/86/89): the seed guide's smaller shared memory, fewer stages.
    8: {
        "attn_fwd": {64: (128, 64, 4, 3), 128: (128, 64, 8, 2), 256: (64, 32, 4, 2)},
        "attn_bwd_dkdv": {64: (64, 64, 4, 2), 128: (32, 64, 4, 2), 256: (16, 32, 4, 2)},
        "attn_bwd_dq": {64: (64, 64, 4, 2), 128: (64, 32, 4, 2), 256: (32, 32, 4, 2)},
    },
}
# fp32 inputs (elem_bytes 4; any architecture with a default table): the dots run in full
# fp32 ("ieee", no tensor cores), so their code grows with the tile and the 16-bit tables'
# tiles neither fit the shared memory (fp32 d128 forward 128 x 128: 384 KB) nor compile in
# reasonable time (ptxas, sm90a, triton 3.6, 2026-11-23: d256 forward 64 x 64 85 s, dK/dV
# 90 s and then too large; the tiles below fit and compile in 8-36 s each on 2 CPU cores).
FP32_DEFAULTS = {
    "attn_fwd": {64: (64, 64, 4, 2), 128: (64, 32, 4, 2), 256: (32, 64, 4, 2)},
    "attn_bwd_dkdv": {64: (32, 64, 4, 2), 128: (32, 32, 4, 2), 256: (32, 32, 4, 2)},
    "attn_bwd_dq": {64: (64, 64, 4, 2), 128: (64, 32, 4, 2), 256: (32, 32, 4, 2)},
}
# Smaller and smaller configs for when a chosen one does not fit the GPU (OutOfResources).
FALLBACKS = [(64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 1), (16, 32, 4, 1), (16, 16, 4, 1)]
# Small tiles under the interpreter: the tests still cross several blocks on short sequences.
INTERPRETER_DEFAULT = (32, 32, 4, 1)

_pinned: dict[str, dict] = {}


def autotune_enabled() -> bool:
    """Autotuning on the GPU is opt-in (``DIYFA_AUTOTUNE=1``); never in the interpreter."""
    return os.environ.get("DIYFA_AUTOTUNE", "0") == "1" and not interpreter_enabled()


def cache_file() -> Path:
    """Where autotuning winners persist across processes."""
    base = os.environ.get("DIYFA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "diyfa")
    return Path(base) / "autotune.json"


_disk: dict | None = None  # the cache file's contents, read once per process


def _cache_key(key: tuple) -> str:
    import torch

    return repr((triton.__version__, torch.__version__) + tuple(
        str(k) if not isinstance(k, (int, float, bool, type(None))) else k for k in key))


def cached_choice(key: tuple) -> tuple[dict, int, int] | None:
    """An autotuning winner an earlier process saved for ``key`` (a launch key that names the
    GPU), as (meta, num_warps, num_stages); None if there is none or the file is unreadable."""
    global _disk
    if _disk is None:
        try:
            _disk = json.loads(cache_file().read_text())
        except (OSError, ValueError):
            _disk = {}
    entry = _disk.get(_cache_key(key))
    if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], dict)):
        return None
    return dict(entry[0]), int(entry[1]), int(entry[2])


def remember_choice(key: tuple, meta: dict, num_warps: int, num_stages: int) -> None:
    """Save an autotuning winner for later processes (best effort: a read-only home or a
    full disk only costs the next process its own autotuning)."""
    global _disk
    if _disk is None:
        cached_choice(key)
    _disk[_cache_key(key)] = [dict(meta), num_warps, num_stages]
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(_disk, indent=0, sort_keys=True))
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old or the new file
    except OSError:
        pass


@contextlib.contextmanager
def pinned(kernel: str, *, BLOCK_M: int, BLOCK_N: int, num_warps: int = 4, num_stages: int = 2):
    """Pin one config for ``kernel`` (one of SPACES) inside the ``with`` block."""
    if kernel not in SPACES:
        raise ValueError(f"unknown kernel {kernel!r}; known: {sorted(SPACES)}")
    for name, value in (("BLOCK_M", BLOCK_M), ("BLOCK_N", BLOCK_N)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    old = _pinned.get(kernel)
    _pinned[kernel] = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=num_warps,
                           num_stages=num_stages)  # fmt: skip
    forget_replays()  # launches recorded with another config
    try:
        yield
    finally:
        if old is None:
            _pinned.pop(kernel, None)
        else:
            _pinned[kernel] = old
        forget_replays()


def _as_dict(cfg: tuple) -> dict:
    bm, bn, w, s = cfg
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)


def _dim_bucket(head_dim_pad: int) -> int:
    return 64 if head_dim_pad <= 64 else 128 if head_dim_pad <= 128 else 256


def head_dim_bucket(head_dim: int) -> int:
    """The tables' head-dim key for a head dim (padded to a power of two >= 16): 64, 128, 256."""
    return _dim_bucket(max(16, next_power_of_2(head_dim)))


# --------------------------------------------------------------------------- tuned table
# {major compute capability: {kernel: {key: entry}}}; attention: key = head-dim bucket (64,
# 128, 256), entry = (BLOCK_M, BLOCK_N, num_warps, num_stages); matmul kernels ("matmul_tma",
# "matmul_portable"): key 0, entry in diyfa.ops.matmul's (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
# num_warps, num_stages[, EPILOGUE_SUBTILE]) shape.
TUNED_TABLE = Path(__file__).with_name("tuned_configs.json")


def load_table(path: Path | str) -> dict:
    """A table file (JSON, keys as strings) in the Python shape (int keys, tuple entries)."""
    raw = json.loads(Path(path).read_text())
    return {int(m): {k: {int(d): tuple(c) for d, c in v.items()} for k, v in kern.items()}
            for m, kern in raw.items()}  # fmt: skip


def merge_tables(base: dict, new: dict) -> dict:
    """``base`` updated entry by entry with ``new`` (neither is modified)."""
    out = {m: {k: dict(v) for k, v in kern.items()} for m, kern in base.items()}
    for m, kern in new.items():
        for k, entries in kern.items():
            out.setdefault(m, {}).setdefault(k, {}).update(entries)
    return out


def write_table(table: dict, path: Path | str = TUNED_TABLE) -> Path:
    """Merge ``table`` into the file at ``path`` (created if absent); returns the path."""
    path = Path(path)
    if path.is_file():
        table = merge_tables(load_table(path), table)
    path.parent.mkdir(parents=True, exist_ok=True)
    as_json = {str(m): {k: {str(d): list(c) for d, c in sorted(v.items())}
                        for k, v in sorted(kern.items())}
               for m, kern in sorted(table.items())}  # fmt: skip
    path.write_text(json.dumps(as_json, indent=2) + "\n")
    tuned_table.cache_clear()
    autotuned.cache_clear()  # its spaces start with the tuned entries
    return path


@functools.cache
def tuned_table() -> dict:
    """The packaged tuned table merged with ``$DIYFA_TUNED_TABLE`` (read once per process)."""
    table: dict = {}
    for path in (TUNED_TABLE, os.environ.get("DIYFA_TUNED_TABLE")):
        if path and Path(path).is_file():
            table = merge_tables(table, load_table(path))
    return table


def tuned_entry(kernel: str, capability_major: int | None, key: int) -> tuple | None:
    """The tuned table's entry, or None."""
    if capability_major is None:
        return None
    return tuned_table().get(capability_major, {}).get(kernel, {}).get(key)


def tuned_first(space: list, kernel: str, capability_major: int | None, key: int) -> list:
    """``space`` with the tuned table's entry for (kernel, architecture, key) at the front."""
    tuned = tuned_entry(kernel, capability_major, key)
    if tuned is None:
        return list(space)
    return [tuned] + [entry for entry in space if entry != tuned]


def default_config(kernel: str, head_dim_pad: int, capability_major: int | None,
                   elem_bytes: int = 2) -> dict:  # fmt: skip
    """The config used without autotuning: pinned, else tuned (16-bit inputs: the tuned
    table's runs), else the default table's (``FP32_DEFAULTS`` for 4-byte inputs)."""
    if kernel in _pinned:
        return dict(_pinned[kernel])
    if interpreter_enabled() or capability_major is None:
        return _as_dict(INTERPRETER_DEFAULT)
    bucket = _dim_bucket(head_dim_pad)
    if elem_bytes == 4:
        return _as_dict(FP32_DEFAULTS[kernel][bucket])
    tuned = tuned_entry(kernel, capability_major, bucket)
    if tuned is not None:
        return _as_dict(tuned)
    table = DEFAULTS.get(min(max(capability_major, 8), 9))
    return _as_dict(table[kernel][bucket])


def attention_smem_bytes(kernel: str, cfg: dict, head_dim_pad: int, elem_bytes: int) -> int:
    """Shared memory a config needs, as Triton's pipelining lays it out (an estimate).

    Per stage, the streamed operands: K and V tiles (forward, dQ) or Q and dO tiles (dK/dV);
    plus the resident tile that the stream is multiplied against.
    """
    bm, bn, stages = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_stages"]
    streamed_rows = bm if kernel == "attn_bwd_dkdv" else bn
    resident_rows = bn if kernel == "attn_bwd_dkdv" else bm
    streamed = 2 * streamed_rows * head_dim_pad * elem_bytes * max(stages - 1, 1)
    return streamed + resident_rows * head_dim_pad * elem_bytes


def configs_for(kernel: str, head_dim_pad: int, elem_bytes: int, smem_limit: int,
                capability_major: int | None = None) -> list:  # fmt: skip
    """The kernel's space as ``triton.Config`` objects, pruned to what fits ``smem_limit``;
    the tuned table's entry for this architecture and head dim comes first."""
    out = []
    space = tuned_first(SPACES[kernel], kernel, capability_major, _dim_bucket(head_dim_pad))
    for cfg in map(_as_dict, space):
        # Large head dims with large tiles spill registers: keep the accumulator tile small.
        if head_dim_pad >= 256 and cfg["BLOCK_M"] * cfg["BLOCK_N"] > 64 * 128:
            continue
        if attention_smem_bytes(kernel, cfg, head_dim_pad, elem_bytes) > smem_limit:
            continue
        meta = {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"]}
        out.append(triton.Config(meta, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    return out


@functools.cache
def autotuned(kernel_fn, kernel: str, head_dim_pad: int, elem_bytes: int, smem_limit: int,
              capability_major: int | None = None):  # fmt: skip
    """An autotuned wrapper of ``kernel_fn`` over its pruned space (built once per key)."""
    configs = configs_for(kernel, head_dim_pad, elem_bytes, smem_limit, capability_major)
    if not configs:  # never leave autotune empty: fall back to the smallest config
        smallest = min(SPACES[kernel], key=lambda c: c[0] * c[1])
        cfg = _as_dict(smallest)
        configs = [triton.Config({"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"]},
                                 num_warps=cfg["num_warps"], num_stages=1)]  # fmt: skip
    return triton.autotune(configs=configs, key=["HEAD_DIM_PAD", "CAUSAL", "SEQ_BUCKET"])(
        kernel_fn
    )


def seq_bucket(seqlen_q: int, seqlen_k: int) -> int:
    """Autotuning key for lengths: the next power of two of the longer side, capped at 16k."""
    return min(next_power_of_2(max(seqlen_q, seqlen_k)), 16384)
