"""Render results files into Markdown and one self-contained HTML page. Never re-measures.

The report opens with the headline (:func:`headline`): per GPU, suite, op, mode and
baseline, diyfa's rate over the baseline's (geometric mean, worst and best case, named) with
the GPU, versions and commit it was measured with; diyfa-* variants follow in a table of
their own. Then the full sections: the runs (GPU, versions, commit, ceilings), attention
TFLOPS per provider, speed-up of diyfa over each baseline, cases where the naive seqlen_q^2
FLOPs count would mislead (both numbers shown), peak extra memory, matmul, and every failed
measurement with its reason. Ratios are taken only between records of one run: across
machines or versions a ratio means nothing (a resumed run keeps its run id, and
``diyfa bench --resume`` refuses another machine or other versions).
Plots (matplotlib, PNG): TFLOPS vs seqlen, speed-up vs seqlen, utilisation, memory vs seqlen,
matmul TFLOPS vs size. Markdown links the PNGs written next to it; the HTML embeds them as
base64 so the page stands alone.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from diyfa.bench import results as _results

NAIVE_TOLERANCE = 0.01  # flag when the naive count is off by more than 1%


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]]
    note: str = ""


@dataclass
class Figure:
    name: str
    title: str
    png: bytes


@dataclass
class Report:
    title: str
    banner: str = ""
    summary: list[str] = field(default_factory=list)  # the headline's lines: runs measured
    headline: list[Table] = field(default_factory=list)  # shown first, before everything
    tables: list[Table] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)


# ------------------------------------------------------------------------------- analysis
def _f(x, fmt=".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _rate(r: dict) -> str:
    """TFLOPS, or the median time where no rate was derived (interpreter runs)."""
    if r.get("tflops") is None:
        return "-" if r.get("median_ms") is None else f"{r['median_ms']:.3g} ms"
    return _f(r["tflops"])


def _case_key(r: dict) -> tuple:
    s = r["shape"]
    return (r["suite"], r["op"], r["label"], r["mode"], tuple(sorted(s.items())))


def _ok(records):
    return [r for r in records if r["status"] == "ok"]


def _cell(r: dict | None, value) -> str:
    if r is None:
        return ""
    if r["status"] != "ok":
        return r["status"]
    return value(r)


def _providers_in(records) -> list[str]:
    seen = []
    for r in records:
        if r["provider"] not in seen and r["status"] != "unavailable":
            seen.append(r["provider"])
    return sorted(seen, key=lambda p: (p != "diyfa", p))


def _pivot(records, value) -> Table:
    provs = _providers_in(records)
    by_case: dict = defaultdict(dict)
    order = []
    for r in records:
        key = _case_key(r)
        if key not in by_case:
            order.append(key)
        by_case[key][r["provider"]] = r
    rows = []
    for key in order:
        cells = by_case[key]
        suite, _op, label, mode, _ = key
        rows.append([suite, label, mode] + [_cell(cells.get(p), value)
                                            for p in provs])  # fmt: skip
    return Table("", ["suite", "case", "mode"] + provs, rows)


def run_table(runs: list[dict]) -> Table:
    """One row per run; a resumed run (headers sharing its run id) shows once, with its
    resumptions counted."""
    first: dict = {}
    resumed: dict = defaultdict(int)
    for run in runs:
        rid = run.get("run_id", "?")
        if rid in first:
            resumed[rid] += 1
        else:
            first[rid] = run
    rows = []
    for rid, run in first.items():
        env = run.get("env", {})
        ceil = run.get("ceilings") or {}
        mm = ceil.get("matmul_tflops") or {}
        ceil_s = ", ".join(f"{k} {v:.0f} TFLOPS" for k, v in mm.items())
        if ceil.get("copy_tbps"):
            ceil_s += f", copy {ceil['copy_tbps']:.2f} TB/s"
        when = env.get("timestamp", "?") + (f" (resumed {resumed[rid]}x)" if resumed[rid] else "")
        rows.append([rid, env.get("gpu", "?"), str(env.get("driver")),
                     f"torch {env.get('torch')} / triton {env.get('triton')}",
                     str(env.get("commit")), when,
                     ", ".join(run.get("suites", [])), ceil_s or "not measured",
                     "FIXTURE" if run.get("fixture") else ""])  # fmt: skip
    return Table("Runs", ["run", "GPU", "driver", "versions", "commit", "time", "suites",
                          "measured ceilings", ""], rows)  # fmt: skip


# ------------------------------------------------------------------------------- headline
OURS = "diyfa"
MODE_ORDER = {"fwd": 0, "bwd": 1, "fwd_bwd": 2}


def _is_ours(provider: str) -> bool:
    return provider == OURS or provider.startswith(OURS + "-")


def _ratio(ours: dict, other: dict) -> tuple[float, str] | None:
    """(ours / other, basis): by TFLOPS (GB/s for decode, whose figure of merit is the cache
    read), both cases doing the same work; by time where no rate was derived (interpreter)."""
    key, basis = ("bandwidth_tbps", "GB/s") if ours["op"] == "decode" else ("tflops", "TFLOPS")
    if ours.get(key) and other.get(key):
        return ours[key] / other[key], basis
    if ours.get("median_ms") and other.get("median_ms"):
        return other["median_ms"] / ours["median_ms"], "time"
    return None


def _headline_groups(records, runs) -> dict:
    """{(gpu, suite, op, mode, ours, baseline): (run id, [(ratio, label, basis)])} from the
    pairs measured ok in one run; per key the latest run (by its header's time) with pairs."""
    by_run_case: dict = defaultdict(dict)
    for r in _ok(records):
        by_run_case[(r["run_id"], _case_key(r))][r["provider"]] = r
    pairs: dict = defaultdict(list)
    for (run_id, _key), provs in by_run_case.items():
        for ours in (p for p in provs if _is_ours(p)):
            for name, other in provs.items():
                if not other.get("baseline") or _is_ours(name):
                    continue
                ratio = _ratio(provs[ours], other)
                if ratio is not None:
                    r = provs[ours]
                    pairs[(run_id, r["suite"], r["op"], r["mode"], ours, name)].append(
                        (ratio[0], r["label"], ratio[1]))
    header = {}
    for run in runs:  # a resumed run's later headers repeat its id: keep the first
        header.setdefault(run.get("run_id"), run)
    latest: dict = {}
    for (run_id, *rest), values in pairs.items():
        env = (header.get(run_id) or {}).get("env") or {}
        key = (env.get("gpu", "?"), *rest)
        when = env.get("timestamp", "")
        if key not in latest or when > latest[key][0]:
            latest[key] = (when, run_id, values)
    return {k: (run_id, values) for k, (_, run_id, values) in latest.items()}


def _headline_table(groups: dict, title: str, variants: bool, order: list) -> Table | None:
    keys = [k for k in groups if (k[4] != OURS) == variants]
    if not keys:
        return None
    gpus = {k[0] for k in keys}
    run_ids = {groups[k][0] for k in keys}
    keys.sort(key=lambda k: (k[0], order.index(k[1:3]), MODE_ORDER.get(k[3], 9), k[4], k[5]))
    rows = []
    for k in keys:
        gpu, suite, op, mode, ours, name = k
        run_id, values = groups[k]
        ratios = [v[0] for v in values]
        worst, best = min(values), max(values)
        geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        basis = ", ".join(sorted({v[2] for v in values}))
        rows.append(([gpu] if len(gpus) > 1 else []) + [suite, op, mode]
                    + ([ours] if variants else []) + [name, str(len(values)), f"{geo:.2f}x",
                    f"{worst[0]:.2f}x", worst[1], f"{best[0]:.2f}x", best[1], basis]
                    + ([run_id] if len(run_ids) > 1 else []))  # fmt: skip
    columns = (["GPU"] if len(gpus) > 1 else []) + ["suite", "op", "mode"] \
        + (["variant"] if variants else []) + ["vs", "cases", "geomean", "worst", "worst case",
                                               "best", "best case", "by"] \
        + (["run"] if len(run_ids) > 1 else [])  # fmt: skip
    return Table(title, columns, rows)


def headline(records, runs) -> tuple[list[str], list[Table]]:
    """The first screen: one line per run the numbers come from (GPU, torch, triton,
    commit) and the ratio tables, diyfa first, its variants after.

    A ratio is diyfa's rate over a baseline's (providers marked ``baseline``) on one case,
    both measured with status ok in the same run; above 1 diyfa is faster. Per (GPU, suite,
    op, mode, baseline) the latest run with such pairs counts, so a report over many runs stays
    one screen; the full tables below hold every run. Rows follow the suites' order in the
    files, then fwd, bwd, fwd_bwd."""
    groups = _headline_groups(records, runs)
    order = list(dict.fromkeys((r["suite"], r["op"]) for r in records))
    used = {run_id for run_id, _ in groups.values()}
    lines, seen = [], set()
    for run in runs:
        rid = run.get("run_id")
        if rid in seen or (used and rid not in used):
            continue
        seen.add(rid)
        env = run.get("env") or {}
        lines.append(f"{env.get('gpu', '?')}: torch {env.get('torch')}, triton "
                     f"{env.get('triton')}, commit {env.get('commit')} (run {rid}, "
                     f"{env.get('timestamp', '?')})")  # fmt: skip
    if not groups:
        lines.append(f"No case has {OURS} and a baseline both measured (status ok) in one run: "
                     "no ratios.")  # fmt: skip
    note = (f"{OURS} rate / baseline rate per case (TFLOPS; GB/s for decode; time where no "
            "rate was derived), only cases where both ran ok in the same run; above 1.00x "
            f"{OURS} is faster. Geometric mean over the cases; the worst and best case named.")
    tables = []
    main = _headline_table(groups, f"{OURS} against each baseline", False, order)
    if main is not None:
        main.note = note
        tables.append(main)
    var = _headline_table(groups, f"{OURS} variants (other backends of {OURS}) against the "
                          "same baselines", True, order)  # fmt: skip
    if var is not None:
        var.note = f"Variants are {OURS} forced onto one kernel family; the same ratios as above."
        tables.append(var)
    return lines, tables


def attention_table(records) -> Table | None:
    recs = [r for r in records if r["op"] == "attention" and r["suite"] != "memory"]
    if not recs:
        return None
    t = _pivot(
        recs,
        lambda r: (
            _rate(r)
            + (f" ({_f(r['util_datasheet_pct'], '.0f')}%)" if r.get("util_datasheet_pct") else "")
        ),
    )
    t.title = "Attention: TFLOPS (exact FLOPs), in brackets % of datasheet peak"
    t.note = (
        "TFLOPS count only the (query, key) pairs the mask keeps (diyfa.flops, exact). "
        "A cell naming a status did not run; the failures table says why."
    )
    return t


def speedup_table(records) -> Table | None:
    ok = [r for r in _ok(records) if r["op"] == "attention" or r["op"] == "matmul"]
    by_run_case: dict = defaultdict(dict)
    for r in ok:
        by_run_case[(r["run_id"], _case_key(r))][r["provider"]] = r
    baselines = sorted({r["provider"] for r in ok if r.get("baseline")})
    rows = []
    for (_run, key), provs in by_run_case.items():
        ours = provs.get("diyfa")
        if ours is None:
            continue
        cells = []
        for b in baselines:
            other = provs.get(b)
            cells.append("" if other is None else f"{other['median_ms'] / ours['median_ms']:.2f}x")
        if any(cells):
            rows.append([key[0], key[2], key[3]] + cells)
    if not rows:
        return None
    return Table(
        "Speed-up of diyfa over each baseline (baseline time / diyfa time, same run)",
        ["suite", "case", "mode"] + baselines,
        rows,
        "Above 1.00x diyfa is faster. Ratios only between records of one run.",
    )


def naive_flops_table(records) -> Table | None:
    rows = []
    for r in records:
        if r["op"] != "attention":
            continue
        f = r["flops"]
        exact, naive, pub = f["exact"], f["naive_sq2"], f["published"]
        if abs(naive - exact) <= NAIVE_TOLERANCE * exact and abs(pub - exact) <= \
                NAIVE_TOLERANCE * exact:  # fmt: skip
            continue
        ms = r["median_ms"] if r["status"] == "ok" and r.get("tflops") is not None else None

        def tf(n, ms=ms):
            return None if not ms else n / ms / 1e9

        rows.append([r["suite"], r["label"], r["mode"], r["provider"], f"{exact:.4g}",
                     f"{pub:.4g}", f"{naive:.4g}", f"{naive / exact:.3f}", _f(tf(exact)),
                     _f(tf(pub)), _f(tf(naive))])  # fmt: skip
    if not rows:
        return None
    return Table("Where the naive FLOPs count (seqlen_q squared) would mislead",
                 ["suite", "case", "mode", "provider", "exact FLOPs", "published FLOPs",
                  "naive FLOPs", "naive / exact", "TFLOPS exact", "TFLOPS published",
                  "TFLOPS naive"], rows,
                 "The naive count squares seqlen_q (and halves when causal). For seqlen_q != "
                 "seqlen_k (seed 002: q 4096, kv 15360 has 3.75x the naive count) or "
                 "bottom-right causal masks it misstates the work; the exact count is used "
                 "everywhere else in this report.")  # fmt: skip


def memory_table(records) -> Table | None:
    recs = [r for r in records if r["op"] == "attention" and r["mode"] == "fwd"
            and (r["suite"] == "memory" or r.get("peak_extra_mem_bytes") is not None)]  # fmt: skip
    recs = [r for r in recs if r["suite"] in ("memory", "seed", "smoke")]
    if not recs:
        return None
    t = _pivot(recs, lambda r: "-" if r["peak_extra_mem_bytes"] is None
               else f"{r['peak_extra_mem_bytes'] / 1e6:,.1f}")  # fmt: skip
    t.title = "Peak extra memory (MB) beyond inputs and output, forward"
    t.note = "sdpa-math is standard attention (materialises the score matrix)."
    return t


def matmul_table(records) -> Table | None:
    recs = [r for r in records if r["op"] == "matmul"]
    if not recs:
        return None
    t = _pivot(
        recs,
        lambda r: (
            _rate(r)
            + (
                f" ({_f(r['util_ceiling_pct'], '.0f')}% cuBLAS)"
                if r.get("util_ceiling_pct")
                else ""
            )
        ),
    )
    t.title = "Matmul: TFLOPS, in brackets % of the measured cuBLAS ceiling"
    return t


def failures_table(records) -> Table | None:
    counts: dict = defaultdict(int)
    for r in records:
        if r["status"] != "ok":
            counts[(r["provider"], r["status"], r["reason"])] += 1
        err = r.get("error") or {}
        if err.get("status", "ok") != "ok":
            counts[(r["provider"], "error check", err["status"])] += 1
    if not counts:
        return None
    rows = [[p, s, str(n), reason[:300]] for (p, s, reason), n in counts.items()]
    return Table("Not measured, and why", ["provider", "status", "count", "reason"], rows)


def error_table(records) -> Table | None:
    recs = [r for r in records if (r.get("error") or {}).get("status") == "ok"]
    if not recs:
        return None
    t = _pivot(recs, lambda r: f"{r['error'].get('grad_max_abs', r['error']['out_max_abs']):.1e}"
               if (r.get("error") or {}).get("status") == "ok" else "skip")  # fmt: skip
    t.title = "Max abs error vs the float64 reference (output; bwd modes: worst gradient)"
    return t


# ---------------------------------------------------------------------------------- plots
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    _plt().close(fig)
    return buf.getvalue()


def _series(records, value, group_keys, x_key="seqlen_q"):
    """{group: {provider: [(x, y)]}} over records with seqlen_q == seqlen_k."""
    out: dict = defaultdict(lambda: defaultdict(list))
    for r in records:
        y = value(r)
        if y is None:
            continue
        s = r["shape"]
        if r["op"] == "attention" and s["seqlen_q"] != s["seqlen_k"]:
            continue
        out[group_keys(r)][r["provider"]].append((s[x_key], y))
    return out


def _grid_figure(
    series: dict, title: str, ylabel: str, logx=True, logy=False, xlabel: str = "seqlen"
):
    plt = _plt()
    groups = sorted(series, key=str)
    n = len(groups)
    cols = min(3, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False,
                             layout="constrained")
    for ax, g in zip(axes.flat, groups, strict=False):
        for prov, pts in sorted(series[g].items(), key=lambda kv: (kv[0] != "diyfa", kv[0])):
            pts = sorted(pts)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    lw=2.5 if prov == "diyfa" else 1.4, label=prov)  # fmt: skip
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_title(" ".join(str(x) for x in g), fontsize=9)
        ax.set_ylabel(ylabel)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(title)  # the constrained layout keeps it clear of the first row
    return fig


def _attn_group(r) -> tuple:
    s = r["shape"]
    causal = "causal" if r["options"].get("causal") else "non-causal"
    hk = f"/{s['kv_heads']}" if s["kv_heads"] != s["heads"] else ""
    return (r["suite"], r["mode"], f"d{s['head_dim']}", f"h{s['heads']}{hk}", causal, r["dtype"])


def figures(records) -> list[Figure]:
    figs = []
    attn = [r for r in _ok(records) if r["op"] == "attention" and r["suite"] != "memory"]
    tf = _series(attn, lambda r: r.get("tflops"), _attn_group)
    if tf:
        figs.append(Figure("attention_tflops", "Attention TFLOPS vs sequence length",
                           _png(_grid_figure(tf, "Attention TFLOPS (exact FLOPs) vs seqlen",
                                             "TFLOPS"))))  # fmt: skip
    # speed-up of diyfa vs each baseline, same run
    by: dict = defaultdict(dict)
    for r in attn:
        by[(r["run_id"], _case_key(r))][r["provider"]] = r
    sp: dict = defaultdict(lambda: defaultdict(list))
    for provs in by.values():
        ours = provs.get("diyfa")
        if ours is None or ours["shape"]["seqlen_q"] != ours["shape"]["seqlen_k"]:
            continue
        for name, other in provs.items():
            if other.get("baseline"):
                sp[_attn_group(ours)][f"vs {name}"].append(
                    (ours["shape"]["seqlen_q"], other["median_ms"] / ours["median_ms"])
                )
    if sp:
        figs.append(Figure("attention_speedup", "Speed-up of diyfa over each baseline",
                           _png(_grid_figure(sp, "diyfa speed-up (baseline ms / diyfa ms)",
                                             "speed-up (x)"))))  # fmt: skip
    util = _series(attn, lambda r: r.get("util_ceiling_pct") or r.get("util_datasheet_pct"),
                   _attn_group)  # fmt: skip
    if util:
        figs.append(Figure("attention_utilisation", "Utilisation",
                           _png(_grid_figure(util, "Utilisation: % of the measured cuBLAS "
                                             "ceiling (datasheet peak where not measured)",
                                             "% of ceiling"))))  # fmt: skip
    mem = [r for r in _ok(records) if r["op"] == "attention" and r["mode"] == "fwd"
           and r.get("peak_extra_mem_bytes") is not None]  # fmt: skip
    ms = _series(mem, lambda r: max(r["peak_extra_mem_bytes"], 1) / 1e6,
                 lambda r: (r["suite"], f"d{r['shape']['head_dim']}", r["dtype"]))  # fmt: skip
    if ms:
        figs.append(Figure("memory", "Peak extra memory vs sequence length",
                           _png(_grid_figure(ms, "Peak extra memory (MB)", "MB",
                                             logy=True))))  # fmt: skip
    mm = [r for r in _ok(records) if r["op"] == "matmul"]
    sq = _series(
        [r for r in mm if r["shape"]["m"] == r["shape"]["n"] == r["shape"]["k"]],
        lambda r: r.get("tflops"),
        lambda r: (r["suite"], r["dtype"]),
        x_key="m",
    )
    if sq:
        figs.append(Figure("matmul_tflops", "Matmul TFLOPS vs size",
                           _png(_grid_figure(sq, "Square matmul TFLOPS vs size",
                                             "TFLOPS", xlabel="M = N = K"))))  # fmt: skip
    other = [r for r in mm if not r["shape"]["m"] == r["shape"]["n"] == r["shape"]["k"]
             and r.get("tflops") is not None]  # fmt: skip
    if other:
        plt = _plt()
        labels = list(dict.fromkeys(r["label"] for r in other))
        provs = _providers_in(other)
        fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(labels)), 4))
        width = 0.8 / max(len(provs), 1)
        for i, p in enumerate(provs):
            ys = [next((r["tflops"] for r in other if r["label"] == lab and r["provider"] == p),
                       0) for lab in labels]  # fmt: skip
            ax.bar([j + i * width for j in range(len(labels))], ys, width, label=p)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, rotation=30,
                      ha="right", fontsize=7)  # fmt: skip
        ax.set_ylabel("TFLOPS")
        ax.legend(fontsize=7)
        ax.set_title("LLM-shaped matmuls")
        fig.tight_layout()
        figs.append(Figure("matmul_llm", "LLM-shaped matmuls", _png(fig)))
    return figs


# ------------------------------------------------------------------------------ rendering
def build(paths) -> Report:
    runs, records = _results.load(paths)
    fixture = any(r.get("fixture") for r in runs) or any(r.get("fixture") for r in records)
    interp = any((r.get("env") or {}).get("interpreter") for r in runs)
    banner = ""
    if fixture:
        banner = ("FIXTURE DATA: hand-made records for tests, not measurements. Do not quote "
                  "these numbers.")  # fmt: skip
    elif interp:
        banner = ("Interpreter run (no GPU): timings are Triton-interpreter timings on the "
                  "CPU, not kernel speed.")  # fmt: skip
    rep = Report(title="diyfa benchmark report", banner=banner)
    rep.summary, rep.headline = headline(records, runs)
    rep.tables.append(run_table(runs))
    for make in (attention_table, speedup_table, naive_flops_table, error_table, memory_table,
                 matmul_table, failures_table):  # fmt: skip
        t = make(records)
        if t is not None:
            rep.tables.append(t)
    rep.figures = figures(records)
    return rep


def _md_table(t: Table, level: int = 2) -> str:
    esc = [c.replace("|", "\\|") for c in t.columns]
    lines = [f"{'#' * level} {t.title}", "", "| " + " | ".join(esc) + " |",
             "|" + "|".join("---" for _ in t.columns) + "|"]  # fmt: skip
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in t.rows]
    if t.note:
        lines += ["", t.note]
    return "\n".join(lines) + "\n"


def to_markdown(rep: Report, image_dir: str = "plots") -> str:
    parts = [f"# {rep.title}", ""]
    if rep.banner:
        parts += [f"> **{rep.banner}**", ""]
    parts += ["## Headline", ""] + [f"- {line}" for line in rep.summary] + [""]
    parts += [_md_table(t, level=3) for t in rep.headline]
    parts += [_md_table(t) for t in rep.tables]
    for fig in rep.figures:
        parts += [f"## {fig.title}", "", f"![{fig.title}]({image_dir}/{fig.name}.png)", ""]
    return "\n".join(parts)


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}
table{border-collapse:collapse;margin:1em 0;font-size:13px}
td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}
th{background:#f3f3f3}.banner{background:#fff3cd;border:1px solid #e0c060;padding:.7em}
.note{color:#555;font-size:13px}img{max-width:100%}"""


def _html_table(t: Table, level: int = 2) -> list[str]:
    e = html.escape
    parts = [f"<h{level}>{e(t.title)}</h{level}><table><thead><tr>"]
    parts += [f"<th>{e(c)}</th>" for c in t.columns]
    parts.append("</tr></thead><tbody>")
    for row in t.rows:
        parts.append("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in row) + "</tr>")
    parts.append("</tbody></table>")
    if t.note:
        parts.append(f"<p class='note'>{e(t.note)}</p>")
    return parts


def to_html(rep: Report) -> str:
    e = html.escape
    parts = ["<!DOCTYPE html>", "<html><head><meta charset='utf-8'>",
             f"<title>{e(rep.title)}</title><style>{_CSS}</style></head><body>",
             f"<h1>{e(rep.title)}</h1>"]  # fmt: skip
    if rep.banner:
        parts.append(f"<p class='banner'><b>{e(rep.banner)}</b></p>")
    parts.append("<h2>Headline</h2><ul>")
    parts += [f"<li>{e(line)}</li>" for line in rep.summary]
    parts.append("</ul>")
    for t in rep.headline:
        parts += _html_table(t, level=3)
    for t in rep.tables:
        parts += _html_table(t)
    for fig in rep.figures:
        data = base64.b64encode(fig.png).decode("ascii")
        parts.append(f"<h2>{e(fig.title)}</h2><img alt='{e(fig.title)}' "
                     f"src=\"data:image/png;base64,{data}\">")  # fmt: skip
    parts.append("</body></html>")
    return "\n".join(parts)


def render(paths, out_dir: Path | str = "report") -> dict:
    """Write ``report.md``, ``plots/*.png`` and ``report.html`` into ``out_dir``."""
    paths = [Path(p) for p in paths]
    if not paths:
        raise ValueError("no results files given (and none found in benchmarks/results/)")
    rep = build(paths)
    out = Path(out_dir)
    (out / "plots").mkdir(parents=True, exist_ok=True)
    for fig in rep.figures:
        (out / "plots" / f"{fig.name}.png").write_bytes(fig.png)
    md = out / "report.md"
    md.write_text(to_markdown(rep))
    page = out / "report.html"
    page.write_text(to_html(rep))
    return {"markdown": md, "html": page, "figures": [f.name for f in rep.figures],
            "tables": [t.title for t in rep.headline + rep.tables], "report": rep}  # fmt: skip
