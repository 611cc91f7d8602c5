"""Triton's installation key, remembered across processes.

Every kernel Triton compiles, or finds in its on-disk cache, is keyed by
``triton.runtime.cache.triton_key()``: Triton's version and SHA-256 digests of its compiler,
backend and language sources and of ``libtriton.so``. The library is ~400 MB in Triton 3.6,
so the first compile or cache lookup of every process spends ~0.3 s (an H200 host) to 0.8 s
(the 2-core CPU machine) hashing it: a third of a warm first attention call
(``benchmarks/results/2026-11-23_h200_first-call-profile_ead758f.txt``: 0.37 s of the warm
first forward's 0.76 s).

:func:`install` puts a wrapper in Triton's place that returns the string Triton's own function
returned in an earlier process, read from ``$DIYFA_CACHE_DIR/triton_key.json``, while the
Triton installation is unchanged: the file's entry is tied to the size, modification time and
inode of every file in the ``triton`` package (bytecode caches aside; ~350 files, a few ms
to list). On any change, a missing or unreadable file, or an error, Triton's function runs
and its result is saved. The value handed to Triton is always one Triton computed, so the
compiled kernels' cache keys are exactly Triton's. ``DIYFA_TRITON_KEY_CACHE=0`` turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

_ENV = "DIYFA_TRITON_KEY_CACHE"


def _cache_path() -> str:
    from diyfa.tuning import cache_file

    return str(cache_file().with_name("triton_key.json"))


def installation_fingerprint(root: str) -> str:
    """A digest of the path, size, mtime and inode of every file under ``root`` (the triton
    package), ``__pycache__`` folders aside: any reinstall or edit changes it."""
    h = hashlib.sha256()
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d != "__pycache__")
        for name in sorted(files):
            path = os.path.join(folder, name)
            st = os.stat(path)
            h.update(f"{os.path.relpath(path, root)}\0{st.st_size}\0{st.st_mtime_ns}"
                     f"\0{st.st_ino}\n".encode())  # fmt: skip
    return h.hexdigest()


def remembered(compute, root: str, path: str) -> str:
    """``compute()``'s result, from ``path`` when it was saved there for the same
    installation fingerprint of ``root``, else computed and saved (best effort: an
    unwritable cache only costs the next process the computation)."""
    fingerprint = installation_fingerprint(root)
    try:
        with open(path) as f:
            entry = json.load(f)
        if entry.get("fingerprint") == fingerprint and isinstance(entry.get("key"), str):
            return entry["key"]
    except (OSError, ValueError, AttributeError):
        pass
    key = compute()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"fingerprint": fingerprint, "root": root, "key": key}, f)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or this one
    except OSError:
        pass
    return key


def install() -> bool:
    """Put the remembering wrapper in place of ``triton_key`` in the Triton modules that call
    it (once per process); returns whether it is in place."""
    import triton
    import triton.runtime.autotuner as autotuner
    import triton.runtime.cache as cache

    if os.environ.get(_ENV, "1") == "0":
        return False
    if getattr(cache.triton_key, "_diyfa", False):
        return True
    original = cache.triton_key
    root = os.path.dirname(os.path.abspath(triton.__file__))

    @functools.cache
    def triton_key() -> str:
        try:
            return remembered(original, root, _cache_path())
        except Exception:  # noqa: BLE001 - never worse than Triton's own function
            return original()

    triton_key._diyfa = True  # type: ignore[attr-defined]
    triton_key.original = original  # type: ignore[attr-defined]
    cache.triton_key = triton_key
    if getattr(autotuner, "triton_key", None) is original:
        autotuner.triton_key = triton_key
    return True
