"""The source digest a benchmark run records (``env.source``: diyfa.bench.results
.source_digest over the package's .py and .json files) for a commit, to tell which commit a
result came from where the run's "commit" field cannot (the GPU machine's copy of the tree
carries a stale .git).

    python3 benchmarks/source_digest.py [REV ...]     (no REV: the working tree)
"""

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from diyfa.bench.results import source_digest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PKG = "src/diyfa/"


def files_at(rev: str) -> dict[str, bytes]:
    """{path under src/diyfa: bytes} of the package's .py and .json files at ``rev``."""
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", rev, PKG],
                           capture_output=True, text=True, check=True).stdout.split()
    return {name[len(PKG):]: subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{name}"],
                                            capture_output=True, check=True).stdout
            for name in names if name.endswith((".py", ".json"))}  # fmt: skip


def main() -> int:
    from diyfa.bench.results import _source_digest

    revs = sys.argv[1:]
    if not revs:
        print(_source_digest(), "working tree")
    for rev in revs:
        print(source_digest(files_at(rev)), rev)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
