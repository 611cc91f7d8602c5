"""diyfa.distributed.ring_flash_attention on the CPU: 2 and 3 processes over gloo.

Each job spawns its ranks once (``torch.multiprocessing``, spawn start method, gloo on
127.0.0.1 at a free port, ``TRITON_INTERPRET=1`` set in each child before diyfa is
imported) and runs a list of cases; the ranks send their shards of the output, LSE and
gradients back through a queue, and the parent unshards them and judges them against
``attention_ref`` in float64 on the whole sequence by the project's rule (error at most 2x
PyTorch's own for outputs, 3x for gradients, small floors: test_attention's ``_check``).
Bad inputs: every rank must raise the same error, and none may hang (the parent waits with
timeouts and fails the test if a child is still alive).

No diyfa import at module level: spawned children import this module to find their entry
point before they set ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta

import pytest
import torch

# Every rank's shard is ``s`` tokens (the whole sequence is s x world); h / hk heads (GQA).
CASES = {
    2: [
        dict(id="causal-zigzag-gqa-bshd", b=1, s=16, h=4, hk=2, d=16, dtype="float32",
             causal=True, zigzag=True, layout="bshd"),
        dict(id="causal-contiguous-bhsd", b=1, s=16, h=2, hk=2, d=32, dtype="float32",
             causal=True, zigzag=False, layout="bhsd"),
        dict(id="full-zigzag-mqa-scale", b=2, s=12, h=4, hk=1, d=16, dtype="float32",
             causal=False, zigzag=True, layout="bshd", scale=0.3),
        dict(id="full-contiguous-odd-bhsd", b=1, s=9, h=2, hk=1, d=24, dtype="float32",
             causal=False, zigzag=False, layout="bhsd"),
        dict(id="causal-zigzag-gqa-bf16", b=1, s=16, h=4, hk=2, d=16, dtype="bfloat16",
             causal=True, zigzag=True, layout="bshd"),
        dict(id="causal-contiguous-fp16", b=1, s=16, h=2, hk=1, d=16, dtype="float16",
             causal=True, zigzag=False, layout="bshd"),
        # Every rank alone in its own group (a group of one): plain attention on the whole
        # sequence it holds.
        dict(id="group-of-one", b=1, s=24, h=2, hk=1, d=16, dtype="float32", causal=True,
             zigzag=True, layout="bshd", single=True),
    ],
    3: [
        dict(id="causal-zigzag-gqa-bshd", b=1, s=8, h=4, hk=2, d=16, dtype="float32",
             causal=True, zigzag=True, layout="bshd"),
        dict(id="causal-contiguous-odd-bhsd", b=1, s=7, h=2, hk=2, d=16, dtype="float32",
             causal=True, zigzag=False, layout="bhsd"),
        dict(id="full-zigzag", b=1, s=10, h=2, hk=2, d=32, dtype="float32", causal=False,
             zigzag=True, layout="bshd"),
        # A ring of global ranks 0 and 2 (rank 1 stays out): the neighbours' global ranks.
        dict(id="subgroup-0-2", b=1, s=8, h=2, hk=1, d=16, dtype="float32", causal=True,
             zigzag=True, layout="bshd", members=(0, 2)),
    ],
}

# (id, the error every rank must raise, a piece of its message)
BAD = [
    ("seqlen-differs", ValueError, "disagree on seqlen"),
    ("odd-zigzag-shard", ValueError, "even sequence shard"),
    ("dtype-differs", TypeError, "disagree on dtype"),
    ("kv-dtype-on-one-rank", TypeError, "rank 1: q, k, v must share a dtype"),
    ("heads-differ", ValueError, "disagree on heads"),
    ("causal-differs", ValueError, "disagree on causal"),
    ("q-and-kv-lengths", ValueError, "same tokens"),
    ("grad-on-one-rank", ValueError, "disagree on gradients wanted"),
    ("not-a-tensor", TypeError, "rank 0: q must be a torch.Tensor"),
]
# After every bad call, a good one: the ring still works (no rank left behind).
AFTER_BAD = dict(id="after-bad-inputs", b=1, s=8, h=2, hk=1, d=16, dtype="float32", causal=True,
                 zigzag=True, layout="bshd")

# On two GPUs (NCCL; the `gpu` test): CASES[2] and a longer bf16 problem at d 128.
NCCL_CASES = [
    dict(id="gpu-causal-zigzag-gqa-d128", b=1, s=1024, h=8, hk=2, d=128, dtype="bfloat16",
         causal=True, zigzag=True, layout="bshd"),
    dict(id="gpu-full-contiguous-d64", b=2, s=512, h=4, hk=4, d=64, dtype="float16",
         causal=False, zigzag=False, layout="bhsd"),
]

JOB_TIMEOUT_S = 300  # the whole job (spawn, imports, interpreter); it takes ~10-30 s
GLOO_TIMEOUT_S = 60  # a collective stuck longer raises in the child instead of hanging


# --------------------------------------------------------------------------------------------
# Both sides: the whole-sequence inputs of a case
# --------------------------------------------------------------------------------------------
def _full_inputs(case: dict, world: int, seed: int = 0):
    """q, k, v, dout of the whole sequence (every rank and the parent build the same)."""
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case["dtype"])
    seqlen = case["s"] * world

    def make(heads, d):
        shape = ((case["b"], seqlen, heads, d) if case["layout"] == "bshd"
                 else (case["b"], heads, seqlen, d))  # fmt: skip
        return torch.randn(shape, generator=g).to(dtype)

    return make(case["h"], case["d"]), make(case["hk"], case["d"]), make(case["hk"], case["d"]), \
        make(case["h"], case["d"])


def _seq_dim(case: dict) -> int:
    return 1 if case["layout"] == "bshd" else 2


# --------------------------------------------------------------------------------------------
# The children
# --------------------------------------------------------------------------------------------
def _run_case(case: dict, rank: int, world: int, groups: dict, device="cpu"):
    """Run one case on this rank; returns its shards (float32 numpy) or None if the rank
    takes no part."""
    import diyfa.distributed as dd

    members = case.get("members", tuple(range(world)))
    if case.get("single"):
        group, grank, gworld = groups[("single", rank)], 0, 1
    elif rank in members:
        group, grank, gworld = groups[members], members.index(rank), len(members)
    else:
        return None
    q, k, v, do = _full_inputs(case, gworld)
    dim = _seq_dim(case)
    q, k, v, do = (dd.shard_sequence(t, grank, gworld, dim, zigzag=case["zigzag"]).to(device)
                   for t in (q, k, v, do))  # fmt: skip
    for t in (q, k, v):
        t.requires_grad_()
    out, lse = dd.ring_flash_attention(q, k, v, group, causal=case["causal"],
                                       softmax_scale=case.get("scale"), layout=case["layout"],
                                       zigzag=case["zigzag"], return_lse=True)  # fmt: skip
    out.backward(do)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.dtype == torch.float32
    return {name: t.detach().float().cpu().numpy() for name, t in
            (("out", out), ("lse", lse), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))}


def _bad_call(name: str, rank: int):
    """One rank's side of a bad call (each case is wrong on some rank)."""
    import diyfa.distributed as dd

    def make(s=8, h=2, hk=1, dtype=torch.float32, grad=False):
        g = torch.Generator().manual_seed(rank)
        q = torch.randn(1, s, h, 16, generator=g).to(dtype)
        k = torch.randn(1, s, hk, 16, generator=g).to(dtype)
        return [t.requires_grad_(grad) for t in (q, k, torch.randn_like(k))]

    kw = dict(causal=True)
    if name == "seqlen-differs":
        q, k, v = make(s=8 + 2 * rank)
    elif name == "odd-zigzag-shard":
        q, k, v = make(s=7)
    elif name == "dtype-differs":
        q, k, v = make(dtype=torch.float16 if rank == 1 else torch.float32)
    elif name == "kv-dtype-on-one-rank":
        q, k, v = make()
        if rank == 1:
            k, v = k.half(), v.half()
    elif name == "heads-differ":
        q, k, v = make(h=2 + 2 * rank)
    elif name == "causal-differs":
        q, k, v = make()
        kw["causal"] = rank == 0
    elif name == "q-and-kv-lengths":
        q, _, _ = make(s=8)
        _, k, v = make(s=10)
    elif name == "grad-on-one-rank":
        q, k, v = make(grad=rank == 0)
    elif name == "not-a-tensor":
        q, k, v = make()
        if rank == 0:
            q = None
    else:
        raise AssertionError(name)
    dd.ring_flash_attention(q, k, v, **kw)


def _worker(rank: int, world: int, port: int, job: str, results) -> None:
    """A spawned rank: run ``job``'s cases, put (rank, "ok", payload) or (rank, "error",
    traceback) on ``results``. Jobs "cases" and "bad" run on the CPU (gloo, the Triton
    interpreter); "nccl" runs "cases" on GPU ``rank``."""
    device = torch.device("cuda", rank) if job == "nccl" else torch.device("cpu")
    if job != "nccl":
        os.environ["TRITON_INTERPRET"] = "1"  # before diyfa is imported
        torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        if job == "nccl":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if job == "nccl" else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world,
                                timeout=timedelta(seconds=GLOO_TIMEOUT_S))  # fmt: skip
        groups = {tuple(range(world)): None}
        payload = {}
        if job in ("cases", "nccl"):
            cases = CASES[world] + (NCCL_CASES if job == "nccl" else [])
            for r in range(world):  # every rank creates every group, in the same order
                groups[("single", r)] = dist.new_group([r])
            for case in cases:
                members = case.get("members")
                if members and members not in groups:
                    groups[members] = dist.new_group(list(members))
            for case in cases:
                payload[case["id"]] = _run_case(case, rank, world, groups, device)
        else:
            for name, _, _ in BAD:
                try:
                    _bad_call(name, rank)
                    payload[name] = ("no error", "")
                except Exception as e:  # noqa: BLE001 (the test judges it)
                    payload[name] = (type(e).__name__, str(e))
            payload[AFTER_BAD["id"]] = _run_case(AFTER_BAD, rank, world, groups)
        results.put((rank, "ok", payload))
    except BaseException:  # noqa: BLE001 (reported to the parent)
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# The parent
# --------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world: int, job: str) -> list[dict]:
    """Run ``job`` on ``world`` spawned ranks; their payloads in rank order. Fails the test
    if a rank raised, or if a rank has not answered and exited within the timeout (it is
    killed then)."""
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, job, results), daemon=True)
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    answers = {}
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        while len(answers) < world:  # drain the queue before joining (children flush to it)
            try:
                rank, status, payload = results.get(timeout=max(deadline - time.monotonic(),
                                                                0.1))  # fmt: skip
            except queue_mod.Empty:
                break
            answers[rank] = (status, payload)
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 5))
    finally:
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if hung or len(answers) < world:
        pytest.fail(f"{job} on {world} ranks: ranks {hung} still alive after "
                    f"{JOB_TIMEOUT_S} s (hung); answered: {sorted(answers)}")  # fmt: skip
    errors = {r: tb for r, (status, tb) in answers.items() if status == "error"}
    if errors:
        pytest.fail(f"{job} on {world} ranks raised:\n"
                    + "\n".join(f"rank {r}:\n{tb}" for r, tb in sorted(errors.items())))
    return [answers[r][1] for r in range(world)]


@pytest.fixture(scope="module")
def ring_cases():
    return {world: _spawn(world, "cases") for world in (2, 3)}


@pytest.fixture(scope="module")
def bad_inputs():
    return _spawn(2, "bad")


def _judge(case: dict, shards: list[dict], device="cpu") -> None:
    """Unshard the ranks' results and check them against float64 on the whole sequence
    (PyTorch's own error, the yardstick, measured on ``device``)."""
    from diyfa.distributed import zigzag_unshard
    from diyfa.reference import attention_ref

    from .test_attention import _check

    world = len(shards)
    dtype = getattr(torch, case["dtype"])
    q, k, v, do = (t.to(device) for t in _full_inputs(case, world))
    dim = _seq_dim(case)
    kw = dict(causal=case["causal"], softmax_scale=case.get("scale"), layout=case["layout"])
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    pt_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = attention_ref(*ref_in, compute_dtype=torch.float64, return_lse=True, **kw)
    pt, pt_lse = attention_ref(*pt_in, compute_dtype=dtype, return_lse=True, **kw)
    ref.backward(do.double())
    pt.backward(do)

    def whole(name):
        parts = [torch.from_numpy(s[name]).to(device) for s in shards]
        d = 2 if name == "lse" else dim
        return zigzag_unshard(parts, d) if case["zigzag"] else torch.cat(parts, dim=d)

    _check("out", whole("out"), pt, ref, 2, dtype)
    _check("lse", whole("lse"), pt_lse, ref_lse, 2, torch.float32)
    for name, p, r in zip(("dq", "dk", "dv"), pt_in, ref_in, strict=True):
        _check(name, whole(name), p.grad, r.grad, 3, dtype)


@pytest.mark.parametrize("world, case", [(w, c) for w, cases in CASES.items() for c in cases],
                         ids=lambda x: x["id"] if isinstance(x, dict) else f"{x}ranks")
def test_ring_matches_reference(ring_cases, world, case):
    results = [r[case["id"]] for r in ring_cases[world]]
    if case.get("single"):  # each rank ran the whole sequence alone
        for r in results:
            _judge(case, [r])
        return
    members = case.get("members", tuple(range(world)))
    assert all(results[r] is None for r in range(world) if r not in members)
    _judge(case, [results[r] for r in members])


@pytest.mark.parametrize("name, error, words", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise_on_every_rank(bad_inputs, name, error, words):
    got = [r[name] for r in bad_inputs]
    assert all(g == got[0] for g in got), f"the ranks raised different errors: {got}"
    kind, message = got[0]
    assert kind == error.__name__, f"expected {error.__name__}, got {kind}: {message}"
    assert words in message, message
    assert message.startswith("ring_flash_attention: ")


def test_ring_still_works_after_bad_inputs(bad_inputs):
    _judge(AFTER_BAD, [r[AFTER_BAD["id"]] for r in bad_inputs])


def test_zigzag_shard_round_trip():
    from diyfa.distributed import shard_sequence, zigzag_shard, zigzag_unshard

    x = torch.arange(2 * 12 * 3).reshape(2, 12, 3)
    shards = [zigzag_shard(x, r, 3, dim=1) for r in range(3)]
    # 6 chunks of 2 tokens: rank 0 holds chunks 0 and 5, rank 1 chunks 1 and 4, rank 2 2, 3.
    assert shards[0][0, :, 0].tolist() == [0, 3, 30, 33]
    assert shards[2][0, :, 0].tolist() == [12, 15, 18, 21]
    assert torch.equal(zigzag_unshard(shards, dim=1), x)
    contiguous = [shard_sequence(x, r, 3, 1, zigzag=False) for r in range(3)]
    assert torch.equal(torch.cat(contiguous, 1), x)
    with pytest.raises(ValueError, match="multiple of 6"):
        zigzag_shard(x[:, :10], 0, 3, dim=1)
    with pytest.raises(ValueError, match="rank must be in 0..2"):
        zigzag_shard(x, 3, 3, dim=1)


def test_needs_an_initialised_process_group():
    import torch.distributed as dist

    from diyfa.distributed import ring_flash_attention

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    q = torch.randn(1, 4, 1, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_flash_attention(q, q, q)


@pytest.mark.gpu
def test_ring_on_two_gpus_nccl():
    """The CPU cases and a longer bf16 d128 problem on two GPUs over NCCL (real kernels:
    the Hopper forward where it applies, slices of the shard included)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    shards = _spawn(2, "nccl")
    for case in CASES[2] + NCCL_CASES:
        results = [r[case["id"]] for r in shards]
        if case.get("single"):
            for r in results:
                _judge(case, [r], "cuda")
        else:
            _judge(case, results, "cuda")
