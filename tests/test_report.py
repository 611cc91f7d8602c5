"""Reports render from results files only: the committed fixture (hand-made, marked
``"fixture": true``) and a tiny interpreter run."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest

from diyfa.bench import harness, results, suites
from diyfa.report import builder, render

FIXTURE = Path(__file__).parent / "fixtures" / "results_fixture.jsonl"


def test_fixture_is_marked_and_has_a_cross_case():
    runs, records = results.load(FIXTURE)
    assert runs and all(r.get("fixture") for r in runs)
    assert records and all(r.get("fixture") is True for r in records)
    assert any(r["shape"]["seqlen_q"] != r["shape"]["seqlen_k"] for r in records
               if r["op"] == "attention")  # fmt: skip
    assert {r["status"] for r in records} >= {"ok", "unavailable", "oom", "unsupported", "error"}


def test_report_from_fixture(tmp_path):
    out = render([FIXTURE], tmp_path)
    md = out["markdown"].read_text()
    page = out["html"].read_text()
    assert "FIXTURE DATA" in md and "FIXTURE DATA" in page
    for title in ("Attention: TFLOPS", "Speed-up of diyfa", "naive FLOPs count",
                  "Peak extra memory", "Matmul: TFLOPS", "Not measured, and why"):  # fmt: skip
        assert title in md, title
    assert page.count("<table>") == len(out["tables"]) >= 7
    images = re.findall(r'<img alt=\'[^\']*\' src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == len(out["figures"]) >= 5
    assert all(base64.b64decode(i)[:8] == b"\x89PNG\r\n\x1a\n" for i in images)
    for name in out["figures"]:
        assert (tmp_path / "plots" / f"{name}.png").exists()
        assert f"plots/{name}.png" in md
    assert "http" not in page.split("<body>")[1].split("data:image")[0]  # nothing fetched


def test_naive_flops_flagged_with_both_numbers():
    _, records = results.load(FIXTURE)
    table = builder.naive_flops_table(records)
    rows = [r for r in table.rows if r[1] == "b1 h16 sq4096 sk15360 d64 bf16" and r[3] == "diyfa"]
    assert len(rows) == 1
    exact, naive = float(rows[0][4]), float(rows[0][6])
    assert exact / naive == pytest.approx(3.75, rel=1e-3)
    tf_exact, tf_naive = float(rows[0][8]), float(rows[0][10])
    assert tf_exact / tf_naive == pytest.approx(3.75, rel=1e-2)
    # equal-length non-causal cases are not flagged
    assert not any("sq1024 sk1024" in r[1] and "causal" not in r[1] for r in table.rows)


def test_speedup_is_baseline_over_diyfa_within_one_run():
    _, records = results.load(FIXTURE)
    table = builder.speedup_table(records)
    col = table.columns.index("sdpa-flash")
    row = next(r for r in table.rows if r[1] == "b4 h8 sq1024 sk1024 d64 fp16" and r[0] == "seed")
    assert row[col] == f"{262.0 / 231.0:.2f}x"
    other_run = [dict(r, run_id="other") for r in records if r["provider"] != "diyfa"]
    mixed = [r for r in records if r["provider"] == "diyfa"] + other_run
    assert builder.speedup_table(mixed) is None


def test_report_from_an_interpreter_run(tmp_path):
    env = results.environment()
    header = results.run_header(env, suites=["smoke"])
    path = tmp_path / "run.jsonl"
    plan = suites.Plan("smoke", "flash", (suites.AttentionCase(1, 2, 32, 32, 16, dtype="fp16"),),
                       ("fwd",), ("diyfa", "sdpa-math"))  # fmt: skip
    with results.ResultsWriter(path, header) as w:
        harness.run([plan], harness.Harness(harness.Options(cpu_reps=1), env=env,
                                            run_id=header["run_id"]), writer=w)  # fmt: skip
    out = render([path], tmp_path / "rep")
    md = out["markdown"].read_text()
    if env["interpreter"]:
        assert "Interpreter run" in md and " ms |" in md


def test_cli_report(tmp_path, capsys):
    from diyfa.cli import main

    assert main(["report", str(FIXTURE), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "report.html").exists()
    assert main(["report", "--results-dir", str(tmp_path / "empty")]) == 2


def test_headline_opens_the_report_with_the_fixture_ratios(tmp_path):
    out = render([FIXTURE], tmp_path)
    md, page = out["markdown"].read_text(), out["html"].read_text()
    runs, records = results.load(FIXTURE)
    lines, tables = builder.headline(records, runs)
    assert lines == ["NVIDIA H200 (fixture): torch 2.11.0+cu130, triton 3.6.0, commit fixture "
                     "(run fixture0001, 2026-11-21T00:00:00+00:00)"]  # fmt: skip
    [main] = tables  # no diyfa-* variant in the fixture
    rows = {(r[0], r[1], r[2], r[3]): r for r in main.rows}
    c = main.columns.index
    flash = rows[("seed", "attention", "fwd", "sdpa-flash")]
    ratios = (262.0 / 231.0, 331.0 / 276.0)  # the two seed cases, diyfa / sdpa-flash TFLOPS
    assert flash[c("cases")] == "2" and flash[c("by")] == "TFLOPS"
    assert flash[c("geomean")] == f"{(ratios[0] * ratios[1]) ** 0.5:.2f}x"
    assert flash[c("worst")] == f"{ratios[0]:.2f}x"
    assert flash[c("worst case")] == "b4 h8 sq1024 sk1024 d64 fp16"
    assert flash[c("best case")] == "b4 h8 sq2048 sk2048 d64 fp16"
    assert rows[("seed", "matmul", "fwd", "cublas")][c("geomean")] == \
        f"{(560 / 631 * 612 / 706) ** 0.5:.2f}x"  # fmt: skip
    # unavailable (flash-attn-2), failed (llm-matmul) and non-baseline (sdpa-math) pair nothing
    assert not any(k[3] in ("flash-attn-2", "sdpa-math") or k[0] == "llm-matmul" for k in rows)
    for text in (md, page):
        first = text.index("against each baseline")
        assert text.index("NVIDIA H200 (fixture): torch 2.11.0+cu130") < first
        assert first < text.index("Runs") < text.index("Attention: TFLOPS")
        assert first < text.index("plots/" if text is md else "data:image")
    assert md.index("## Headline") < md.index("### diyfa against each baseline")


def _rec(run_id, case, provider, suite="s", mode="fwd", status="ok", tflops=None, gbps=None,
         ms=1.0, baseline=None):  # fmt: skip
    rec = results.measurement(run_id=run_id, env={}, suite=suite, case=case, provider=provider,
                              mode=mode, status=status,
                              baseline=provider.startswith("sdpa-flash") if baseline is None
                              else baseline)  # fmt: skip
    rec.update(tflops=tflops, bandwidth_tbps=gbps, median_ms=ms if status == "ok" else None)
    return rec


def _run(run_id, gpu, when):
    return {"record": "run", "run_id": run_id, "env": {"gpu": gpu, "torch": "2.x",
            "triton": "3.x", "commit": f"c-{run_id}", "timestamp": when}}  # fmt: skip


def test_headline_pairs_only_ok_records_of_one_run_and_labels_variants():
    c1 = suites.AttentionCase(1, 2, 64, 64, 32)
    c2 = suites.AttentionCase(1, 2, 128, 128, 32)
    dec = suites.DecodeCase(1, 4, 2, 1, 256, 32)
    recs = [
        _rec("A", c1, "diyfa", tflops=100.0), _rec("A", c1, "sdpa-flash", tflops=50.0),
        _rec("A", c2, "diyfa", tflops=200.0), _rec("A", c2, "sdpa-flash", tflops=250.0),
        _rec("A", c1, "sdpa-cudnn", status="error", baseline=True),  # failed: no pair
        _rec("A", c1, "sdpa-math", tflops=10.0),  # not a baseline: no pair
        _rec("A", c1, "diyfa-portable", tflops=50.0),  # a variant: its own table
        _rec("B", c2, "sdpa-flash-2", suite="x", tflops=1.0, baseline=True),  # diyfa ran in A
        _rec("A", c2, "diyfa", suite="x", tflops=1.0),
        _rec("A", dec, "diyfa", suite="decode", gbps=2.0),  # decode: by GB/s
        _rec("A", dec, "sdpa-flash", suite="decode", gbps=0.5),
    ]  # fmt: skip
    lines, (main, variants) = builder.headline(recs, [_run("A", "GPU-1", "2026-01-01"),
                                                      _run("B", "GPU-1", "2026-01-02")])
    assert lines == ["GPU-1: torch 2.x, triton 3.x, commit c-A (run A, 2026-01-01)"]
    c = main.columns.index
    assert [(r[c("suite")], r[c("vs")]) for r in main.rows] == [("s", "sdpa-flash"),
                                                                ("decode", "sdpa-flash")]
    s, d = main.rows
    assert s[c("geomean")] == f"{(2.0 * 0.8) ** 0.5:.2f}x" and s[c("cases")] == "2"
    assert (s[c("worst")], s[c("worst case")]) == ("0.80x", c2.label())
    assert (s[c("best")], s[c("best case")]) == ("2.00x", c1.label())
    assert (d[c("geomean")], d[c("by")]) == ("4.00x", "GB/s")
    assert "GPU" not in main.columns and "run" not in main.columns  # one GPU, one run
    v = variants.columns.index
    assert [(r[v("variant")], r[v("vs")], r[v("geomean")]) for r in variants.rows] == [
        ("diyfa-portable", "sdpa-flash", "1.00x")]  # fmt: skip
    assert "variant" in variants.title


def test_headline_takes_the_latest_run_per_gpu_and_says_when_nothing_pairs():
    c1 = suites.AttentionCase(1, 2, 64, 64, 32)
    old = [_rec("old", c1, "diyfa", ms=2.0), _rec("old", c1, "sdpa-flash", ms=1.0)]
    new = [_rec("new", c1, "diyfa", ms=1.0), _rec("new", c1, "sdpa-flash", ms=3.0)]
    other = [_rec("h100", c1, "diyfa", ms=1.0), _rec("h100", c1, "sdpa-flash", ms=1.0)]
    runs = [_run("new", "H200", "2026-01-02"), _run("old", "H200", "2026-01-01"),
            _run("h100", "H100", "2026-01-01")]
    lines, [main] = builder.headline(old + new + other, runs)
    c = main.columns.index
    assert [(r[c("GPU")], r[c("geomean")], r[c("by")], r[c("run")]) for r in main.rows] == [
        ("H100", "1.00x", "time", "h100"), ("H200", "3.00x", "time", "new")]  # fmt: skip
    assert len(lines) == 2 and not any("run old" in x for x in lines)
    lines, tables = builder.headline(old[:1], runs[1:2])
    assert tables == [] and "no ratios" in lines[-1] and "run old" in lines[0]
