"""Time to first result: a fresh process's first forward + backward of a new (dtype, head dim,
causal), with empty caches and then with warm ones (issue 15: <= 10 s cold, <= 1 s warm).

Each measurement is its own Python process (imports, Triton's compile or its cache, diyfa's
autotune choices: everything a user's first call pays). "cold" points ``TRITON_CACHE_DIR``
and ``DIYFA_CACHE_DIR`` at empty folders; "warm" runs the same process again over the folders
the cold run filled. Autotuning is off (the default) unless ``--autotune`` is given, which
sets ``DIYFA_AUTOTUNE=1`` for both runs (the warm one then reads the saved winners).

    python benchmarks/first_call.py [--dtype bf16] [--head-dim 128] [--causal] [--autotune]
                                    [--no-prefetch]

Python's bytecode is compiled beforehand by a process that imports torch, Triton and diyfa
(``PYTHONPYCACHEPREFIX`` in the run's temporary folder), as pip does when it installs them:
the GPU machine runs with ``PYTHONDONTWRITEBYTECODE`` set and its site-packages come without
it (a warm first forward there spent 0.32 s of 0.80 in ``compile()`` of Triton's sources,
2026-11-24), which no user's installation pays.
``--no-bytecode`` measures without it.

``--no-prefetch`` sets ``DIYFA_PREFETCH_BACKWARD=0``: the backward's kernels compile at the
backward, after the forward's, instead of on a worker thread during the forward
(``diyfa/attention/prefetch.py``).

One JSON line per run goes to ``$OUT/first_call.jsonl`` (or ./first_call.jsonl); a table is
printed last, after a cProfile of each run's first forward (by cumulative time: where a warm
first call still spends its time). ``after_torch_s`` is the total less ``import torch``,
which a user's process has usually paid before it calls diyfa. On a machine without a GPU
it runs the Triton interpreter on a tiny shape: the plumbing, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

BYTECODE = (
    "import torch, triton, triton.experimental.gluon, diyfa, diyfa.attention, "
    "diyfa.attention.hopper_fwd, diyfa.attention.hopper_bwd, diyfa.attention.portable"
)

CHILD = r"""
import cProfile, io, json, os, pstats, sys, time
t0 = time.perf_counter()
import torch
t_torch = time.perf_counter() - t0
import diyfa
t_import = time.perf_counter() - t0
dtype = getattr(torch, sys.argv[1]); d = int(sys.argv[2]); causal = sys.argv[3] == "1"
dev = "cuda" if torch.cuda.is_available() else "cpu"
b, h, s = (2, 16, 2048) if dev == "cuda" else (1, 2, 32)
q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=dtype, requires_grad=True)
           for _ in range(3))
if dev == "cuda":
    torch.cuda.synchronize()  # the CUDA context is up before the clock starts
prof = cProfile.Profile()
t1 = time.perf_counter()
prof.enable()
out = diyfa.flash_attention(q, k, v, causal=causal)
if dev == "cuda":
    torch.cuda.synchronize()
prof.disable()
t_fwd = time.perf_counter() - t1
t2 = time.perf_counter()
out.sum().backward()
if dev == "cuda":
    torch.cuda.synchronize()
t_bwd = time.perf_counter() - t2
top = io.StringIO()
pstats.Stats(prof, stream=top).sort_stats("cumulative").print_stats(25)
print(top.getvalue(), file=sys.stderr)
print(json.dumps({"import_s": t_import, "torch_import_s": t_torch,
                  "diyfa_import_s": t_import - t_torch, "fwd_s": t_fwd, "bwd_s": t_bwd,
                  "total_s": time.perf_counter() - t0, "device": dev,
                  "gpu": torch.cuda.get_device_name() if dev == "cuda" else None,
                  "torch": torch.__version__}))
"""


def run_child(env: dict, dtype: str, head_dim: int, causal: bool) -> dict:
    """One fresh process's first call; its JSON line as a dict."""
    done = subprocess.run([sys.executable, "-c", CHILD, dtype, str(head_dim),
                           "1" if causal else "0"], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the first-call process failed:\n{done.stderr[-2000:]}")
    rec = json.loads(done.stdout.strip().splitlines()[-1])
    rec["fwd_profile"] = done.stderr  # cProfile of the first forward, by cumulative time
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--autotune", action="store_true", help="DIYFA_AUTOTUNE=1 for both runs")
    ap.add_argument("--no-prefetch", action="store_true",
                    help="DIYFA_PREFETCH_BACKWARD=0 for both runs")  # fmt: skip
    ap.add_argument("--no-bytecode", action="store_true",
                    help="no Python bytecode compiled beforehand (see the module docstring)")
    args = ap.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(tmp, "triton"),
                   DIYFA_CACHE_DIR=os.path.join(tmp, "diyfa"),
                   DIYFA_AUTOTUNE="1" if args.autotune else "0",
                   DIYFA_PREFETCH_BACKWARD="0" if args.no_prefetch else "1",
                   PYTHONPATH=os.path.join(root, "src") + os.pathsep
                   + os.environ.get("PYTHONPATH", ""))  # fmt: skip
        try:
            import torch

            if not torch.cuda.is_available():
                env["TRITON_INTERPRET"] = "1"
        except ImportError:
            pass
        if not args.no_bytecode:
            # Python's bytecode of torch, Triton and diyfa, compiled once by a process that
            # imports them (and compiles no kernel: its Triton and diyfa caches are thrown
            # away), as pip does at install time.
            env["PYTHONPYCACHEPREFIX"] = os.path.join(tmp, "pycache")
            env.pop("PYTHONDONTWRITEBYTECODE", None)  # set on the GPU machine
            warm = dict(env, TRITON_CACHE_DIR=os.path.join(tmp, "x-triton"),
                        DIYFA_CACHE_DIR=os.path.join(tmp, "x-diyfa"))  # fmt: skip
            subprocess.run([sys.executable, "-c", BYTECODE], env=warm, check=True,
                           timeout=600)  # fmt: skip
        for caches in ("cold", "warm"):
            t = time.perf_counter()
            rec = run_child(env, args.dtype, args.head_dim, args.causal)
            rec.update(caches=caches, wall_s=time.perf_counter() - t, dtype=args.dtype,
                       head_dim=args.head_dim, causal=args.causal, autotune=args.autotune,
                       prefetch=not args.no_prefetch,
                       bytecode=not args.no_bytecode)  # fmt: skip
            records.append(rec)
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "first_call.jsonl"), "a") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    for r in records:  # where the first forward's time went (the log keeps it)
        print(f"--- {r['caches']} caches: the first forward, cProfile by cumulative time")
        print(r["fwd_profile"])
    print(f"prefetch: {'off' if args.no_prefetch else 'on'}")
    print("caches  import_s (torch + diyfa)  fwd_s  bwd_s  total_s  after_torch_s  "
          "(process wall_s)")
    for r in records:
        print(f"{r['caches']:6s} {r['import_s']:8.2f} ({r['torch_import_s']:.2f} + "
              f"{r['diyfa_import_s']:.2f}) {r['fwd_s']:6.2f} {r['bwd_s']:6.2f} "
              f"{r['total_s']:8.2f}  {r['total_s'] - r['torch_import_s']:8.2f}  "
              f"({r['wall_s']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
