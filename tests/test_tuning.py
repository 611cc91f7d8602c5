"""The tuned table: written by `diyfa tune`, read by the kernels' launchers (CPU)."""

import pytest

from diyfa import tuning
from diyfa.bench import blocksize
from diyfa.ops import matmul


@pytest.fixture
def tuned_file(tmp_path, monkeypatch):
    """A tuned table at $DIYFA_TUNED_TABLE, read as if on a GPU (no interpreter)."""
    path = tmp_path / "tuned.json"
    monkeypatch.setenv("DIYFA_TUNED_TABLE", str(path))
    monkeypatch.setattr(tuning, "TUNED_TABLE", tmp_path / "packaged-absent.json")
    monkeypatch.setattr(tuning, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(matmul, "interpreter_enabled", lambda: False)
    tuning.tuned_table.cache_clear()
    yield path
    tuning.tuned_table.cache_clear()


def test_write_table_merges_entries(tmp_path):
    path = tmp_path / "t.json"
    tuning.write_table({9: {"attn_fwd": {64: (128, 64, 8, 3)}}}, path)
    tuning.write_table({9: {"attn_fwd": {128: (64, 64, 4, 2)}, "attn_bwd_dq": {64: (64, 32, 4, 2)}},
                        8: {"attn_fwd": {64: (64, 64, 4, 2)}}}, path)  # fmt: skip
    tuning.write_table({9: {"attn_fwd": {64: (128, 128, 8, 2)}}}, path)  # replaces one entry
    assert tuning.load_table(path) == {
        9: {"attn_fwd": {64: (128, 128, 8, 2), 128: (64, 64, 4, 2)},
            "attn_bwd_dq": {64: (64, 32, 4, 2)}},
        8: {"attn_fwd": {64: (64, 64, 4, 2)}},
    }  # fmt: skip


def test_attention_default_and_space_follow_the_tuned_table(tuned_file):
    hand_set = tuning.default_config("attn_fwd", 64, 9)
    assert hand_set == tuning._as_dict(tuning.DEFAULTS[9]["attn_fwd"][64])
    tuning.write_table({9: {"attn_fwd": {64: (64, 128, 4, 4)}}}, tuned_file)
    assert tuning.default_config("attn_fwd", 64, 9) == dict(BLOCK_M=64, BLOCK_N=128,
                                                            num_warps=4, num_stages=4)  # fmt: skip
    assert tuning.default_config("attn_fwd", 32, 9)["BLOCK_N"] == 128  # the same bucket (<= 64)
    assert tuning.default_config("attn_fwd", 128, 9) == tuning._as_dict(
        tuning.DEFAULTS[9]["attn_fwd"][128])  # no tuned entry for d128
    assert tuning.default_config("attn_fwd", 64, 8) == tuning._as_dict(
        tuning.DEFAULTS[8]["attn_fwd"][64])  # nor for Ampere
    first = tuning.configs_for("attn_fwd", 64, 2, 232448, 9)[0]
    assert (first.kwargs, first.num_warps, first.num_stages) == (
        {"BLOCK_M": 64, "BLOCK_N": 128}, 4, 4)
    with tuning.pinned("attn_fwd", BLOCK_M=32, BLOCK_N=32):  # a pin still wins
        assert tuning.default_config("attn_fwd", 64, 9)["BLOCK_M"] == 32


def test_matmul_default_follows_the_tuned_table(tuned_file):
    results = [blocksize.Result("matmul", dict(BLOCK_M=128, BLOCK_N=n, BLOCK_K=64, num_warps=8,
                                               num_stages=s), tflops=t)
               for n, s, t in ((256, 3, 600.0), (128, 4, 650.0))]  # fmt: skip
    table = blocksize.winners_table({"matmul": results}, 9, 64)
    assert table == {9: {"matmul_tma": {0: (128, 128, 64, 8, 8, 4, False)}}}
    tuning.write_table(table, tuned_file)
    cfg = matmul.default_config("tma", 2, 2, 9, 232448)
    assert (cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K, cfg.num_warps, cfg.num_stages) == (
        128, 128, 64, 8, 4)
    assert matmul.configs_for("tma", 2, 2, 232448, 9)[0] == cfg
    portable = matmul.default_config("portable", 2, 2, 9, 232448)  # untouched
    assert portable == matmul.make_config(matmul.DEFAULTS["portable"][9], 2)


def test_winners_are_keyed_by_the_bucket_the_kernels_look_up(tuned_file):
    res = [blocksize.Result("attn_fwd", dict(BLOCK_M=64, BLOCK_N=32, num_warps=4,
                                             num_stages=2), tflops=1.0)]  # fmt: skip
    table = blocksize.winners_table({"attn_fwd": res}, 9, 96)  # d 96 pads to 128
    assert table == {9: {"attn_fwd": {128: (64, 32, 4, 2)}}}
    tuning.write_table(table, tuned_file)
    assert tuning.default_config("attn_fwd", 128, 9)["BLOCK_N"] == 32
    assert [tuning.head_dim_bucket(d) for d in (1, 40, 64, 80, 96, 128, 160, 256)] == [
        64, 64, 64, 128, 128, 128, 256, 256]
    mm = [blocksize.Result("matmul", dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8,
                                          num_stages=3), tflops=1.0)]  # fmt: skip
    assert list(blocksize.winners_table({"matmul": mm}, 10, 64)[10]) == ["matmul_portable"]


def test_autotuning_is_opt_in(monkeypatch):
    """Off unless DIYFA_AUTOTUNE=1 (a first call compiles one config, not every one); never
    under the interpreter."""
    monkeypatch.setattr(tuning, "interpreter_enabled", lambda: False)
    monkeypatch.delenv("DIYFA_AUTOTUNE", raising=False)
    assert not tuning.autotune_enabled()
    monkeypatch.setenv("DIYFA_AUTOTUNE", "0")
    assert not tuning.autotune_enabled()
    monkeypatch.setenv("DIYFA_AUTOTUNE", "1")
    assert tuning.autotune_enabled()
    monkeypatch.setattr(tuning, "interpreter_enabled", lambda: True)
    assert not tuning.autotune_enabled()


def test_autotune_winners_persist_across_processes(tmp_path, monkeypatch):
    """A winner saved by one process is found by the next (the in-memory copy dropped and
    the file read again); other keys, other Triton versions and a corrupt file give None."""
    import json

    monkeypatch.setenv("DIYFA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_disk", None)
    key = ("attn_fwd", True, 0, "torch.bfloat16", 128, True, 4096, False, False, False, "H200")
    assert tuning.cached_choice(key) is None
    tuning.remember_choice(key, {"BLOCK_M": 128, "BLOCK_N": 64}, 8, 3)
    monkeypatch.setattr(tuning, "_disk", None)  # a new process
    assert tuning.cached_choice(key) == ({"BLOCK_M": 128, "BLOCK_N": 64}, 8, 3)
    assert tuning.cached_choice(key[:-1] + ("H100",)) is None
    monkeypatch.setattr(tuning.triton, "__version__", "9.9.9")
    assert tuning.cached_choice(key) is None
    (tmp_path / "autotune.json").write_text("{not json")
    monkeypatch.setattr(tuning, "_disk", None)
    assert tuning.cached_choice(key) is None
    tuning.remember_choice(key, {"BLOCK_M": 64, "BLOCK_N": 64}, 4, 2)  # replaces it
    assert json.loads((tmp_path / "autotune.json").read_text())


def test_fp32_defaults_fit_and_skip_the_tuned_table(tuned_file):
    """fp32 inputs get tiles of their own (the 16-bit ones do not fit, and take minutes to
    compile): whatever the tuned table says, and within sm90's and sm80's shared memory by
    the estimate (which matched ptxas for these fp32 tiles to within 512 bytes)."""
    tuning.write_table({9: {"attn_fwd": {128: (128, 128, 8, 3)}}}, tuned_file)
    assert tuning.default_config("attn_fwd", 128, 9)["BLOCK_N"] == 128
    for kernel, per_dim in tuning.FP32_DEFAULTS.items():
        for dim, entry in per_dim.items():
            for major in (8, 9):
                cfg = tuning.default_config(kernel, dim, major, elem_bytes=4)
                assert cfg == tuning._as_dict(entry)
                assert tuning.attention_smem_bytes(kernel, cfg, dim, 4) <= 160 * 1024
    assert tuning.default_config("attn_fwd", 16, 9, 4) == tuning._as_dict(
        tuning.FP32_DEFAULTS["attn_fwd"][64])  # the <= 64 bucket


_COMPILE_FP32 = """
import torch
from diyfa import tuning
from diyfa.attention import portable as P

shared = {}
for kernel in ("attn_fwd", "attn_bwd_dq"):
    cfg = tuning.default_config(kernel, 256, 9, elem_bytes=4)
    k = P.compile_for_hopper(kernel, torch.float32, cfg["num_warps"], cfg["num_stages"],
                             HEAD_DIM=192, HEAD_DIM_PAD=256, HEAD_DIM_V=192,
                             HEAD_DIM_V_PAD=256, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"])
    shared[kernel] = k.metadata.shared
print(shared)
"""


def test_fp32_d256_defaults_compile_for_hopper():
    """The fp32 d256 forward and dQ defaults compile for sm90a within its 227 KB of shared
    memory (the 16-bit defaults did not: 279 KB for dQ, found only after a 31 s compile).
    In a fresh process (the interpreter leaves Triton's language module patched)."""
    import ast
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FP32], env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    shared = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert set(shared) == {"attn_fwd", "attn_bwd_dq"}
    assert all(0 < v <= 227 * 1024 for v in shared.values()), shared
