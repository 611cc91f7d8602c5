"""Results files: JSON lines, one object per line, data first.

A file holds one or more runs. Each run starts with a header line (``"record": "run"``: GPU,
driver, CUDA, torch/triton versions, git commit, time, device facts and the ceilings measured
once for the run) followed by one line per measurement (``"record": "measurement"``, the
schema of :func:`measurement`), each repeating the run's environment so a line stands alone.

Default place: ``benchmarks/results/<date>_<gpu>_<suites>.jsonl`` (a second run the same
day appends to the same file with a new ``run_id``). Reports are rendered from these files
only (:mod:`diyfa.report`), never re-measured.

Every line is flushed as it is written, so an interrupted run leaves its header and every
finished measurement on disk. ``diyfa bench --resume FILE`` continues the file's last run
(:func:`resume_point`): it writes another header with the same ``run_id`` and
``"resumed": true`` and measures only the jobs whose :func:`record_key` is not in the file yet.
"""

from __future__ import annotations

import datetime as _dt
import glob
import hashlib
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
# What a measurement line must hold for the report to read it (every field of
# :func:`measurement` is written; these are the ones read without a default).
REQUIRED = ("run_id", "suite", "op", "provider", "label", "shape", "options", "dtype", "mode",
            "status", "reason", "flops", "median_ms", "peak_extra_mem_bytes")  # fmt: skip
# The environment a resumed run must share with the run it continues: the rows of both carry
# one run_id, and the report compares providers only within a run.
RESUME_ENV = ("gpu", "driver", "cuda", "torch", "triton", "python", "commit", "source",
              "interpreter")  # fmt: skip


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


def source_digest(files: dict[str, bytes]) -> str:
    """A short SHA-256 over the package's files, {path relative to src/diyfa: bytes}: the
    same for the same code wherever it ran (the GPU machine's copy of the working tree
    carries a stale ``.git``, so "commit" there names the session's first commit, "-dirty";
    ``benchmarks/source_digest.py REV`` gives a commit's digest to match)."""
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
    return h.hexdigest()[:12]


def _source_digest() -> str | None:
    """:func:`source_digest` of this process's diyfa package (its .py and .json files)."""
    try:
        root = Path(__file__).resolve().parents[1]
        files = {p.relative_to(root).as_posix(): p.read_bytes()
                 for p in root.rglob("*") if p.suffix in (".py", ".json") and p.is_file()}
        return source_digest(files)
    except OSError:
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
        "source": _source_digest(),
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
    """Appends a run header and then one line per measurement, flushed as it goes (an
    interrupted run keeps every finished line). ``count``: measurements written."""

    def __init__(self, path: Path | str, header: dict):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.header = header
        self.count = 0
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
        self.count += 1

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
    """Read results files: (run headers, measurement records), in file order.

    Raises ValueError naming the file and line for anything that is not a results line (not
    JSON, not an object, another record kind, a measurement lacking :data:`REQUIRED` fields or
    with an unknown status) and for an empty file; OSError when a file cannot be read."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    runs, records = [], []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            try:
                lines = fh.readlines()
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: not a text file ({e.reason} at byte {e.start}); "
                                 "accepted: JSON lines written by diyfa bench") from e  # fmt: skip
        if not any(line.strip() for line in lines):
            raise ValueError(f"{path}: empty; a results file starts with a run header "
                             "(diyfa bench writes one)")  # fmt: skip
        for n, line in enumerate(lines, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from e
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{n}: a JSON {type(obj).__name__}, not a record; "
                                 "accepted: one JSON object per line")  # fmt: skip
            kind = obj.get("record")
            if kind == "run":
                obj["_file"] = str(path)
                runs.append(obj)
            elif kind == "measurement":
                missing = [k for k in REQUIRED if k not in obj]
                if missing:
                    raise ValueError(f"{path}:{n}: measurement without {', '.join(missing)}")
                if obj["status"] not in STATUSES:
                    raise ValueError(f"{path}:{n}: status {obj['status']!r}; accepted: "
                                     f"{', '.join(STATUSES)}")  # fmt: skip
                for k in ("shape", "options", "flops"):
                    if not isinstance(obj[k], dict):
                        raise ValueError(f"{path}:{n}: {k} is {obj[k]!r}; accepted: an object")
                obj["_file"] = str(path)
                records.append(obj)
            else:
                raise ValueError(f"{path}:{n}: record kind {kind!r}; accepted: 'run', "
                                 "'measurement' (is this a diyfa bench results file?)")  # fmt: skip
    return runs, records


def job_key(suite: str, op: str, provider: str, shape: dict, options: dict, dtype: str,
            mode: str) -> tuple:  # fmt: skip
    """What identifies one measurement of a plan in any run: suite, op, provider, the case's
    shape and options, dtype and mode (options without ``layout``: the harness adds the
    provider's own, which a case does not carry)."""
    opts = {k: v for k, v in options.items() if k != "layout"}
    return (suite, op, provider, json.dumps(shape, sort_keys=True, default=_json_default),
            json.dumps(opts, sort_keys=True, default=_json_default), dtype, mode)  # fmt: skip


def record_key(rec: dict) -> tuple:
    """:func:`job_key` of a measurement record."""
    return job_key(rec["suite"], rec["op"], rec["provider"], rec["shape"], rec["options"],
                   rec["dtype"], rec["mode"])  # fmt: skip


def resume_point(path: Path | str, env: dict) -> tuple[dict, list[dict]]:
    """The last run of ``path`` (its first header) and that run's measurements, for this
    process (environment ``env``) to continue.

    Every written measurement counts as finished, whatever its status: the writer writes
    none before it is. Refuses (ValueError) a file without a run header and a run whose
    environment differs from ``env`` in any :data:`RESUME_ENV` field, naming each difference:
    its rows and ours would share a run id, and numbers from another GPU or other versions
    must not be compared as if measured together."""
    runs, records = load(path)
    if not runs:
        raise ValueError(f"cannot resume {path}: it holds no run header (not written by "
                         "diyfa bench)")  # fmt: skip
    run_id = runs[-1].get("run_id")
    run = next(r for r in runs if r.get("run_id") == run_id)
    there = run.get("env") or {}
    differ = [f"{k} {there.get(k)!r} there, {env.get(k)!r} here" for k in RESUME_ENV
              if there.get(k) != env.get(k)]  # fmt: skip
    if differ:
        raise ValueError(f"cannot resume {path}: its run {run_id} was measured in another "
                         f"environment ({'; '.join(differ)}); start a new file with "
                         "--out")  # fmt: skip
    return run, [r for r in records if r["run_id"] == run_id]


def latest_files(directory: Path | str = DEFAULT_DIR) -> list[Path]:
    """The results files of the most recent date in ``directory`` (names start with a date)."""
    files = sorted(Path(p) for p in glob.glob(str(Path(directory) / "*.jsonl")))
    if not files:
        return []
    latest = max(f.name[:10] for f in files)
    return [f for f in files if f.name[:10] == latest]
