"""A short table of a results file (JSON lines from ``diyfa bench``): one row per (suite,
mode, case), one column per provider, TFLOPS (or TB/s of the minimum bytes moved with
``--tbps``, for the decode suites). The device-machine scripts print it last.

    python benchmarks/results_table.py FILE.jsonl [--tbps]
"""

from __future__ import annotations

import collections
import json
import sys


def main(argv: list[str]) -> int:
    path = argv[0]
    metric = "bandwidth_tbps" if "--tbps" in argv else "tflops"
    fmt = ".2f" if metric == "bandwidth_tbps" else ".0f"
    rows: dict = collections.defaultdict(dict)
    for line in open(path):
        r = json.loads(line)
        if r.get("record") != "measurement" or r.get(metric) is None:
            continue
        rows[(r["suite"], r["mode"], r["label"])][r["provider"]] = r[metric]
    names = sorted({p for v in rows.values() for p in v})
    print(path.rsplit("/", 1)[-1], "|", "TB/s" if metric == "bandwidth_tbps" else "TFLOPS", "|",
          " ".join(names))
    for key in sorted(rows):
        print(*key, *(f"{rows[key][n]:{fmt}}" if n in rows[key] else "-" for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
