"""The benchmark toolkit on the CPU: registry, suites, harness (Triton interpreter), results
files, the block-size arithmetic, the ncu parser and the CLI. No GPU needed, nothing slow."""

from __future__ import annotations

import json

import pytest
import torch

from diyfa import tuning
from diyfa.bench import blocksize, harness, profile, providers, results, suites
from diyfa.bench.suites import AttentionCase, MatmulCase

TINY = AttentionCase(1, 2, 48, 80, 32, True, "fp16")
FAST = harness.Options(cpu_reps=1)


@pytest.fixture
def scratch_provider():
    """Register throwaway providers; remove them afterwards."""
    added = []

    def add(name, fn, **kwargs):
        providers.register("attention", name, **kwargs)(fn)
        added.append(("attention", name))

    yield add
    for key in added:
        providers.REGISTRY.pop(key, None)


def _harness():
    return harness.Harness(FAST, run_id="test")


# ------------------------------------------------------------------------------- registry
def test_registry_has_every_required_provider():
    assert set(providers.names("attention")) >= {
        "diyfa", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "flash-attn-2",
        "fa4-cute"}  # fmt: skip
    assert set(providers.names("matmul")) >= {"diyfa", "cublas", "cublas-fp8"}
    assert providers.get("attention", "flash-attn-2").layout == "bshd"
    assert providers.get("attention", "fa4-cute").layout == "bshd"
    with pytest.raises(ValueError, match="unknown attention provider 'nope'"):
        providers.get("attention", "nope")


def test_absent_optional_provider_says_so(scratch_provider):
    scratch_provider("needs-missing", lambda case, q, k, v: q, requires=("no_such_module_zz",))
    rec = _harness().measure("t", TINY, "needs-missing", "fwd")
    assert rec["status"] == "unavailable"
    assert "no_such_module_zz" in rec["reason"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_gpu_only_providers_record_why_on_cpu():
    h = _harness()
    fa2 = h.measure("t", TINY, "flash-attn-2", "fwd")
    assert fa2["status"] in ("unavailable", "unsupported") and fa2["reason"]
    fp8 = h.measure("t", MatmulCase(32, 32, 32, "bf16"), "cublas-fp8", "fwd")
    assert fp8["status"] == "unsupported" and "fp8" in fp8["reason"]


def test_a_failing_provider_becomes_a_record_and_the_run_goes_on(scratch_provider):
    def boom(case, q, k, v):
        raise RuntimeError("deliberate failure")

    scratch_provider("boom", boom)
    plan = suites.Plan("t", "flash", (TINY,), ("fwd",), ("boom", "sdpa-math"))
    recs = harness.run([plan], _harness())
    assert [r["status"] for r in recs] == ["error", "ok"]
    assert "deliberate failure" in recs[0]["reason"]


def test_classify_oom_and_unsupported():
    assert harness._classify(torch.OutOfMemoryError("CUDA out of memory."), [])[0] == "oom"
    assert harness._classify(RuntimeError("No available kernel. Aborting"), [])[0] == "unsupported"
    assert harness._classify(ValueError("bad"), [])[0] == "error"


# ---------------------------------------------------------------------------------- suites
def test_suites_shapes():
    fa = suites.plans("flash", ["fa-sweep"])[0]
    assert {c.dtype for c in fa.cases} == {"bf16"}
    assert all(c.batch * c.seqlen_q == 16384 and c.heads * c.head_dim == 2048 for c in fa.cases)
    assert {c.head_dim for c in fa.cases} == {64, 128, 256}
    assert {c.causal for c in fa.cases} == {False, True}
    assert fa.modes == ("fwd", "bwd", "fwd_bwd")
    quick = suites.plans("flash", ["fa-sweep"], quick=True)[0]
    assert len(quick.cases) < len(fa.cases)
    seed = suites.plans("flash", ["seed"])[0]
    assert [(c.batch, c.heads, c.head_dim, c.dtype, c.seqlen_q) for c in seed.cases] == [
        (4, 8, 64, "fp16", s) for s in (512, 1024, 2048, 4096)]  # fmt: skip
    cross = suites.plans("flash", ["cross"])[0]
    assert AttentionCase(1, 16, 4096, 15360, 64, False, "bf16") in cross.cases
    gqa = suites.plans("flash", ["gqa"])[0]
    assert all(c.heads == 32 and c.hk == 8 and c.head_dim == 128 for c in gqa.cases)
    mem = suites.plans("memory", ["memory"])[0]
    assert "sdpa-math" in mem.providers and "diyfa" in mem.providers
    llm = suites.plans("matmul", ["llm-matmul"])[0]
    assert any(c.dtype == "fp8_e4m3" for c in llm.cases)
    assert any((c.m, c.n, c.k) == (4096, 4096, 14336) for c in llm.cases)
    assert {p.target for p in suites.plans("all", ["seed"])} == {"flash", "matmul", "memory"}
    with pytest.raises(ValueError, match="unknown suite"):
        suites.plans("flash", ["nope"])


def test_case_flops_show_the_naive_count_for_seed_002():
    f = AttentionCase(1, 16, 4096, 15360, 64).flops("fwd")
    assert f["exact"] == f["published"] == 4 * 16 * 4096 * 15360 * 64
    assert f["exact"] / f["naive_sq2"] == pytest.approx(3.75)


def test_expand_filters_providers_and_modes():
    plans = suites.plans("flash", ["cross"], quick=True)
    jobs = harness.expand(plans, ["diyfa", "sdpa-flash"], ["fwd"])
    assert {j[2] for j in jobs} == {"diyfa", "sdpa-flash"} and {j[3] for j in jobs} == {"fwd"}
    with pytest.raises(ValueError, match="unknown providers"):
        harness.expand(plans, ["nope"])
    mm = harness.expand(suites.plans("matmul", ["seed"], quick=True), None, ["fwd", "bwd"])
    assert {j[3] for j in mm} == {"fwd"}


# --------------------------------------------------------------------------------- harness
@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd_bwd"])
def test_harness_measures_diyfa_in_the_interpreter(mode):
    rec = _harness().measure("t", TINY, "diyfa", mode)
    assert rec["status"] == "ok", rec["reason"]
    assert rec["median_ms"] > 0 and rec["p20_ms"] <= rec["median_ms"] <= rec["p80_ms"]
    err = rec["error"]
    assert err["status"] == "ok" and err["out_max_abs"] < 5e-3
    if mode != "fwd":
        assert err["grad_max_abs"] < 2e-2
    assert rec["flops"]["exact"] == TINY.flops(mode)["exact"]
    if not torch.cuda.is_available():
        assert "perf_counter" in rec["timer"] and "interpreter" in rec["timer"]
        assert rec["env"]["interpreter"] is True
        assert rec["tflops"] is None and rec["memory_note"]


def test_harness_gqa_and_layouts_agree():
    case = AttentionCase(1, 4, 40, 40, 16, False, "fp16", kv_heads=2)
    h = _harness()
    for prov in ("diyfa", "sdpa-math"):
        rec = h.measure("t", case, prov, "bwd")
        assert rec["status"] == "ok", rec["reason"]
        assert rec["error"]["scope"] == "batch 0, q heads 0..1, kv head 0"
        assert rec["error"]["grad_max_abs"] < 2e-2


def test_reference_skipped_above_the_size_limit():
    h = harness.Harness(harness.Options(cpu_reps=1, ref_max_scores=100), run_id="t")
    rec = h.measure("t", TINY, "sdpa-math", "fwd")
    assert rec["status"] == "ok"
    assert rec["error"]["status"].startswith("skipped: too large")


def test_matmul_measurement():
    rec = _harness().measure("t", MatmulCase(40, 24, 56, "fp32", trans_b=True), "cublas", "fwd")
    assert rec["status"] == "ok" and rec["error"]["out_max_abs"] < 1e-4
    assert rec["flops"]["exact"] == 2 * 40 * 24 * 56


# --------------------------------------------------------------------------------- results
def test_results_roundtrip(tmp_path):
    env = results.environment()
    assert {"gpu", "driver", "torch", "triton", "commit", "timestamp"} <= set(env)
    header = results.run_header(env, suites=["smoke"])
    path = results.default_path(env, ["smoke", "cross"], tmp_path)
    assert path.name.startswith(env["timestamp"][:10]) and path.name.endswith("_smoke-cross.jsonl")
    plan = suites.plans("flash", ["smoke"])[0]
    with results.ResultsWriter(path, header) as w:
        recs = harness.run([plan], harness.Harness(FAST, env=env, run_id=header["run_id"]),
                           providers=["sdpa-math"], modes=["fwd"], writer=w)  # fmt: skip
    runs, loaded = results.load([path])
    assert len(runs) == 1 and runs[0]["run_id"] == header["run_id"]
    assert [r["label"] for r in loaded] == [r["label"] for r in recs]
    for r in loaded:
        for key in ("shape", "options", "provider", "dtype", "mode", "median_ms", "p20_ms",
                    "p80_ms", "flops", "tflops", "util_datasheet_pct", "util_ceiling_pct",
                    "bandwidth_tbps", "error", "peak_extra_mem_bytes", "status", "reason",
                    "env"):  # fmt: skip
            assert key in r
    assert results.latest_files(tmp_path) == [path]
    path.write_text(path.read_text() + "not json\n")
    with pytest.raises(ValueError, match="not JSON"):
        results.load(path)


def test_summary_rows_put_unavailable_providers_in_notes(scratch_provider):
    scratch_provider("absent", lambda case, q, k, v: q, requires=("no_such_module_zz",))
    recs = harness.run([suites.Plan("t", "flash", (TINY,), ("fwd",), ("absent", "sdpa-math"))],
                       _harness())  # fmt: skip
    cols, rows, notes = harness.summary_rows(recs)
    assert len(rows) == 1 and rows[0][3] == "sdpa-math" and len(rows[0]) == len(cols)
    assert notes and "absent: unavailable" in notes[0]


# ------------------------------------------------------------------------------ block size
def test_seed_shared_memory_arithmetic():
    s = blocksize.seed_arithmetic()
    assert s["tile_bytes"] == 3 * 128 * 64 * 2 == 49152  # 48 KiB, "~49 KB"
    assert round(s["tile_kb"]) == 49
    assert s["blocks_single_buffer"] == 4  # shared memory alone would allow 4 on Hopper
    assert s["blocks_kv_double_buffer"] == 2  # the seed's 2 with a 2-stage K/V pipeline
    assert s["blocks_8_warps_128_regs"] == 2
    assert "49,152" in blocksize.format_seed_arithmetic()


def test_occupancy_limiters():
    occ = blocksize.occupancy(smem_per_block=16 * 1024, regs_per_thread=255, num_warps=8)
    assert occ["limiter"] == "registers" and occ["blocks_per_sm"] == 1
    occ = blocksize.occupancy(smem_per_block=0, regs_per_thread=16, num_warps=4)
    assert occ["limiter"] == "threads" and occ["blocks_per_sm"] == 16
    assert blocksize.occupancy(smem_per_block=300_000, regs_per_thread=32,
                               num_warps=4)["limiter"] == "does not fit"  # fmt: skip


def test_sweep_space_and_winners_table(tmp_path):
    fwd = blocksize.space("attn_fwd")
    assert {c["num_warps"] for c in fwd} == {4, 8, 12}
    assert {c["num_stages"] for c in fwd} == {2, 3, 4}
    assert all("BLOCK_K" in c for c in blocksize.space("matmul", quick=True))
    res = [blocksize.Result("attn_fwd", dict(BLOCK_M=128, BLOCK_N=n, num_warps=8, num_stages=3),
                            tflops=t) for n, t in ((64, 300.0), (128, 350.0))]  # fmt: skip
    res.append(
        blocksize.Result(
            "attn_fwd",
            dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4),
            "does not fit",
            "smem",
        )
    )
    table = blocksize.winners_table({"attn_fwd": res}, 9, 64)
    assert table == {9: {"attn_fwd": {64: (128, 128, 8, 3)}}}
    path = tuning.write_table(table, tmp_path / "t.json")
    assert tuning.load_table(path) == table
    cols, rows = blocksize.table_rows(res)
    assert rows[0][7] == "350.0" and rows[-1][-1].startswith("does not fit")
    png = blocksize.heatmap(res, tmp_path / "h.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert blocksize.compiled_kernels(object()) == {}


# --------------------------------------------------------------------------------- profile
_NCU_HEAD = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
    '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
    '"Metric Value"'
)
_NCU_ROW = (
    '"0","123","python","host","_attn_fwd","1","7","(256, 1, 1)","(32, 64, 1)","0","9.0",'
    '"Command line profiler metrics",'
)
NCU_CSV = "\n".join(
    [
        "==PROF== Connected to process 123",
        _NCU_HEAD,
        _NCU_ROW + '"launch__registers_per_thread","register/thread","168"',
        _NCU_ROW
        + '"sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active","%","61.25"',
        _NCU_ROW + '"launch__shared_mem_per_block_dynamic","byte","98,304"',
        "==PROF== Disconnected from process 123",
    ]
)


def test_ncu_parsing_and_command():
    launches = profile.parse_ncu_csv(NCU_CSV)
    assert len(launches) == 1
    k = launches[0]
    assert k["kernel"] == "_attn_fwd" and k["launch__registers_per_thread"] == 168.0
    assert k["launch__shared_mem_per_block_dynamic"] == 98304.0
    cols, rows = profile.table(launches)
    assert rows[0][cols.index("tensor pipe %")] == "61.2"
    assert rows[0][cols.index("smem static B")] == "-"
    cmd = profile.ncu_command(profile.case_program(backward=True), "_attn_bwd")
    assert cmd[:3] == ["ncu", "--clock-control", "none"] and "regex:_attn_bwd" in cmd
    assert ",".join(profile.METRICS) in cmd
    compile(profile.case_program("matmul"), "<ncu case>", "exec")
    assert profile.parse_ncu_csv("no csv here") == []


# ------------------------------------------------------------------------------------- CLI
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_cli_bench_without_gpu_runs_the_smoke_suite(tmp_path, capsys):
    from diyfa.cli import main

    out = tmp_path / "r.jsonl"
    assert main(["bench", "memory", "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "No CUDA GPU" in text and "interpreter" in text
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["record"] == "run" and lines[0]["env"]["interpreter"] is True
    assert all(x["suite"] == "smoke" for x in lines[1:]) and len(lines) > 1


def test_cli_tune_without_gpu_prints_the_arithmetic_then_one_error_line(capsys):
    from diyfa.cli import main

    if not torch.cuda.is_available():
        assert main(["tune"]) == 1
        out, err = capsys.readouterr()
        assert "49,152" in out and "blocks/SM" in out
        assert err.startswith("diyfa: error: the block-size sweep needs a CUDA GPU")
        assert err.count("\n") == 1
    assert main(["bench", "flash", "--list"]) == 0
    assert "fa-sweep" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_block_size_example_main_runs(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "examples" / "block_size_experiment.py"
    spec = importlib.util.spec_from_file_location("block_size_experiment", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--quick"]) == 1  # the arithmetic, then: the sweep needs a GPU
    assert "4 blocks per SM" in capsys.readouterr().out


def test_matmul_pin_forces_one_config_and_restores():
    import os

    from diyfa.ops import matmul

    original = matmul.default_config
    cfg = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
    with blocksize._pin_matmul(matmul, cfg):
        assert os.environ["DIYFA_AUTOTUNE"] == "0"
        got = matmul.default_config("portable", 2, 2, 9, None)
        assert (got.BLOCK_M, got.BLOCK_N, got.BLOCK_K, got.num_warps) == (64, 32, 32, 4)
    assert matmul.default_config is original
    # the Gluon kernel (a JITFunction on the CPU too) has no swept config
    assert matmul._matmul_ws_kernel not in blocksize._matmul_kernels(matmul).fns
    if torch.cuda.is_available():  # interpreted kernels keep no compiled cache
        assert len(blocksize._matmul_kernels(matmul).fns) >= 1


def test_diyfa_matmul_provider_in_the_interpreter():
    rec = _harness().measure("t", MatmulCase(64, 48, 32, "fp16", trans_b=True), "diyfa", "fwd")
    assert rec["status"] == "ok", rec["reason"]
    assert rec["error"]["out_max_abs"] < 0.05


def test_results_writer_stores_nonfinite_as_null(tmp_path):
    path = tmp_path / "r.jsonl"
    with results.ResultsWriter(path, {"record": "run"}) as w:
        w.write({"record": "measurement", "tflops": float("nan"),
                 "error": {"out_max_abs": float("inf"), "ok": 1.5}})  # fmt: skip
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    rec = lines[1]
    assert rec["tflops"] is None and rec["error"]["out_max_abs"] is None
    assert rec["error"]["ok"] == 1.5
    assert rec["nonfinite"] == ["tflops=nan", "error.out_max_abs=inf"]


# --------------------------------------------------------------------------------- decode
def test_decode_suites_and_case_arithmetic():
    from diyfa.bench.suites import DecodeCase

    [plan] = suites.plans("flash", ["decode"])
    assert {c.page_size for c in plan.cases} == {None} and plan.modes == ("fwd",)
    assert any(c.batch == 16 and c.cache_len == 16384 and c.kv_heads == 8 for c in plan.cases)
    assert {c.seqlen_q for c in plan.cases} == {1, 2, 4, 8}
    [paged] = suites.plans("flash", ["paged-decode"])
    assert {c.page_size for c in paged.cases} == {16, 256}
    case = DecodeCase(16, 32, 8, 1, 16384, 128)
    # the cache read once (K and V, 8 kv heads) plus q and out, bf16
    assert case.min_bytes("fwd") == (2 * 16 * 16384 * 8 * 128 + 2 * 16 * 32 * 128) * 2
    assert case.flops("fwd")["exact"] == 4 * 16 * 32 * 1 * 16384 * 128
    assert case.label() == "b16 h32/8 sq1 cache16384 d128 bf16"
    assert providers.names("decode") == ["diyfa", "diyfa-nosync", "fa4-cute", "sdpa-cudnn",
                                         "sdpa-flash", "sdpa-math"]


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged"])
def test_decode_measurement_on_the_interpreter(page_size):
    """A decode case through the harness: diyfa measured and checked against float64; SDPA
    providers say they read no paged cache."""
    from diyfa.bench.suites import DecodeCase, Plan

    case = DecodeCase(2, 4, 2, 3, 70, 32, page_size, "fp16")
    plan = Plan("decode", "flash", (case,), ("fwd",))
    recs = harness.run([plan], _harness(), providers=["diyfa", "diyfa-nosync", "sdpa-math"])
    by = {r["provider"]: r for r in recs}
    for name in ("diyfa", "diyfa-nosync"):
        assert by[name]["status"] == "ok", by[name]["reason"]
        err = by[name]["error"]
        assert err["status"] == "ok" and err["out_max_abs"] < 2e-3
    if page_size:
        assert by["sdpa-math"]["status"] == "unsupported"
        assert "no paged cache" in by["sdpa-math"]["reason"]
    else:
        assert by["sdpa-math"]["status"] == "ok"
        assert by["sdpa-math"]["error"]["out_max_abs"] < 2e-3


# --------------------------------------------------------------------------------- varlen
def test_varlen_suite_lengths_and_measurement_on_the_interpreter():
    from diyfa.bench.suites import Plan, VarlenCase, varlen_lengths

    lengths = varlen_lengths(65536, 128, 8192)
    assert sum(lengths) == 65536 and max(lengths) <= 8192 and lengths == varlen_lengths(
        65536, 128, 8192)  # reproducible
    [plan] = suites.plans("flash", ["varlen"])
    assert plan.modes == ("fwd", "bwd") and all(sum(c.lengths) == 65536 for c in plan.cases)
    case = VarlenCase((5, 17, 1), 4, 2, 32, True, "fp16")
    assert case.flops("fwd")["exact"] == 2 * 4 * (15 + 153 + 1) * 64  # causal pairs
    recs = harness.run([Plan("varlen", "flash", (case,), ("fwd", "bwd"))], _harness(),
                       providers=["diyfa", "sdpa-cudnn-padded"])  # fmt: skip
    by = {(r["provider"], r["mode"]): r for r in recs}
    for mode in ("fwd", "bwd"):
        rec = by[("diyfa", mode)]
        assert rec["status"] == "ok", rec["reason"]
        assert rec["error"]["status"] == "ok" and rec["error"]["out_max_abs"] < 2e-3
    assert by[("diyfa", "bwd")]["error"]["grad_max_abs"] < 5e-3
    if not torch.cuda.is_available():  # on a GPU, cuDNN runs it (the bench suite's concern)
        assert by[("sdpa-cudnn-padded", "fwd")]["status"] == "unsupported"


# ------------------------------------------------------------------------------ resilience
def test_oom_errors_and_missing_providers_become_rows_and_the_run_goes_on(scratch_provider):
    def oom(case, q, k, v):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\n"
                                     "GPU 0 has a total capacity of 139 GiB")  # fmt: skip

    def boom(case, q, k, v):
        raise RuntimeError("first line\n  second line")

    def bad_check(case):
        raise ValueError("the check itself failed")

    scratch_provider("t-oom", oom)
    scratch_provider("t-boom", boom)
    scratch_provider("t-absent", lambda case, q, k, v: q, requires=("no_such_module_zz",))
    scratch_provider("t-badcheck", lambda case, q, k, v: q, check=bad_check)
    names = ("t-oom", "t-boom", "t-absent", "t-badcheck", "t-never-registered", "sdpa-math")
    recs = harness.run([suites.Plan("t", "flash", (TINY,), ("fwd",), names)], _harness())
    by = {r["provider"]: r for r in recs}
    assert [r["status"] for r in recs] == ["oom", "error", "unavailable", "error",
                                           "unavailable", "ok"]  # fmt: skip
    assert by["t-oom"]["reason"] == ("OutOfMemoryError: CUDA out of memory. Tried to allocate "
                                     "2.00 GiB. GPU 0 has a total capacity of 139 GiB")
    assert by["t-boom"]["reason"] == "RuntimeError: first line second line"
    assert "no_such_module_zz" in by["t-absent"]["reason"]
    assert by["t-badcheck"]["reason"] == "ValueError: the check itself failed"
    assert "'t-never-registered' is registered" in by["t-never-registered"]["reason"]
    assert by["t-never-registered"]["baseline"] is False
    assert all("\n" not in r["reason"] for r in recs)
    assert harness._classify(MemoryError(), [])[0] == "oom"
    assert harness._classify(RuntimeError("DefaultCPUAllocator: can't allocate memory"),
                             [])[0] == "oom"  # fmt: skip


# -------------------------------------------------------------------------------- progress
class _Terminal:
    """A stream that says it is a terminal (rich draws a live bar on it)."""

    def __init__(self):
        import io

        self.buf = io.StringIO()

    def write(self, text):
        return self.buf.write(text)

    def flush(self):
        pass

    def isatty(self):
        return True

    def fileno(self):
        raise OSError("not a real terminal")

    def getvalue(self):
        return self.buf.getvalue()


def test_progress_bar_shows_count_item_and_eta():
    from rich.console import Console

    from diyfa.bench import progress

    stream = _Terminal()
    console = Console(file=stream, force_terminal=True, width=160)
    with progress.Bar(3, "measurements", console=console) as bar:
        for item in ("first case", "second case", "third case"):
            bar.show(item)
            bar.advance()
    text = stream.getvalue()
    assert "3/3" in text and "measurements" in text and "ETA" in text and "third case" in text
    with progress.Bar(3, "measurements", enabled=False) as bar:  # a no-op, same calls
        bar.show("x")
        bar.advance()


def test_progress_only_on_terminals(monkeypatch):
    import io
    import sys

    from diyfa.bench import progress

    monkeypatch.setattr(sys, "stdout", _Terminal())
    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert progress.wanted() and not progress.wanted(no_progress=True)
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # piped or redirected output
    assert not progress.wanted()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run")
def test_cli_bench_draws_its_bar_on_stderr_of_a_terminal(tmp_path, monkeypatch):
    import sys

    from diyfa.cli import main

    out, err = _Terminal(), _Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setenv("COLUMNS", "160")  # room for the whole label
    args = ["bench", "flash", "--providers", "sdpa-math", "--modes", "fwd", "--out",
            str(tmp_path / "r.jsonl")]  # fmt: skip
    assert main(args) == 0
    assert "2/2" in err.getvalue() and "smoke sdpa-math fwd" in err.getvalue()
    assert "2/2" not in out.getvalue()
    err.buf.truncate(0)
    assert main([*args, "--no-progress"]) == 0
    assert "measurements" not in err.getvalue()


# ------------------------------------------------------------------------ interrupt, resume
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run")
def test_cli_bench_interrupt_keeps_rows_and_resume_finishes_the_run(tmp_path, capsys,
                                                                    scratch_provider):  # fmt: skip
    from diyfa.cli import main
    from diyfa.report import render

    state = {"interrupt": True}

    def flaky(case, q, k, v):  # Ctrl-C while measuring the second (causal) smoke case
        if state["interrupt"] and case.causal:
            raise KeyboardInterrupt
        return providers._sdpa("MATH", case, q, k, v)

    scratch_provider("t-flaky", flaky)
    scratch_provider("t-extra", lambda case, q, k, v: providers._sdpa("MATH", case, q, k, v))
    path = tmp_path / "r.jsonl"
    plan = ["bench", "flash", "--providers", "sdpa-math,t-flaky", "--modes", "fwd"]
    assert main([*plan, "--out", str(path)]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "interrupted: 3 finished measurements" in err and "(1 left)" in err
    assert f"resume with: diyfa bench flash --providers sdpa-math,t-flaky --modes fwd " \
           f"--resume {path}" in err  # fmt: skip
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["record"] == "run" and len(lines) == 4
    run_id = lines[0]["run_id"]

    state["interrupt"] = False
    assert main([*plan, "--resume", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"1 measurements (smoke) -> {path} (resuming run {run_id}: 3 of this plan's 4" in out
    runs, recs = results.load(path)
    assert [r["run_id"] for r in runs] == [run_id, run_id] and runs[1]["resumed"] is True
    assert len(recs) == 4 and len({results.record_key(r) for r in recs}) == 4
    assert all(r["run_id"] == run_id and r["status"] == "ok" for r in recs)

    # another provider list: what is done is skipped, what is missing is measured
    assert main(["bench", "flash", "--providers", "sdpa-math,t-extra", "--modes", "fwd",
                 "--resume", str(path)]) == 0  # fmt: skip
    assert "2 measurements" in capsys.readouterr().out
    size = path.stat().st_size
    assert main([*plan, "--resume", str(path)]) == 0  # all done: nothing appended
    assert "0 measurements" in capsys.readouterr().out and path.stat().st_size == size

    report = render([path], tmp_path / "rep")
    md = report["markdown"].read_text()
    assert "(resumed 2x)" in md and md.count(f"| {run_id} |") == 1


def test_resume_refuses_another_environment_or_other_timing(tmp_path, capsys):
    from diyfa.cli import main

    env = results.environment()
    other = tmp_path / "other-gpu.jsonl"
    with results.ResultsWriter(other, results.run_header({**env, "gpu": "NVIDIA H100"},
                                                         suites=["smoke"])):  # fmt: skip
        pass
    size = other.stat().st_size
    assert main(["bench", "flash", "--resume", str(other)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"diyfa: error: cannot resume {other}: its run ")
    assert f"gpu 'NVIDIA H100' there, {env['gpu']!r} here" in err and "--out" in err
    assert err.count("\n") == 1 and other.stat().st_size == size

    slow = tmp_path / "slow.jsonl"
    with results.ResultsWriter(slow, results.run_header(env, suites=["smoke"],
                                                        options={"rep_ms": 100})):  # fmt: skip
        pass
    assert main(["bench", "flash", "--resume", str(slow)]) == 2
    err = capsys.readouterr().err
    assert "measured with rep_ms=100, this command with rep_ms=200" in err
    with pytest.raises(SystemExit):  # one file or the other, not both
        main(["bench", "flash", "--out", str(slow), "--resume", str(slow)])


# ------------------------------------------------------------------------------ CLI errors
@pytest.mark.parametrize("content", [
    None, "dir", b"\xff\xfe\x00binary", "", "not json\n", "[1, 2]\n",
    '{"op": "matmul", "M": 1024, "provider": "diyfa"}\n',
    '{"record": "measurement", "run_id": "x"}\n',
], ids=["missing", "directory", "binary", "empty", "not-json", "not-an-object",
        "foreign-json", "lacking-fields"])  # fmt: skip
def test_cli_report_refuses_a_bad_file_in_one_line(tmp_path, capsys, content):
    from diyfa.cli import main

    path = tmp_path / "bad.jsonl"
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    assert main(["report", str(path), "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("diyfa: error: ") and str(path) in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_results_load_names_a_bad_status(tmp_path):
    rec = results.measurement(run_id="r", env={}, suite="t", case=TINY, provider="p",
                              mode="fwd")  # fmt: skip
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({**rec, "status": "running"}) + "\n")
    with pytest.raises(ValueError, match=r"r.jsonl:1: status 'running'; accepted: ok, "):
        results.load(path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without a GPU")
@pytest.mark.parametrize("argv", [["profile"], ["info", "--measure"]])
def test_cli_commands_that_need_a_gpu_say_so_in_one_line(capsys, argv):
    from diyfa.cli import main

    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"diyfa: error: {' '.join(argv)} needs a CUDA GPU")
    assert err.count("\n") == 1


def test_cli_profile_without_ncu_says_so_in_one_line(capsys, monkeypatch):
    import shutil

    from diyfa.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert main(["profile", "--backward"]) == 1
    out, err = capsys.readouterr()
    assert "regex:_attn_bwd" in out  # the command, to run where ncu is
    assert err.startswith("diyfa: error: ncu (Nsight Compute) is not on PATH")
    assert err.count("\n") == 1


def test_variants_suite_runs_and_checks_each_option():
    """The variants suite's options reach diyfa and the float64 error check (window,
    softcap, ALiBi, sinks), windows count only their pairs, and SDPA reports it cannot run
    them."""
    from diyfa.bench.suites import AttentionCase, Plan

    [plan] = suites.plans("flash", ["variants"])
    assert [c.window for c in plan.cases].count((1023, 0)) == 1 and plan.modes == ("fwd", "bwd")
    plain = AttentionCase(1, 2, 48, 48, 32, True, "fp32")
    cases = (AttentionCase(1, 2, 48, 48, 32, True, "fp32", window=(15, 0)),
             AttentionCase(1, 2, 48, 48, 32, True, "fp32", softcap=5.0, alibi=True, sinks=True))
    recs = harness.run([Plan("variants", "flash", cases, ("fwd", "bwd"))], _harness(),
                       providers=["diyfa", "sdpa-math"])  # fmt: skip
    for r in recs:
        if r["provider"] == "diyfa":
            assert r["status"] == "ok" and r["error"]["status"] == "ok", r
            assert r["error"]["out_max_abs"] < 1e-5
        else:
            assert r["status"] == "unsupported" and "no window, softcap" in r["reason"]
    assert cases[0].flops("fwd")["exact"] < plain.flops("fwd")["exact"]
    assert cases[0].options()["window"] == [15, 0] and "window" not in plain.options()


def test_first_call_script_runs_two_fresh_processes(tmp_path, monkeypatch):
    """benchmarks/first_call.py's plumbing, on the interpreter: a cold and a warm fresh
    process each time a first forward + backward and leave one JSON line."""
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "first_call.py"
    spec = importlib.util.spec_from_file_location("first_call", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setenv("OUT", str(tmp_path))
    assert mod.main(["--dtype", "float32", "--head-dim", "16", "--causal"]) == 0
    recs = [json.loads(x) for x in (tmp_path / "first_call.jsonl").read_text().splitlines()]
    assert [r["caches"] for r in recs] == ["cold", "warm"]
    assert all(r["fwd_s"] > 0 and r["bwd_s"] > 0 and r["causal"] for r in recs)


def test_rounds_time_every_provider_again_in_turn_and_keep_the_median(monkeypatch):
    """Options.rounds: each provider of a case is timed once per round, the providers in
    turn (round 1: a, b; round 2: a, b; ...), and median_ms is the median of the rounds'
    medians; the records come out (and are written) without the timing closures."""
    calls = []
    times = iter([5.0, 7.0, 1.0, 9.0, 3.0, 2.0])  # a, b, a, b, a, b

    def fake_time(fn, options):
        calls.append(fn)
        return next(times), 0.0, 0.0, "fake"

    monkeypatch.setattr(harness, "time_fn", fake_time)
    monkeypatch.setattr(harness, "on_gpu", lambda: False)
    plan = suites.Plan("t", "flash", (TINY,), ("fwd",), ("diyfa", "sdpa-math"))
    written = []

    class Writer:
        def write(self, rec):
            written.append(json.dumps(rec))  # fails on a closure or a case object

    opts = harness.Options(cpu_reps=1, rounds=3, check_error=False, measure_memory=False)
    recs = harness.run([plan], harness.Harness(opts, run_id="r"), writer=Writer())
    assert [r["provider"] for r in recs] == ["diyfa", "sdpa-math"] and len(written) == 2
    assert len(calls) == 6 and calls[0] is calls[2] is calls[4] and calls[1] is calls[3]
    assert recs[0]["round_median_ms"] == [5.0, 1.0, 3.0] and recs[0]["median_ms"] == 3.0
    assert recs[1]["round_median_ms"] == [7.0, 9.0, 2.0] and recs[1]["median_ms"] == 7.0
    assert all("_fn" not in r and "_case" not in r for r in recs)


def test_cli_refuses_zero_rounds(capsys):
    from diyfa import cli

    with pytest.raises(SystemExit):
        cli.main(["bench", "flash", "--rounds", "0"])
    assert "must be at least 1, got 0" in capsys.readouterr().err


def test_variant_tensors_are_built_once_per_case_and_device():
    """The providers call kernel_options inside the timed function: the ALiBi slopes and the
    sinks must not be rebuilt (and copied to the device) on every call."""
    case = AttentionCase(1, 4, 64, 64, 32, True, "fp16", alibi=True, sinks=True)
    a, b = case.kernel_options("cpu"), case.kernel_options("cpu")
    assert a["alibi_slopes"] is b["alibi_slopes"] and a["sinks"] is b["sinks"]
    assert torch.equal(a["alibi_slopes"], torch.exp2(-8.0 * torch.arange(1, 5) / 4))
    a["softcap"] = 1.0  # a caller's edits stay its own
    assert "softcap" not in case.kernel_options("cpu")


def test_varlen_equal_suite_matches_the_varlen_mix():
    """varlen-equal: per varlen case, an equal-length batch with the same tokens, heads,
    head dim and causality, and within 1% of its FLOPs (the yardstick of issue 13's
    varlen >= 0.95x target)."""
    equal = suites.SUITES["varlen-equal"]("flash", False)
    mix = suites.SUITES["varlen"]("flash", False)
    assert equal.providers == ("diyfa",) and len(equal.cases) == len(mix.cases)
    for e, m in zip(equal.cases, mix.cases, strict=True):
        assert e.batch * e.seqlen_q == sum(m.lengths)
        assert (e.heads, e.hk, e.head_dim, e.causal) == (m.heads, m.kv_heads, m.head_dim,
                                                         m.causal)  # fmt: skip
        fe, fm = e.flops("fwd")["exact"], m.flops("fwd")["exact"]
        assert abs(fe - fm) <= 0.01 * fm, (e.label(), fe, fm)


def test_sass_loops_lists_each_backward_branch_loop_with_its_opcodes():
    """benchmarks/sass_loops.py's reading of cuobjdump's SASS: a loop is a branch back to an
    earlier address (forward branches are not), its body every instruction from the target to
    the branch, opcodes counted without predicates and modifiers, uniform ones apart."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "sass_loops.py"
    spec = importlib.util.spec_from_file_location("sass_loops", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sass = "\n".join(f"        /*{a:04x}*/  {ins} ;  /* 0x0 */" for a, ins in [
        (0x00, "           MOV R1, c[0x0][0x28]"),
        (0x10, "           HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT"),
        (0x20, "           PRMT R2, R2, 0x5432, R2"),
        (0x30, "      @!P4 BRA 0x10"),
        (0x40, "           UIADD3 UR4, UR4, 0x1, URZ"),
        (0x50, "           BAR.SYNC.DEFER_BLOCKING 0x2, 0x80"),
        (0x60, "       @P0 BRA 0x0"),
        (0x70, "           BRA 0x80"),
    ])  # fmt: skip
    found = mod.loops(sass, 1, 100)
    assert [(r["start"], r["end"], r["n"]) for r in found] == [(0x0, 0x60, 7), (0x10, 0x30, 3)]
    outer, inner = found
    assert (inner["HGMMA"], inner["PRMT"], inner["BAR"], inner["uniform"]) == (1, 1, 0, 0)
    assert (outer["HGMMA"], outer["BAR"], outer["uniform"]) == (1, 1, 1)
    assert mod.loops(sass, 4, 100) == [outer]  # the inner one is shorter than 4


def test_source_digest_names_the_code_that_ran():
    """env.source: a digest of the package's files that a commit reproduces
    (benchmarks/source_digest.py) where the GPU machine's "commit" cannot; it changes with
    any file's content or name."""
    import importlib.util
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    here = results.environment()["source"]
    assert here is not None and len(here) == 12
    assert results.source_digest({"a.py": b"x"}) != results.source_digest({"a.py": b"y"})
    assert results.source_digest({"a.py": b"x"}) != results.source_digest({"b.py": b"x"})
    clean = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "src/diyfa"],
                           capture_output=True, text=True)  # fmt: skip
    if clean.returncode != 0 or clean.stdout.strip():
        pytest.skip("not a clean git checkout of src/diyfa")
    spec = importlib.util.spec_from_file_location("source_digest",
                                                  root / "benchmarks/source_digest.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert results.source_digest(tool.files_at("HEAD")) == here


def test_host_us_per_call_counts_each_call():
    """harness.host_us_per_call: the warm-up and timed calls both run, the result is a
    per-call time in microseconds (the benchmarks' host-path probes use it)."""
    from diyfa.bench.harness import host_us_per_call

    calls = []
    us = host_us_per_call(lambda: calls.append(1), calls=50, warmup=5)
    assert len(calls) == 55 and 0.0 < us < 1e4


def test_ncu_stall_diff_lines_up_two_reports_by_offset(tmp_path):
    """benchmarks/ncu_stall_diff.py: two ncu source pages of one build at different load
    addresses line up by offset (branch targets too), shares are of each run's samples, the
    largest increase comes first, opcodes count without predicates; two builds are refused."""
    import gzip
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "ncu_stall_diff.py"
    spec = importlib.util.spec_from_file_location("ncu_stall_diff", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def page(name, base, samples, gz=False):
        ins = ["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24", f"@!P0  BRA {hex(base + 0x30)}",
               "MUFU.EX2 R1, R2", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x30850], R16"]
        lines = ['"Kernel Name","_attn_fwd_hopper"',
                 '"Address","Source","Warp Stall Sampling (All Samples)","# Samples"']
        lines += [f'"{hex(base + 16 * i)}","{s}","{n:,}","1"' for i, (s, n) in
                  enumerate(zip(ins, samples, strict=True))]  # fmt: skip
        p = tmp_path / name
        text = "\n".join(lines) + "\n"
        if gz:
            p.write_bytes(gzip.compress(text.encode()))
        else:
            p.write_text(text)
        return str(p)

    a = mod.read(page("a.csv.gz", 0x7FF4197A0000, [1000, 3000, 4000, 2000], gz=True))
    b = mod.read(page("b.csv", 0x7F889F7A0000, [2000, 2000, 4000, 2000]))
    assert a[1][1] == "@!P0  BRA 0x30" == b[1][1] and [x[0] for x in a] == [0, 16, 32, 48]
    assert abs(sum(x[2] for x in a) - 1.0) < 1e-9 and abs(a[1][2] - 0.3) < 1e-9
    lines = mod.compare(a, b, top=2)
    assert lines[1].startswith("+10.00 0x00010 30.00 20.00 @!P0  BRA")
    assert lines[2].startswith("+0.00")
    assert "MUFU.EX2 40.0%" in lines[-1] and "BRA 30.0%" in lines[-1]
    other = mod.read(page("c.csv", 0x7F0000000000, [1, 1, 1, 1]))
    other[2] = (32, "MUFU.RCP R1, R2", other[2][2])
    with pytest.raises(ValueError, match="different code"):
        mod.compare(a, other)
