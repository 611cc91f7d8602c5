import json

import torch

import diyfa
from diyfa import cli
from diyfa.device import datasheet_peaks, device_info


def test_importing_diyfa_loads_no_kernels():
    import subprocess
    import sys

    code = ("import sys, diyfa; diyfa.attention_flops; "
            "print(any(m.startswith(('diyfa.ops', 'diyfa.attention')) for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_device_info_is_well_formed_everywhere():
    info = device_info()
    d = info.as_dict()
    for key in ("name", "compute_capability", "sm_count", "shared_memory_per_block",
                "shared_memory_per_sm", "registers_per_sm", "l2_cache_bytes", "tma_available",
                "wgmma_available", "warp_specialization_available", "fp8_available",
                "bf16_available", "datasheet"):
        assert key in d
    if not torch.cuda.is_available():
        assert info.available is False and "no CUDA GPU" in info.reason
        assert info.tma_available is False
    else:
        assert info.sm_count > 0 and info.compute_capability[0] >= 7


def test_check_hopper_features_keys():
    f = diyfa.check_hopper_features()
    assert {"is_hopper", "tma_available", "wgmma_available", "fp8_available"} <= set(f)
    if not torch.cuda.is_available():
        assert f["tma_available"] is False and f["is_hopper"] is False


def test_measure_ceilings_without_gpu_says_so():
    if torch.cuda.is_available():
        return
    out = diyfa.measure_ceilings()
    assert out["available"] is False and "no CUDA GPU" in out["reason"]


def test_datasheet_lookup():
    assert datasheet_peaks("NVIDIA H100 80GB HBM3")["bf16"] == 989
    assert datasheet_peaks("NVIDIA H100 PCIe")["bf16"] == 756
    assert datasheet_peaks("NVIDIA H200")["tbps"] == 4.8
    assert datasheet_peaks("NVIDIA A100-SXM4-80GB")["fp16"] == 312
    assert datasheet_peaks("NVIDIA GeForce RTX 4090")["fp8"] == 330
    assert datasheet_peaks("Some Unknown GPU") is None


def test_cli_info_json(capsys):
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "device" in data and "hopper_features" in data


def test_cli_flops_seed_002(capsys):
    args = ["flops", "attention", "--heads", "16", "--seqlen-q", "4096", "--seqlen-k", "15360",
            "--head-dim", "64"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "3.75" in out


def test_cli_bad_input_is_a_clear_error(capsys):
    assert cli.main(["flops", "attention", "--seqlen-q", "-5"]) == 2
    assert "seqlen_q must be >= 1, got -5" in capsys.readouterr().err
