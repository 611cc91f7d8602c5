"""Nsight Compute on one diyfa case: the command, and its CSV output parsed into a table.

``diyfa profile`` runs ``ncu --clock-control none --csv --metrics <METRICS> -k regex:<kernel>``
on a small ``python -c`` program that launches diyfa attention (or matmul) once with
autotuning off (``DIYFA_AUTOTUNE=0``: the default table's config, so ncu sees one kernel per
launch instead of every autotuning candidate). Without ``ncu`` on PATH it prints the command.
"""

from __future__ import annotations

import csv
import io
import shlex
import sys

METRICS = (
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "launch__registers_per_thread",
    "launch__shared_mem_per_block_static",
    "launch__shared_mem_per_block_dynamic",
)
SHORT = {
    METRICS[0]: "tensor pipe %",
    METRICS[1]: "warps active %",
    METRICS[2]: "regs/thread",
    METRICS[3]: "smem static B",
    METRICS[4]: "smem dynamic B",
}


def case_program(
    op: str = "attention",
    *,
    batch: int = 4,
    heads: int = 16,
    seqlen: int = 4096,
    seqlen_k: int | None = None,
    head_dim: int = 128,
    causal: bool = False,
    backward: bool = False,
    dtype: str = "bfloat16",
    size: int = 4096,
) -> str:
    """A one-line-per-statement Python program launching the case once."""
    lines = ["import os", 'os.environ["DIYFA_AUTOTUNE"] = "0"', "import torch", "import diyfa",
             f"dt = torch.{dtype}"]  # fmt: skip
    if op == "matmul":
        lines += [f"a = torch.randn({size}, {size}, device=\"cuda\", dtype=dt)",
                  f"b = torch.randn({size}, {size}, device=\"cuda\", dtype=dt)",
                  "c = diyfa.triton_matmul(a, b)"]  # fmt: skip
    else:
        sk = seqlen_k or seqlen
        lines += [f"q = torch.randn({batch}, {heads}, {seqlen}, {head_dim}, device=\"cuda\", "
                  f"dtype=dt, requires_grad={backward})",
                  f"k, v = (torch.randn({batch}, {heads}, {sk}, {head_dim}, device=\"cuda\", "
                  f"dtype=dt, requires_grad={backward}) for _ in range(2))",
                  f"o = diyfa.flash_attention(q, k, v, causal={causal})"]  # fmt: skip
        if backward:
            lines.append("o.backward(torch.randn_like(o))")
    lines.append("torch.cuda.synchronize()")
    return "; ".join(lines)


def default_kernel_regex(op: str, backward: bool) -> str:
    if op == "matmul":
        return "matmul"
    return "_attn_bwd" if backward else "_attn_fwd"


def ncu_command(program: str, kernel_regex: str, launch_count: int = 4,
                python: str | None = None) -> list[str]:  # fmt: skip
    return ["ncu", "--clock-control", "none", "--csv", "--metrics", ",".join(METRICS),
            "-k", f"regex:{kernel_regex}", "-c", str(launch_count),
            python or sys.executable, "-c", program]  # fmt: skip


def format_command(cmd: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)


def parse_ncu_csv(text: str) -> list[dict]:
    """Rows of ``ncu --csv`` output -> one dict per profiled launch:
    {"id", "kernel", "block", "grid", <metric name>: value}."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    launches: dict = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if not row.get("Metric Name"):
            continue
        key = row.get("ID")
        entry = launches.setdefault(key, {"id": key, "kernel": row.get("Kernel Name", ""),
                                          "block": row.get("Block Size", ""),
                                          "grid": row.get("Grid Size", "")})  # fmt: skip
        value = (row.get("Metric Value") or "").replace(",", "")
        try:
            entry[row["Metric Name"]] = float(value)
        except ValueError:
            entry[row["Metric Name"]] = value
    return list(launches.values())


def table(launches: list[dict]) -> tuple[list[str], list[list[str]]]:
    cols = ["id", "kernel", "grid", "block"] + [SHORT[m] for m in METRICS]
    rows = []
    for entry in launches:
        vals = []
        for m in METRICS:
            v = entry.get(m)
            vals.append("-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v)))
        name = entry["kernel"] if len(entry["kernel"]) < 48 else entry["kernel"][:45] + "..."
        rows.append([entry["id"], name, entry["grid"], entry["block"]] + vals)
    return cols, rows
