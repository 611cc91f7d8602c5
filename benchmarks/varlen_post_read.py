"""A packed forward's host time after its lengths' wait, on a CUDA GPU's host: while it
runs the GPU idles (the wait drains the queue). Instruments ``checks.HostLengths.values``
(``wait``: the event's synchronize; ``check``: the rest of the read), ``Replay.run`` and
``Replay.launch`` (``read_to_*``: from the read's end to the replay's start; ``run`` /
``launch``: their time; ``run_end->return``: the call's rest) and prints the medians over
200 back-to-back calls of the varlen suite's mix (bf16, d128 16 / 4 heads and d64 32 / 32,
causal and not), then a cProfile of 200 causal d128 calls.

    python3 benchmarks/varlen_post_read.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")

import diyfa  # noqa: E402
from diyfa._launcher import Replay  # noqa: E402
from diyfa.attention import checks  # noqa: E402
from diyfa.bench.suites import varlen_mix  # noqa: E402

T: dict = {}


def _timed_methods() -> None:
    values, run, launch = checks.HostLengths.values, Replay.run, Replay.launch

    def timed_values(self):
        first = self._values is None
        t0 = time.perf_counter_ns()
        if first and self._event is not None:
            self._event.synchronize()
        t1 = time.perf_counter_ns()
        out = values(self)
        t2 = time.perf_counter_ns()
        if first:
            T.setdefault("wait", []).append(t1 - t0)
            T.setdefault("check", []).append(t2 - t1)
            T["last"] = t2
        return out

    def timed(name, fn):
        def wrapped(self, arg):
            t0 = time.perf_counter_ns()
            out = fn(self, arg)
            t1 = time.perf_counter_ns()
            T.setdefault(f"read_to_{name}", []).append(t0 - T.get("last", t0))
            T.setdefault(name, []).append(t1 - t0)
            T["end"] = t1
            return out
        return wrapped

    checks.HostLengths.values = timed_values
    Replay.run = timed("run", run)
    Replay.launch = timed("launch", launch)


def main() -> int:
    _timed_methods()
    _lengths, cu, n, m = varlen_mix()
    for d, h, hk, causal in ((128, 16, 4, True), (128, 16, 4, False), (64, 32, 32, True),
                             (64, 32, 32, False)):  # fmt: skip
        q = torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(n, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))

        def call(q=q, k=k, v=v, causal=causal):
            return diyfa.flash_attention_varlen(q, k, v, cu, cu, m, m, causal=causal)

        for _ in range(5):
            call()
        torch.cuda.synchronize()
        T.clear()
        rest = []
        for _ in range(200):
            call()
            rest.append(time.perf_counter_ns() - T.get("end", 0))
        torch.cuda.synchronize()
        med = {k: statistics.median(v) / 1e3 for k, v in T.items() if isinstance(v, list)}
        print(f"d{d} h{h}/{hk} causal={causal}: "
              + ", ".join(f"{k} {v:.1f}us" for k, v in med.items())
              + f", run_end->return {statistics.median(rest) / 1e3:.1f}us", flush=True)
    q = torch.randn(n, 16, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(n, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        diyfa.flash_attention_varlen(q, k, v, cu, cu, m, m, causal=True)
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue()[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
