"""Ring attention across processes, checked against single-process diyfa attention.

Each rank builds the same whole-sequence q, k, v and dout (one seed), keeps its zigzag shard,
runs ``diyfa.distributed.ring_flash_attention`` forward and backward, gathers the output and
gradients, and rank 0 compares them with ``diyfa.flash_attention`` on the whole sequence in
one process (and, for short sequences, both with a float64/fp32 reference by the project's
2x / 3x rule). Prints the max errors; exits 1 if a check fails.

    torchrun --nproc-per-node 2 examples/ring_attention.py              # GPUs, NCCL
    torchrun --nproc-per-node 2 examples/ring_attention.py --cpu        # CPU, gloo, interpreter
    python examples/ring_attention.py --cpu                             # a group of one
    torchrun --nproc-per-node 2 examples/ring_attention.py --seq-per-rank 32768 --bench 20
    torchrun --nproc-per-node 2 examples/ring_attention.py --bench 5 --trace traces/

``--bench N`` also times the ring (forward, forward + backward; slowest rank) and one GPU
running the whole sequence, and prints TFLOPS per GPU. ``--trace DIR`` writes one PyTorch
profiler trace per rank (chrome://tracing, Perfetto): NCCL's send/recv kernels on their
stream next to the attention kernels shows the overlap. See docs/distributed.md.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true",
                   help="gloo on the CPU, kernels in the Triton interpreter (small defaults)")
    p.add_argument("--seq-per-rank", type=int, help="tokens per rank (default 4096, CPU 32)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, help="query heads (default 32, CPU 4)")
    p.add_argument("--kv-heads", type=int, help="key/value heads (default 8, CPU 2)")
    p.add_argument("--head-dim", type=int, help="default 128, CPU 16")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"),
                   help="default bf16, CPU fp32")
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--no-zigzag", dest="zigzag", action="store_false",
                   help="contiguous shards (unbalanced when causal)")
    p.add_argument("--layout", choices=("bshd", "bhsd"), default="bshd")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the single-process comparison")
    p.add_argument("--bench", type=int, default=0, metavar="N", help="time N iterations")
    p.add_argument("--trace", metavar="DIR", help="write a profiler trace per rank")
    a = p.parse_args(argv)
    cpu = a.cpu
    a.seq_per_rank = a.seq_per_rank or (32 if cpu else 4096)
    a.heads = a.heads or (4 if cpu else 32)
    a.kv_heads = a.kv_heads or (2 if cpu else 8)
    a.head_dim = a.head_dim or (16 if cpu else 128)
    a.dtype = a.dtype or ("fp32" if cpu else "bf16")
    return a


def _init(cpu: bool):
    """Join the group torchrun describes (or be a group of one without torchrun)."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))  # fmt: skip
    if cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before diyfa's kernels are imported
    import torch
    import torch.distributed as dist

    if cpu:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    else:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if cpu else "nccl", device_id=None if cpu else device)
    return device


def _timed(fn, iters: int, device) -> float:
    """Seconds per call of ``fn`` on the slowest rank (after 2 warm-up calls)."""
    import torch
    import torch.distributed as dist

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main(argv=None) -> int:
    a = _args(argv)
    device = _init(a.cpu)
    import torch
    import torch.distributed as dist

    import diyfa
    from diyfa.distributed import gather_sequence, ring_flash_attention, shard_sequence
    from diyfa.reference import attention_ref

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    seqlen = a.seq_per_rank * world
    dim = 1 if a.layout == "bshd" else 2
    say = print if rank == 0 else (lambda *_, **__: None)
    say(f"ring attention: {world} rank(s) on {device.type}, batch {a.batch}, seqlen {seqlen} "
        f"({a.seq_per_rank} per rank), heads {a.heads}/{a.kv_heads}, d {a.head_dim}, "
        f"{a.dtype}, causal={a.causal}, zigzag={a.zigzag}, layout {a.layout}")

    g = torch.Generator().manual_seed(0)

    def make(heads):
        shape = ((a.batch, seqlen, heads, a.head_dim) if a.layout == "bshd"
                 else (a.batch, heads, seqlen, a.head_dim))  # fmt: skip
        return torch.randn(shape, generator=g).to(device=device, dtype=dtype)

    full = [make(a.heads), make(a.kv_heads), make(a.kv_heads), make(a.heads)]  # q, k, v, dout
    q, k, v, do = (shard_sequence(t, rank, world, dim, zigzag=a.zigzag) for t in full)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    opts = dict(causal=a.causal, layout=a.layout, zigzag=a.zigzag)

    def ring_fwd_bwd():
        for t in (q, k, v):
            t.grad = None
        out = ring_flash_attention(q, k, v, **opts)
        out.backward(do)
        return out

    out = ring_fwd_bwd()
    ok = True
    if a.check:
        ring = [gather_sequence(t, dim=dim, zigzag=a.zigzag) for t in (out, q.grad, k.grad,
                                                                        v.grad)]  # fmt: skip
        if rank == 0:
            ok = _compare(a, full, ring, dtype, diyfa, attention_ref)
        flag = torch.tensor([int(ok)], device=device)
        dist.broadcast(flag, 0)
        ok = bool(flag.item())

    if a.bench:
        flops = [diyfa.attention_flops(a.batch, a.heads, seqlen, seqlen, a.head_dim,
                                       causal=a.causal, mode=m, convention="published")
                 for m in ("fwd", "fwd_bwd")]  # fmt: skip

        def ring_fwd():
            with torch.no_grad():
                ring_flash_attention(q, k, v, **opts)

        t_fwd, t_all = _timed(ring_fwd, a.bench, device), _timed(ring_fwd_bwd, a.bench, device)
        say(f"ring   fwd {t_fwd * 1e3:9.3f} ms  {flops[0] / t_fwd / world / 1e12:7.1f} "
            f"TFLOPS/GPU | fwd+bwd {t_all * 1e3:9.3f} ms  "
            f"{flops[1] / t_all / world / 1e12:7.1f} TFLOPS/GPU")
        if rank == 0:  # one GPU, the whole sequence
            fq, fk, fv = (t.detach().clone().requires_grad_() for t in full[:3])

            def one_fwd():
                with torch.no_grad():
                    diyfa.flash_attention(fq, fk, fv, causal=a.causal, layout=a.layout)

            def one_all():
                diyfa.flash_attention(fq, fk, fv, causal=a.causal, layout=a.layout).backward(
                    full[3])

            sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            times = []
            for fn in (one_fwd, one_all):
                fn()
                fn()
                sync()
                t0 = time.perf_counter()
                for _ in range(a.bench):
                    fn()
                sync()
                times.append((time.perf_counter() - t0) / a.bench)
            say(f"1 GPU  fwd {times[0] * 1e3:9.3f} ms  {flops[0] / times[0] / 1e12:7.1f} "
                f"TFLOPS     | fwd+bwd {times[1] * 1e3:9.3f} ms  "
                f"{flops[1] / times[1] / 1e12:7.1f} TFLOPS")
            say(f"per-GPU efficiency vs one GPU: fwd {times[0] / t_fwd / world:.1%}, "
                f"fwd+bwd {times[1] / t_all / world:.1%}")
        dist.barrier()

    if a.trace:
        from torch.profiler import ProfilerActivity, profile

        os.makedirs(a.trace, exist_ok=True)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                         else [])  # fmt: skip
        ring_fwd_bwd()
        with profile(activities=acts) as prof:
            for _ in range(3):
                ring_fwd_bwd()
            if device.type == "cuda":
                torch.cuda.synchronize()
        path = os.path.join(a.trace, f"ring_rank{rank}.json")
        prof.export_chrome_trace(path)
        print(f"rank {rank}: trace written to {path}")

    dist.destroy_process_group()
    return 0 if ok else 1


def _compare(a, full, ring, dtype, diyfa, attention_ref) -> bool:
    """Rank 0: the ring's gathered (out, dq, dk, dv) vs single-process diyfa, and for short
    sequences both vs a reference (float64 on the CPU, fp32 on the GPU) by the 2x / 3x rule."""
    import torch

    q, k, v, do = (t.detach().clone() for t in full)
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    one = diyfa.flash_attention(*ins, causal=a.causal, layout=a.layout)
    one.backward(do)
    single = [one.detach()] + [t.grad for t in ins]
    names = ("out", "dq", "dk", "dv")
    ok = True
    seqlen = q.shape[1 if a.layout == "bshd" else 2]
    if seqlen <= 8192:
        ref_dtype = torch.float64 if q.device.type == "cpu" else torch.float32
        rin = [t.to(ref_dtype).requires_grad_() for t in (q, k, v)]
        ref = attention_ref(*rin, causal=a.causal, layout=a.layout, compute_dtype=ref_dtype)
        ref.backward(do.to(ref_dtype))
        refs = [ref.detach()] + [t.grad for t in rin]
        floor = {torch.float16: 1e-5, torch.bfloat16: 1e-4, torch.float32: 2e-6}[dtype]
        print(f"max |error| vs the {str(ref_dtype).removeprefix('torch.')} reference "
              "(ring must be <= 2x (out) / 3x (grads) single-process + floor):")
        for name, r, s, f in zip(names, ring, single, refs, strict=True):
            e_ring = (r.to(ref_dtype) - f).abs().max().item()
            e_one = (s.to(ref_dtype) - f).abs().max().item()
            good = e_ring <= (2 if name == "out" else 3) * e_one + floor
            ok &= good
            print(f"  {name}: ring {e_ring:.3e}  single-process {e_one:.3e}  "
                  f"{'ok' if good else 'FAIL'}")
    else:  # no reference at this length: ring vs single-process within a few roundings
        eps = torch.finfo(dtype).eps
        print("max |ring - single-process| (must be <= 8 eps x max |single-process|):")
        for name, r, s in zip(names, ring, single, strict=True):
            err = (r.float() - s.float()).abs().max().item()
            bound = 8 * eps * s.float().abs().max().item()
            ok &= err <= bound
            print(f"  {name}: {err:.3e} (bound {bound:.3e}) {'ok' if err <= bound else 'FAIL'}")
    print("PASS" if ok else "FAIL")
    return ok


if __name__ == "__main__":
    sys.exit(main())
