"""Results files: JSON lines, one object per line, data first.

A file holds one or more runs. Each run starts with a header line (``"record": "run"``: GPU,
driver, CUDA, torch/triton versions, git commit, time, device facts and the ceilings measured
once for the run) followed by one line per measurement (``"record": "measurement"``, the
schema of :func:`measurement`), each repeating the run's environment so a line stands alone.

Default place: ``benchmarks/results/<date>_<gpu>_<suites>.jsonl`` (a second run the same
day appends to the same file with a new ``run_id``). Reports are rendered from these files
only (:mod:`diyfa.report`), never re-measured.
"""

from __future__ import annotations

import datetime as _dt
import glob
import json
import math
import os
import platform
import re
import shutil
import subprocess
import uuid
from pathlib import Path

SCHEMA = 1
DEFAULT_DIR = Path("benchmarks/results")
STATUSES = ("ok", "unsupported", "unavailable", "oom", "error")


def _git_commit() -> str | None:
    """The checkout's commit; DIYFA_COMMIT names it where the tree travelled without .git
    (the GPU machine gets a copy of the working tree only)."""
    if os.environ.get("DIYFA_COMMIT"):
        return os.environ["DIYFA_COMMIT"]
    try:
        root = Path(__file__).resolve().parents[3]
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=5)  # fmt: skip
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "-uno"],
                               capture_output=True, text=True, timeout=5)  # fmt: skip
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _driver_version() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)  # fmt: skip
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def environment() -> dict:
    """GPU, driver, versions, commit and time of this process (never raises)."""
    import torch
    import triton

    from diyfa.device import interpreter_enabled

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "gpu": gpu or "cpu (Triton interpreter)",
        "driver": _driver_version(),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "commit": _git_commit(),
        "interpreter": interpreter_enabled() or gpu is None,
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def run_header(env: dict, *, suites: list[str], device: dict | None = None,
               ceilings: dict | None = None, options: dict | None = None) -> dict:  # fmt: skip
    return {
        "record": "run",
        "schema": SCHEMA,
        "run_id": uuid.uuid4().hex[:12],
        "suites": list(suites),
        "env": env,
        "device": device,
        "ceilings": ceilings,
        "options": options or {},
    }


def measurement(*, run_id: str, env: dict, suite: str, case, provider: str, mode: str,
                status: str = "ok", reason: str = "", baseline: bool = False) -> dict:  # fmt: skip
    """A measurement record with every field present (None until measured)."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    f = case.flops(mode)
    differs = {k: v for k, v in f.items() if k != "exact" and v != f["exact"]}
    note = ""
    if differs:
        note = "; ".join(f"{k} = {v / f['exact']:.4g} x exact" for k, v in differs.items())
    return {
        "record": "measurement",
        "schema": SCHEMA,
        "run_id": run_id,
        "suite": suite,
        "op": case.op,
        "provider": provider,
        "baseline": baseline,
        "label": case.label(),
        "shape": case.shape(),
        "options": case.options(),
        "dtype": case.dtype,
        "mode": mode,
        "status": status,
        "reason": reason,
        "timer": None,
        "median_ms": None,
        "p20_ms": None,
        "p80_ms": None,
        "flops": f,
        "flops_note": note,
        "tflops": None,
        "tflops_published": None,
        "util_datasheet_pct": None,
        "util_ceiling_pct": None,
        "min_bytes": case.min_bytes(mode),
        "bandwidth_tbps": None,
        "bandwidth_pct_copy": None,
        "error": None,
        "peak_extra_mem_bytes": None,
        "memory_note": "",
        "env": env,
    }


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def default_path(env: dict, suites: list[str], directory: Path | str = DEFAULT_DIR) -> Path:
    date = env.get("timestamp", "")[:10] or _dt.date.today().isoformat()
    gpu = _slug(str(env.get("gpu", "unknown")).replace("NVIDIA", ""))
    return Path(directory) / f"{date}_{gpu}_{_slug('+'.join(suites))}.jsonl"


class ResultsWriter:
    """Appends a run header and then one line per measurement, flushed as it goes."""

    def __init__(self, path: Path | str, header: dict):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.header = header
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._write(header)

    def _write(self, obj: dict) -> None:
        bad: list[str] = []
        obj = _finite(obj, "", bad)
        if bad:  # JSON has no NaN/inf: store null and say which fields were not finite
            obj["nonfinite"] = bad
        self._fh.write(json.dumps(obj, default=_json_default, allow_nan=False) + "\n")
        self._fh.flush()

    def write(self, record: dict) -> None:
        self._write(record)

    def close(self) -> None:
        self._fh.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _finite(obj, path: str, bad: list):
    """``obj`` with every non-finite float replaced by None; their paths appended to ``bad``."""
    if isinstance(obj, float) and not math.isfinite(obj):
        bad.append(f"{path}={obj}")
        return None
    if isinstance(obj, dict):
        return {k: _finite(v, f"{path}.{k}" if path else str(k), bad) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v, f"{path}[{i}]", bad) for i, v in enumerate(obj)]
    return obj


def _json_default(obj):
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)


def load(paths) -> tuple[list[dict], list[dict]]:
    """Read results files: (run headers, measurement records), in file order."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    runs, records = [], []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e})") from e
                kind = obj.get("record")
                if kind == "run":
                    obj["_file"] = str(path)
                    runs.append(obj)
                elif kind == "measurement":
                    obj["_file"] = str(path)
                    records.append(obj)
                else:
                    raise ValueError(f"{path}:{n}: unknown record kind {kind!r}")
    return runs, records


def latest_files(directory: Path | str = DEFAULT_DIR) -> list[Path]:
    """The results files of the most recent date in ``directory`` (names start with a date)."""
    files = sorted(Path(p) for p in glob.glob(str(Path(directory) / "*.jsonl")))
    if not files:
        return []
    latest = max(f.name[:10] for f in files)
    return [f for f in files if f.name[:10] == latest]
