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
