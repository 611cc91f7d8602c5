"""Ring attention: FlashAttention over a sequence sharded across processes (context parallel).

Each rank of a ``torch.distributed`` group holds one shard of the sequence (q, k and v of
the same tokens). :func:`ring_flash_attention` passes the K/V shards round the ring with
asynchronous point-to-point sends (``batch_isend_irecv``: NCCL on GPUs, gloo on the CPU)
while the rank attends to the block in hand with diyfa's kernels, and merges the partial
outputs exactly through their log-sum-exps. The backward recomputes each block with the
*global* output and LSE through the kernel family's backward (which gives that block's
exact share of dQ, dK, dV) and passes fp32 dK/dV accumulators round the ring with the K/V
blocks, so every rank ends with the gradients of its own shard. Design, the overlap and
what is measured where: ``docs/distributed.md``.

Sharding. ``zigzag=True`` (the default, for causal balance): the sequence is cut into
2 * world equal chunks and rank i holds chunks i and 2 * world - 1 - i, in that order
(:func:`zigzag_shard`, :func:`zigzag_unshard`). ``zigzag=False``: rank i holds the i-th
contiguous slice. Every rank's shard has the same length; q, k and v share it.

Causal masking in the ring, for my queries on rank i and the K/V block of rank j:
    contiguous   j < i: full;  j == i: causal (the lower triangle);  j > i: skipped.
    zigzag       j == i: causal on the whole shard (chunk i before chunk 2N-1-i, so the
                 shard's own lower triangle is exactly the global mask);
                 j < i: every query vs the first chunk of the block (chunk j), full;
                 j > i: the second query chunk (2N-1-i) vs the whole block, full.
Each rank thus does the same causal work at every step (no idle ranks).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["gather_sequence", "ring_flash_attention", "shard_sequence", "zigzag_shard",
           "zigzag_unshard"]  # fmt: skip

LN2 = 0.6931471805599453

# --------------------------------------------------------------------------------------------
# Sharding helpers
# --------------------------------------------------------------------------------------------


def _check_split(x, world: int, parts: int, dim: int, what: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    n = x.shape[dim]
    if n % parts:
        raise ValueError(f"{what} needs the sequence ({n} along dim {dim}) to be a multiple "
                         f"of {parts}; pad it (at the end, for causal attention) first")
    return n // parts


def zigzag_shard(x: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s zigzag shard of ``x`` along ``dim``: chunks ``rank`` and
    ``2 * world - 1 - rank`` of the 2 * world equal chunks, concatenated (a new tensor;
    differentiable). The sequence length must be a multiple of 2 * world."""
    c = _check_split(x, world, 2 * world, dim, "zigzag sharding")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..{world - 1}, got {rank}")
    return torch.cat([x.narrow(dim, rank * c, c), x.narrow(dim, (2 * world - 1 - rank) * c, c)],
                     dim=dim)  # fmt: skip


def zigzag_unshard(shards, dim: int = 1) -> torch.Tensor:
    """The whole sequence from the zigzag shards of every rank, in rank order (the inverse
    of :func:`zigzag_shard`)."""
    shards = list(shards)
    if not shards:
        raise ValueError("zigzag_unshard needs at least one shard")
    world = len(shards)
    firsts, seconds = [], []
    for r, s in enumerate(shards):
        c = _check_split(s, world, 2, dim, f"shard {r}")
        firsts.append(s.narrow(dim, 0, c))
        seconds.append(s.narrow(dim, c, c))
    return torch.cat(firsts + seconds[::-1], dim=dim)


def shard_sequence(x: torch.Tensor, rank: int, world: int, dim: int = 1, *,
                   zigzag: bool = True) -> torch.Tensor:
    """Rank ``rank``'s shard in the order :func:`ring_flash_attention` expects: the zigzag
    shard, or (``zigzag=False``) the ``rank``-th contiguous slice (a new tensor)."""
    if zigzag:
        return zigzag_shard(x, rank, world, dim)
    c = _check_split(x, world, world, dim, "contiguous sharding")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..{world - 1}, got {rank}")
    return x.narrow(dim, rank * c, c).clone()


def gather_sequence(x: torch.Tensor, group=None, dim: int = 1, *,
                    zigzag: bool = True) -> torch.Tensor:
    """The whole sequence on every rank from each rank's shard ``x`` (an all-gather, not
    differentiable), undoing :func:`shard_sequence`'s order."""
    world = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return zigzag_unshard(parts, dim) if zigzag else torch.cat(parts, dim=dim)


# --------------------------------------------------------------------------------------------
# Checks: every rank checks its inputs, then one all-gather tells every rank what all found
# --------------------------------------------------------------------------------------------
_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
_LAYOUT_CODES = {"bshd": 1, "bhsd": 2}
_META = ("batch", "seqlen", "heads", "kv_heads", "head_dim", "head_dim_v", "dtype", "device type",
         "layout", "causal", "zigzag", "softmax_scale", "gradients wanted")  # fmt: skip
_ERRORS = {1: TypeError, 2: ValueError}
_MSG_BYTES = 512  # a rank's error message travels in the same all-gather (truncated)


def _local_check(q, k, v, causal, softmax_scale, layout, zigzag, grad):
    """This rank's (meta, error code, message): meta describes the call (compared across
    ranks), the code is 0 when the local inputs are fine, else 1 (TypeError) / 2
    (ValueError)."""
    from diyfa.attention.checks import check_inputs

    try:
        if not isinstance(zigzag, bool):
            raise TypeError(f"zigzag must be a bool, got {zigzag!r}")
        p = check_inputs(q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout,
                         align="bottom_right")  # fmt: skip
        if p.seqlen_q != p.seqlen_k:
            raise ValueError(f"q and k/v must hold the same tokens (one shard of a "
                             f"self-attention sequence), got seqlen {p.seqlen_q} for q and "
                             f"{p.seqlen_k} for k/v")  # fmt: skip
        if zigzag and p.seqlen_q % 2:
            raise ValueError(f"zigzag=True needs an even sequence shard (two equal chunks per "
                             f"rank), got {p.seqlen_q}: shard with zigzag_shard, or pass "
                             f"zigzag=False")  # fmt: skip
    except (TypeError, ValueError) as e:
        return [0] * len(_META), 1 if isinstance(e, TypeError) else 2, str(e)
    scale_bits = struct.unpack("<q", struct.pack("<d", p.softmax_scale))[0]
    meta = [p.batch, p.seqlen_q, p.heads, p.kv_heads, p.head_dim, p.head_dim_v,
            _DTYPE_CODES[p.dtype], 1 if p.device.type == "cuda" else 0, _LAYOUT_CODES[layout],
            int(causal), int(zigzag), scale_bits, int(grad)]  # fmt: skip
    return meta, 0, ""


def _describe(field: str, value: int) -> str:
    if field == "dtype":
        return {c: str(d).removeprefix("torch.") for d, c in _DTYPE_CODES.items()}[value]
    if field == "layout":
        return {c: name for name, c in _LAYOUT_CODES.items()}[value]
    if field == "device type":
        return "cuda" if value else "cpu"
    if field == "softmax_scale":
        return repr(struct.unpack("<d", struct.pack("<q", value))[0])
    if field in ("causal", "zigzag", "gradients wanted"):
        return str(bool(value))
    return str(value)


def _raise_agreed(rows: list[list[int]]) -> None:
    """Raise, from the gathered rows (the same on every rank), the error every rank raises:
    the first rank's local error, else the first field on which the ranks disagree."""
    n = len(_META)
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        r = failed[0]
        raw = torch.tensor(rows[r][1 + n:], dtype=torch.int64).numpy().tobytes()
        msg = raw.rstrip(b"\0").decode("utf-8", errors="ignore")
        more = f" (ranks {failed[1:]} failed too)" if len(failed) > 1 else ""
        raise _ERRORS[rows[r][0]](f"ring_flash_attention: rank {r}: {msg}{more}")
    for i, field in enumerate(_META):
        values = [row[1 + i] for row in rows]
        if len(set(values)) > 1:
            odd = next(r for r, x in enumerate(values) if x != values[0])
            hint = (" (uneven shards are not supported: pad the sequence to a multiple of "
                    "2 x world for zigzag, world otherwise)" if field == "seqlen" else "")
            error = TypeError if field == "dtype" else ValueError
            raise error(f"ring_flash_attention: the ranks disagree on {field}: rank 0 has "
                        f"{_describe(field, values[0])}, rank {odd} has "
                        f"{_describe(field, values[odd])}; every rank must pass the same "
                        f"shapes, dtype and options{hint}")  # fmt: skip


def _agree(q, k, v, causal, softmax_scale, layout, zigzag, grad, group, world) -> None:
    """Check the inputs on every rank and raise the same error on every rank if any rank's
    inputs are wrong or the ranks' calls differ; a group of one checks locally."""
    meta, code, msg = _local_check(q, k, v, causal, softmax_scale, layout, zigzag, grad)
    if world == 1:
        if code:
            raise _ERRORS[code](f"ring_flash_attention: {msg}")
        return
    raw = msg.encode("utf-8")[:_MSG_BYTES].ljust(_MSG_BYTES, b"\0")
    words = torch.frombuffer(bytearray(raw), dtype=torch.int64)
    row = torch.cat([torch.tensor([code] + meta, dtype=torch.int64), words])
    if isinstance(q, torch.Tensor) and q.is_cuda:
        device = q.device
    elif "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    row = row.to(device)
    rows = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(rows, row, group=group)
    _raise_agreed(torch.stack(rows).cpu().tolist())


# --------------------------------------------------------------------------------------------
# The ring
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Ring:
    """One call's ring: the group, my rank in it, its size, my neighbours' global ranks
    (the ones point-to-point ops take) and the call's options."""

    group: object
    rank: int
    world: int
    next_peer: int
    prev_peer: int
    causal: bool
    zigzag: bool
    softmax_scale: float | None
    layout: str

    @property
    def seq_dim(self) -> int:
        return 1 if self.layout == "bshd" else 2

    def exchange(self, send: list[torch.Tensor], recv: list[torch.Tensor]) -> list:
        """Start sending ``send`` to the next rank and receiving ``recv`` from the previous
        one (asynchronous; every rank posts the same sequence of exchanges, so the ops of a
        pair match in order). Returns the works to wait on."""
        ops = [dist.P2POp(dist.isend, t, self.next_peer, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.prev_peer, self.group) for t in recv]
        return dist.batch_isend_irecv(ops)

    def block(self, src: int, seqlen: int) -> tuple[int, int, int, int, bool] | None:
        """What my queries do with the K/V block of rank ``src``: (first query row, query
        rows, first key row, key rows, causal), or None when the block is masked out."""
        if not self.causal:
            return 0, seqlen, 0, seqlen, False
        if src == self.rank:
            return 0, seqlen, 0, seqlen, True
        if not self.zigzag:
            return (0, seqlen, 0, seqlen, False) if src < self.rank else None
        half = seqlen // 2
        if src < self.rank:  # my two chunks vs its early chunk (chunk src)
            return 0, seqlen, 0, half, False
        return half, half, 0, seqlen, False  # my late chunk vs both of its chunks


def _plan(q, k, v, causal, rows, keys, ring: _Ring):
    """Views of the block's q, k, v and its checked Problem and kernel family."""
    from diyfa.attention.checks import check_inputs
    from diyfa.attention.dispatch import select

    d = ring.seq_dim
    qs = q.narrow(d, rows[0], rows[1])
    ks, vs = k.narrow(d, keys[0], keys[1]), v.narrow(d, keys[0], keys[1])
    problem = check_inputs(qs, ks, vs, causal=causal, softmax_scale=ring.softmax_scale,
                           layout=ring.layout, align="bottom_right")  # fmt: skip
    return qs, ks, vs, problem, select(problem)


def _row_weights(lse2: torch.Tensor, layout: str) -> torch.Tensor:
    """(batch, heads, rows) per-row factors shaped to multiply an output of ``layout``."""
    return (lse2.transpose(1, 2) if layout == "bshd" else lse2).unsqueeze(-1)


def _ring_forward(q, k, v, ring: _Ring):
    """(out, lse2): the attention of my queries over every rank's keys; lse2 base 2,
    (batch, heads, seqlen) fp32 contiguous."""
    d = ring.seq_dim
    seqlen = q.shape[d]
    k, v = k.contiguous(), v.contiguous()  # sent as is, and every block has one layout
    acc = lse = None
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        if step + 1 < ring.world:  # the next block travels while this one is computed
            k_next, v_next = torch.empty_like(k), torch.empty_like(v)
            works = ring.exchange([k, v], [k_next, v_next])
        blk = ring.block(src, seqlen)
        if blk is not None:
            r0, nr, k0, nk, causal = blk
            qs, ks, vs, problem, family = _plan(q, k, v, causal, (r0, nr), (k0, nk), ring)
            out_b, lse_b = family.forward(qs, ks, vs, problem)
            if acc is None:  # step 0 is my own block, which covers every query row
                acc, lse = out_b.float(), lse_b.contiguous()
            else:
                acc_rows, lse_rows = acc.narrow(d, r0, nr), lse.narrow(2, r0, nr)
                new = torch.logaddexp2(lse_rows, lse_b)
                # acc = acc * 2^(lse - new) + out_b * 2^(lse_b - new), in place, in fp32
                acc_rows.mul_(_row_weights(torch.exp2(lse_rows - new), ring.layout))
                acc_rows.addcmul_(out_b, _row_weights(torch.exp2(lse_b - new), ring.layout))
                lse_rows.copy_(new)
        if step + 1 < ring.world:
            for w in works:
                w.wait()
            k, v = k_next, v_next
    return acc.to(q.dtype), lse


def _ring_backward(do, q, k, v, out, lse2, ring: _Ring):
    """(dq, dk, dv) of my shard: dQ accumulates here, dK/dV travel with their K/V block."""
    d = ring.seq_dim
    seqlen = q.shape[d]
    k, v = k.contiguous(), v.contiguous()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv_works = dk_recv = dv_recv = None
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        if step + 1 < ring.world:
            k_next, v_next = torch.empty_like(k), torch.empty_like(v)
            kv_works = ring.exchange([k, v], [k_next, v_next])
        blk = ring.block(src, seqlen)
        grads = None
        if blk is not None:
            r0, nr, k0, nk, causal = blk
            qs, ks, vs, problem, family = _plan(q, k, v, causal, (r0, nr), (k0, nk), ring)
            lse_b = lse2 if nr == seqlen else lse2.narrow(2, r0, nr).contiguous()
            grads = family.backward(do.narrow(d, r0, nr), qs, ks, vs, out.narrow(d, r0, nr),
                                    lse_b, problem)  # fmt: skip
            dq.narrow(d, r0, nr).add_(grads[0])
        if step == 0:  # my own block's accumulators start here
            dk_acc = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv_acc = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        else:  # the accumulators of this block, from the ranks it visited before
            for w in dkv_works:
                w.wait()
            dk_acc, dv_acc = dk_recv, dv_recv
        if grads is not None:
            dk_acc.narrow(d, k0, nk).add_(grads[1])
            dv_acc.narrow(d, k0, nk).add_(grads[2])
        # Pass them on (after the last step they go home: the next rank owns that block);
        # they travel while the next block is computed.
        dk_recv, dv_recv = torch.empty_like(dk_acc), torch.empty_like(dv_acc)
        dkv_works = ring.exchange([dk_acc, dv_acc], [dk_recv, dv_recv])
        if step + 1 < ring.world:
            for w in kv_works:
                w.wait()
            k, v = k_next, v_next
    for w in dkv_works:
        w.wait()
    return dq.to(q.dtype), dk_recv.to(k.dtype), dv_recv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring):
        out, lse2 = _ring_forward(q, k, v, ring)
        ctx.save_for_backward(q, k, v, out, lse2)
        ctx.ring = ring
        ctx.mark_non_differentiable(lse2)
        return out, lse2

    @staticmethod
    def backward(ctx, do, _dlse2):
        q, k, v, out, lse2 = ctx.saved_tensors
        dq, dk, dv = _ring_backward(do.contiguous(), q, k, v, out, lse2, ctx.ring)
        return dq, dk, dv, None


def ring_flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group=None,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    layout: str = "bshd",
    zigzag: bool = True,
    return_lse: bool = False,
):
    """Attention over a sequence sharded across the ranks of ``group``, differentiable.

    Call it on every rank of the group with that rank's shard; each gets the output (and,
    after ``backward``, the gradients) of its own shard, as one process would for the whole
    sequence.

    Args:
        q: (batch, seqlen, heads, head_dim) for layout="bshd" (the default),
           (batch, heads, seqlen, head_dim) for "bhsd": this rank's shard of the queries.
           fp16, bf16 or fp32.
        k, v: the same tokens' keys and values (kv_heads dividing heads: GQA/MQA).
        group: the ``torch.distributed`` process group (default: the world). NCCL for CUDA
            tensors, gloo for CPU ones (kernels on the CPU need ``TRITON_INTERPRET=1``).
        causal: the global causal mask (query t sees keys <= t in the whole sequence).
        softmax_scale: default 1/sqrt(head_dim).
        zigzag: the shards are in zigzag order (rank i holds chunks i and 2N-1-i of 2N:
            :func:`zigzag_shard`), which balances causal work; the shard length must be
            even. False: rank i holds the i-th contiguous slice.
        return_lse: also return the natural-log LSE of this rank's rows over the whole
            sequence, (batch, heads, seqlen) fp32.

    Every rank must pass the same shapes, dtype and options, and want gradients or not
    alike. This is checked with one small all-gather before the ring starts: a wrong input
    on any rank raises the same TypeError / ValueError on every rank (no rank is left
    waiting in the ring). A group of one runs :func:`diyfa.flash_attention` on the shard
    (which is then the whole sequence, in order either way). If one rank calls
    ``backward``, all must: the backward is a ring too.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_flash_attention needs torch.distributed initialised "
                           "(dist.init_process_group) on every rank")  # fmt: skip
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("ring_flash_attention: this process is not a member of the group")
    grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))
    _agree(q, k, v, causal, softmax_scale, layout, zigzag, grad, group, world)
    if world == 1:
        from diyfa.attention import flash_attention

        return flash_attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                               layout=layout, return_lse=return_lse)  # fmt: skip
    g = group if group is not None else dist.group.WORLD
    ring = _Ring(group, rank, world, dist.get_global_rank(g, (rank + 1) % world),
                 dist.get_global_rank(g, (rank - 1) % world), causal, zigzag, softmax_scale,
                 layout)  # fmt: skip
    if grad:
        out, lse2 = _RingAttention.apply(q, k, v, ring)
    else:
        out, lse2 = _ring_forward(q, k, v, ring)
    return (out, lse2 * LN2) if return_lse else out
