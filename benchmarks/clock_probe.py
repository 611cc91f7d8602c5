"""SM clock and board power under sustained attention load, in one process on a CUDA GPU.

Each phase runs one call in a loop for ``--seconds`` (default 6) while ``nvidia-smi`` samples
the SM clock, the power draw, the temperature and the active throttle reasons every 100 ms
(to ``$OUT/smi.csv``); per phase it prints the median ms per call (CUDA events around each
call) and the median clock and power of the samples taken after its first second. Phases:
diyfa's forward and backward (``torch.autograd.grad``) on b1 h16 16k d128 bf16, the backward
causal and on b8 h16 2048, then FlashAttention-4's forward and backwards on the 16k shape
when ``flash_attn.cute`` imports (it runs first), and two idle seconds.

On an H200 (2026-11-25) every heavy phase drew ~690 W with the software power cap as the
throttle reason (0x4) and the SM clock at 1,620-1,890 MHz against 1,980 idle
(benchmarks/results/2026-11-25_h200_power-clocks-*_b40a9bf.*).

Usage (device): python3 benchmarks/clock_probe.py [--seconds 6]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")
sys.path.insert(0, __file__.rsplit("/", 1)[0])

import hopper_flag_ab  # noqa: E402
from oldnew_ab import event_ms  # noqa: E402

import diyfa  # noqa: E402

QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def timed_phase(name: str, fn, seconds: float) -> tuple:
    """(name, start, end, median ms per call, calls) of ``fn`` called in a loop."""
    fn()
    torch.cuda.synchronize()
    start, times = time.time(), []
    while time.time() - start < seconds:
        times += event_ms(fn, 1)
    return name, start, time.time(), statistics.median(times), len(times)


def inputs(b: int, h: int, s: int, d: int, gen, bshd: bool = False) -> list[torch.Tensor]:
    shape = (b, s, h, d) if bshd else (b, h, s, d)
    return [torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)
            .requires_grad_() for _ in range(3)]  # fmt: skip


def calls(attn, q, k, v, causal: bool, backward: bool):
    """The forward, or the backward of one forward's output, as a function."""
    fn = functools.partial(attn, causal=causal)
    return hopper_flag_ab.backward(fn, q, k, v) if backward else functools.partial(fn, q, k, v)


def samples(path: str) -> list[tuple]:
    """(unix time, MHz, W, deg C, throttle reasons) per nvidia-smi line."""
    rows = []
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        try:
            stamp, frac = parts[0].split(".")
            when = time.mktime(time.strptime(stamp, "%Y/%m/%d %H:%M:%S")) + float("0." + frac)
            rows.append((when, float(parts[1]), float(parts[2]), float(parts[3]), parts[4]))
        except (ValueError, IndexError):
            continue
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=6.0)
    a = ap.parse_args()
    out_dir = os.environ.get("OUT", ".")
    csv = os.path.join(out_dir, "smi.csv")
    gen = torch.Generator(device="cuda").manual_seed(0)
    phases = []
    with open(csv, "w") as log:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,"
                                "nounits", "-lms", "100"], stdout=log)  # fmt: skip
        try:
            time.sleep(1.0)
            try:
                from flash_attn.cute import flash_attn_func
            except ImportError:
                flash_attn_func = None
            if flash_attn_func is not None:  # (bshd)
                for name, causal, backward in (("fa4_fwd16k", False, False),
                                               ("fa4_bwd16k", False, True),
                                               ("fa4_bwd16k_causal", True, True)):
                    q, k, v = inputs(1, 16, 16384, 128, gen, bshd=True)
                    phases.append(timed_phase(name, calls(flash_attn_func, q, k, v, causal,
                                                          backward), a.seconds))  # fmt: skip
                    time.sleep(1.0)
            for name, shape, causal, backward in (
                    ("fwd16k", (1, 16, 16384, 128), False, False),
                    ("bwd16k", (1, 16, 16384, 128), False, True),
                    ("bwd16k_causal", (1, 16, 16384, 128), True, True),
                    ("bwd2k_b8", (8, 16, 2048, 128), False, True)):
                q, k, v = inputs(*shape, gen)
                phases.append(timed_phase(name, calls(diyfa.flash_attention, q, k, v, causal,
                                                      backward), a.seconds))  # fmt: skip
                time.sleep(1.0)
            start = time.time()
            time.sleep(2.0)
            phases.append(("idle", start, time.time(), 0.0, 0))
        finally:
            smi.terminate()
            smi.wait()
    rows = samples(csv)
    for name, start, end, ms, n in phases:
        inside = [r for r in rows if start + 1.0 <= r[0] <= end]
        if not inside:
            print(json.dumps(dict(phase=name, samples=0)))
            continue
        print(json.dumps(dict(phase=name, ms=round(ms, 4), calls=n,
                              sm_mhz=statistics.median(r[1] for r in inside),
                              power_w=statistics.median(r[2] for r in inside),
                              temp_max=max(r[3] for r in inside),
                              throttle=sorted({r[4] for r in inside}))), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
