"""diyfa/_triton_key.py: Triton's installation key remembered across processes, always the
string Triton's own function computes, recomputed when the installation changes."""

import json
import os

import pytest


def test_installed_wrapper_returns_tritons_own_key(tmp_path, monkeypatch):
    import triton.runtime.cache as cache

    import diyfa._launcher  # noqa: F401  (installs the wrapper)

    assert getattr(cache.triton_key, "_diyfa", False)
    monkeypatch.setenv("DIYFA_CACHE_DIR", str(tmp_path))
    cache.triton_key.cache_clear()
    first = cache.triton_key()  # computed by Triton, saved
    assert first == cache.triton_key.original()
    saved = json.loads((tmp_path / "triton_key.json").read_text())
    assert saved["key"] == first
    cache.triton_key.cache_clear()
    assert cache.triton_key() == first  # read back


def _tree(tmp_path):
    root = tmp_path / "pkg"
    (root / "sub" / "__pycache__").mkdir(parents=True)
    (root / "a.py").write_text("x = 1\n")
    (root / "sub" / "lib.so").write_bytes(b"\0" * 100)
    return root


def test_remembered_reads_back_and_recomputes_on_change(tmp_path):
    from diyfa._triton_key import remembered

    root, path = _tree(tmp_path), str(tmp_path / "cache" / "key.json")
    calls = []

    def compute():
        calls.append(1)
        return f"key{len(calls)}"

    assert remembered(compute, str(root), path) == "key1"
    assert remembered(compute, str(root), path) == "key1" and len(calls) == 1
    (root / "sub" / "__pycache__" / "a.cpython.pyc").write_bytes(b"junk")  # not a change
    assert remembered(compute, str(root), path) == "key1" and len(calls) == 1
    (root / "sub" / "lib.so").write_bytes(b"\0" * 101)  # a reinstall: size changes
    assert remembered(compute, str(root), path) == "key2"
    (root / "new.py").write_text("")  # a file added
    assert remembered(compute, str(root), path) == "key3"
    assert remembered(compute, str(root), path) == "key3" and len(calls) == 3


@pytest.mark.parametrize("content", ["not json", '{"fingerprint": 3}', "[1, 2]", '{"key": 5}'])
def test_remembered_recomputes_over_a_bad_file(tmp_path, content):
    from diyfa._triton_key import installation_fingerprint, remembered

    root, path = _tree(tmp_path), tmp_path / "key.json"
    path.write_text(content.replace("3", json.dumps(installation_fingerprint(str(root)))))
    assert remembered(lambda: "fresh", str(root), str(path)) == "fresh"
    assert json.loads(path.read_text())["key"] == "fresh"


def test_remembered_survives_an_unwritable_cache(tmp_path):
    from diyfa._triton_key import remembered

    root = _tree(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the cache folder should be
    path = str(blocker / "sub" / "key.json")
    assert remembered(lambda: "k", str(root), path) == "k"
    assert not os.path.exists(path)


def test_switched_off_by_environment(monkeypatch):
    from diyfa import _triton_key

    monkeypatch.setenv("DIYFA_TRITON_KEY_CACHE", "0")
    assert _triton_key.install() is False
