"""Named benchmark sweeps: what to measure, never how.

A suite maps each *target* (``flash``: attention speed, ``matmul``, ``memory``: attention
peak memory) to a list of cases. ``diyfa bench flash --suite seed,fa-sweep`` runs the
attention cases of both suites; ``--quick`` trims every suite to a few points (a first GPU
run). Each case knows its FLOPs (exact, published convention, and the naive seqlen_q^2
count), its minimum bytes and a short label.

Suites
    seed        the seed's tables: attention fp16 b4 h8 d64 seq 512..4096 fwd; matmul square
                1024..8192 fp16/bf16; memory at seq 1024..8192
    fa-sweep    FlashAttention's sweep: bf16, 16k tokens (batch = 16384 // seqlen), hidden
                2048 (heads = 2048 // d), d 64/128/256, causal and not, seq 512..16384
    cross       seqlen_q != seqlen_k, including seed 002's case (q 4096, kv 15360, 16 heads)
    gqa         32 query heads / 8 kv heads, d 128, seq 1024..8192, ~16k tokens
    llm-matmul  transformer-layer matmuls (4096 tokens x 4096/6144/14336), bf16 and fp8
    memory      peak extra memory, standard attention (sdpa-math) vs flash, fp16 b4 h8 d64
    decode      new tokens (1, 2, 4, 8) against a contiguous KV cache of 512..128k tokens,
                32 query heads / 8 and 32 kv heads, d 128, bf16 (GB/s is the figure of merit)
    paged-decode  the same through a paged cache (page sizes 16 and 256, shuffled pages)
    varlen      64k tokens of packed sequences (lengths log-uniform in 128..8192), d 64/128,
                causal and not, fwd and bwd; the padded cuDNN provider is the baseline
    varlen-equal  the same tokens as equal-length batches (sequences of the mix's
                FLOP-weighted mean length: the same FLOPs), diyfa only: varlen's yardstick
    variants    8k tokens, d 128, causal: plain, a 1024-key window (exact FLOPs), softcap 30,
                ALiBi, sinks; fwd and bwd (issue 14's cost of each option)
    smoke       tiny shapes for the CPU interpreter (tests, a machine without a GPU)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from diyfa import flops

TARGETS = ("flash", "matmul", "memory")


_KERNEL_OPTIONS: dict = {}  # (AttentionCase, device) -> its variants' keyword arguments


@dataclass(frozen=True)
class AttentionCase:
    """One attention shape. ``kv_heads`` < ``heads`` is GQA; causal aligns bottom-right.
    Variants (the ``variants`` suite): ``window`` (left, right) as FlashAttention's
    window_size, ``softcap``, ``alibi`` (geometric slopes per head), ``sinks`` (one logit
    per head); :meth:`kernel_options` gives the tensors, the same for every provider."""

    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool = False
    dtype: str = "bf16"
    kv_heads: int | None = None
    window: tuple[int, int] | None = None
    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False

    op = "attention"

    @property
    def hk(self) -> int:
        return self.kv_heads or self.heads

    @property
    def variant(self) -> bool:
        return bool(self.window or self.softcap or self.alibi or self.sinks)

    def shape(self) -> dict:
        d = asdict(self)
        d["kv_heads"] = self.hk
        for name in ("dtype", "causal", "window", "softcap", "alibi", "sinks"):
            d.pop(name)
        return d

    def options(self) -> dict:
        opts = {"causal": self.causal, "align": "bottom_right"}
        # Only the variants in use: plain cases keep the keys of earlier results files.
        if self.window:
            opts["window"] = list(self.window)
        for name in ("softcap", "alibi", "sinks"):
            if getattr(self, name):
                opts[name] = getattr(self, name)
        return opts

    def kernel_options(self, device) -> dict:
        """diyfa's keyword arguments for the variants (slopes 2^(-8 (i + 1) / heads), as
        ALiBi's paper sets them; sinks a fixed ramp), on ``device``. Built once per (case,
        device): the providers call this inside the timed function, and a tensor built on
        the CPU and copied to the GPU on every call put a host-to-device copy (which waits
        for the stream) into every timed ALiBi and sinks call."""
        key = (self, str(device))
        if key not in _KERNEL_OPTIONS:
            _KERNEL_OPTIONS[key] = self._kernel_options(device)
        return dict(_KERNEL_OPTIONS[key])

    def _kernel_options(self, device) -> dict:
        import torch

        opts = {}
        if self.window:
            opts["window_size"] = tuple(self.window)
        if self.softcap:
            opts["softcap"] = self.softcap
        if self.alibi:
            opts["alibi_slopes"] = alibi_slopes(self.heads, device)
        if self.sinks:
            opts["sinks"] = torch.linspace(-1.0, 1.0, self.heads).to(device)
        return opts

    def flops(self, mode: str) -> dict:
        common = dict(head_dim=self.head_dim, kv_heads=self.hk, causal=self.causal, mode=mode,
                      window=tuple(self.window) if self.window else None)  # fmt: skip
        exact = flops.attention_flops(self.batch, self.heads, self.seqlen_q, self.seqlen_k,
                                      **common)  # fmt: skip
        published = flops.attention_flops(self.batch, self.heads, self.seqlen_q, self.seqlen_k,
                                          convention="published", **common)  # fmt: skip
        naive = flops.attention_flops(self.batch, self.heads, self.seqlen_q, self.seqlen_q,
                                      convention="published", **common)  # fmt: skip
        return {"exact": exact, "published": published, "naive_sq2": naive}

    def min_bytes(self, mode: str) -> int:
        return flops.attention_bytes(self.batch, self.heads, self.seqlen_q, self.seqlen_k,
                                     self.head_dim, kv_heads=self.hk, dtype=self.dtype,
                                     mode=mode)  # fmt: skip

    def label(self) -> str:
        h = f"h{self.heads}" + (f"/{self.hk}" if self.hk != self.heads else "")
        c = " causal" if self.causal else ""
        v = (f" win{self.window[0]},{self.window[1]}" if self.window else "") + (
            f" cap{self.softcap:g}" if self.softcap else "") + (
            " alibi" if self.alibi else "") + (" sinks" if self.sinks else "")  # fmt: skip
        return (f"b{self.batch} {h} sq{self.seqlen_q} sk{self.seqlen_k} d{self.head_dim}"
                f"{c}{v} {self.dtype}")  # fmt: skip


@dataclass(frozen=True)
class MatmulCase:
    """C[m, n] = A[m, k] @ B[k, n]; ``trans_b`` means B is stored (n, k) (nn.Linear weights)."""

    m: int
    n: int
    k: int
    dtype: str = "bf16"
    trans_a: bool = False
    trans_b: bool = False

    op = "matmul"

    def shape(self) -> dict:
        return {"m": self.m, "n": self.n, "k": self.k}

    def options(self) -> dict:
        return {"trans_a": self.trans_a, "trans_b": self.trans_b}

    def flops(self, mode: str) -> dict:
        f = flops.matmul_flops(self.m, self.n, self.k)
        return {"exact": f, "published": f, "naive_sq2": f}

    def min_bytes(self, mode: str) -> int:
        out = "bf16" if self.dtype.startswith("fp8") else self.dtype
        return flops.matmul_bytes(self.m, self.n, self.k, dtype=self.dtype, out_dtype=out)

    def label(self) -> str:
        t = ("T" if self.trans_a else "N") + ("T" if self.trans_b else "N")
        return f"{self.m}x{self.n}x{self.k} {t} {self.dtype}"


@dataclass(frozen=True)
class DecodeCase:
    """``seqlen_q`` new query tokens per sequence against ``cache_len`` cached tokens
    (causal, bottom-right); ``page_size`` None: a contiguous cache, else a paged one whose
    pages are shuffled in the pool."""

    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    cache_len: int
    head_dim: int
    page_size: int | None = None
    dtype: str = "bf16"

    op = "decode"

    def shape(self) -> dict:
        d = asdict(self)
        d.pop("dtype")
        return d

    def options(self) -> dict:
        return {"causal": True, "align": "bottom_right", "page_size": self.page_size}

    def flops(self, mode: str) -> dict:
        f = flops.attention_flops(self.batch, self.heads, self.seqlen_q, self.cache_len,
                                  head_dim=self.head_dim, kv_heads=self.kv_heads, causal=True,
                                  mode="fwd")  # fmt: skip
        return {"exact": f, "published": f, "naive_sq2": f}

    def min_bytes(self, mode: str) -> int:
        """The cache read once (K and V of every kv head) plus q and the output."""
        size = flops.DTYPE_BYTES[self.dtype]
        cache = 2 * self.batch * self.cache_len * self.kv_heads * self.head_dim
        return (cache + 2 * self.batch * self.seqlen_q * self.heads * self.head_dim) * size

    def label(self) -> str:
        paged = f" page{self.page_size}" if self.page_size else ""
        return (f"b{self.batch} h{self.heads}/{self.kv_heads} sq{self.seqlen_q} "
                f"cache{self.cache_len} d{self.head_dim}{paged} {self.dtype}")  # fmt: skip


@dataclass(frozen=True)
class VarlenCase:
    """Packed sequences of ``lengths`` tokens (the same for queries and keys), bottom-right
    causal per sequence when ``causal``."""

    lengths: tuple[int, ...]
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool = False
    dtype: str = "bf16"

    op = "varlen"

    def shape(self) -> dict:
        return {"batch": len(self.lengths), "heads": self.heads, "kv_heads": self.kv_heads,
                "total_tokens": sum(self.lengths), "max_seqlen": max(self.lengths),
                "head_dim": self.head_dim, "lengths": list(self.lengths)}  # fmt: skip

    def options(self) -> dict:
        return {"causal": self.causal, "align": "bottom_right"}

    def flops(self, mode: str) -> dict:
        common = dict(heads=self.heads, head_dim=self.head_dim, causal=self.causal, mode=mode,
                      seqlens_q=self.lengths, seqlens_k=self.lengths)  # fmt: skip
        exact = flops.attention_flops(**common)
        published = flops.attention_flops(convention="published", **common)
        return {"exact": exact, "published": published, "naive_sq2": published}

    def min_bytes(self, mode: str) -> int:
        size = flops.DTYPE_BYTES[self.dtype]
        total = sum(self.lengths)
        qo = 2 * total * self.heads * self.head_dim
        kv = 2 * total * self.kv_heads * self.head_dim
        return (qo + kv) * size * (2 if mode != "fwd" else 1)

    def label(self) -> str:
        c = " causal" if self.causal else ""
        return (f"n{len(self.lengths)} tok{sum(self.lengths)} max{max(self.lengths)} "
                f"h{self.heads}/{self.kv_heads} d{self.head_dim}{c} {self.dtype}")  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """What one suite measures for one target: cases x modes x providers."""

    suite: str
    target: str
    cases: tuple
    modes: tuple[str, ...]
    providers: tuple[str, ...] | None = None  # None: every provider of the op


ATTN_PROVIDERS = ("diyfa", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math",
                  "flash-attn-2", "fa4-cute")  # fmt: skip
MEMORY_PROVIDERS = ("diyfa", "sdpa-math", "sdpa-flash")
MATMUL_PROVIDERS = ("diyfa", "diyfa-fp8-acc32", "cublas", "cublas-fp8", "cublas-fp8-fast")


def _pick(values: list, quick: bool, keep: list) -> list:
    return [v for v in values if v in keep] if quick else values


def _seed(target: str, quick: bool) -> Plan | None:
    if target == "flash":
        seqs = _pick([512, 1024, 2048, 4096], quick, [1024, 4096])
        cases = [AttentionCase(4, 8, s, s, 64, dtype="fp16") for s in seqs]
        return Plan("seed", target, tuple(cases), ("fwd",))
    if target == "matmul":
        sizes = _pick([1024, 2048, 4096, 8192], quick, [1024, 4096])
        cases = [MatmulCase(s, s, s, dt) for dt in ("fp16", "bf16") for s in sizes]
        return Plan("seed", target, tuple(cases), ("fwd",), ("diyfa", "cublas"))
    return _memory(target, quick, suite="seed")


def _fa_sweep(target: str, quick: bool) -> Plan | None:
    if target != "flash":
        return None
    seqs = _pick([512, 1024, 2048, 4096, 8192, 16384], quick, [1024, 4096, 16384])
    dims = _pick([64, 128, 256], quick, [64, 128])
    cases = [AttentionCase(16384 // s, 2048 // d, s, s, d, causal, "bf16")
             for d in dims for causal in (False, True) for s in seqs]  # fmt: skip
    modes = ("fwd", "bwd") if quick else ("fwd", "bwd", "fwd_bwd")
    return Plan("fa-sweep", target, tuple(cases), modes)


def _cross(target: str, quick: bool) -> Plan | None:
    if target != "flash":
        return None
    cases = [AttentionCase(1, 16, 4096, 15360, 64, False, "bf16"),  # seed 002
             AttentionCase(1, 16, 4096, 15360, 64, True, "bf16"),
             AttentionCase(4, 16, 1024, 4096, 128, False, "bf16"),
             AttentionCase(2, 16, 8192, 1024, 64, False, "bf16")]  # fmt: skip
    if quick:
        cases = cases[:2]
    return Plan("cross", target, tuple(cases), ("fwd", "bwd"))


def _gqa(target: str, quick: bool) -> Plan | None:
    if target != "flash":
        return None
    seqs = _pick([1024, 2048, 4096, 8192], quick, [1024, 8192])
    cases = [AttentionCase(max(1, 16384 // s), 32, s, s, 128, causal, "bf16", kv_heads=8)
             for causal in (False, True) for s in seqs]  # fmt: skip
    return Plan("gqa", target, tuple(cases), ("fwd", "bwd"))


def _llm_matmul(target: str, quick: bool) -> Plan | None:
    if target != "matmul":
        return None
    tokens = 4096
    shapes = [(tokens, 6144, 4096),   # fused QKV projection (GQA, 4096 hidden)
              (tokens, 4096, 4096),   # attention output projection
              (tokens, 14336, 4096),  # MLP up / gate
              (tokens, 4096, 14336)]  # MLP down  # fmt: skip
    if quick:
        shapes = [shapes[2], shapes[3]]
    cases = [MatmulCase(m, n, k, "bf16", trans_b=True) for m, n, k in shapes]
    cases += [MatmulCase(m, n, k, "bf16", trans_b=False) for m, n, k in shapes[-1:]]
    cases += [MatmulCase(m, n, k, "fp8_e4m3", trans_b=True) for m, n, k in shapes]
    return Plan("llm-matmul", target, tuple(cases), ("fwd",))


def alibi_slopes(heads: int, device):
    """ALiBi's slopes as its paper sets them, 2^(-8 i / heads) for i = 1..heads (fp32), on
    ``device``: the variants suite's, and the A/B scripts' in benchmarks/."""
    import torch

    i = torch.arange(1, heads + 1, dtype=torch.float32)
    return torch.exp2(-8.0 * i / heads).to(device)


def _variants(target: str, quick: bool) -> Plan | None:
    """Issue 14's cost of each option at 8k tokens, d128 (16 heads, causal, bf16): plain,
    a 1024-key window (its FLOPs counted exactly: the window's pairs only), softcap 30,
    ALiBi, sinks; fwd and bwd."""
    if target != "flash":
        return None
    base = dict(batch=1, heads=16, seqlen_q=8192, seqlen_k=8192, head_dim=128, causal=True)
    cases = [AttentionCase(**base), AttentionCase(**base, window=(1023, 0)),
             AttentionCase(**base, softcap=30.0), AttentionCase(**base, alibi=True),
             AttentionCase(**base, sinks=True)]  # fmt: skip
    if quick:
        cases = cases[:2]
    return Plan("variants", target, tuple(cases), ("fwd", "bwd"))


def _memory(target: str, quick: bool, suite: str = "memory") -> Plan | None:
    if target != "memory":
        return None
    seqs = _pick([1024, 2048, 4096, 8192], quick, [1024, 4096])
    cases = [AttentionCase(4, 8, s, s, 64, dtype="fp16") for s in seqs]
    return Plan(suite, target, tuple(cases), ("fwd",), MEMORY_PROVIDERS)


def _decode_cases(quick: bool, page_size: int | None) -> list[DecodeCase]:
    # (batch, cache_len): anchors.md's rows (b16 x 16k, b64 x 4k) and the corners of a
    # serving mix; caches stay under ~9 GB (b x len x kv heads x d x 4 bytes).
    grid = [(1, 131072), (4, 65536), (16, 16384), (64, 4096), (128, 4096), (128, 512)]
    if quick:
        grid = [(16, 16384), (64, 4096)]
    cases = [DecodeCase(b, 32, 8, 1, n, 128, page_size) for b, n in grid]
    if not quick:
        cases += [DecodeCase(16, 32, 32, 1, 16384, 128, page_size)]
        cases += [DecodeCase(16, 32, 8, s, 16384, 128, page_size) for s in (2, 4, 8)]
    return cases


def _decode(target: str, quick: bool) -> Plan | None:
    if target != "flash":
        return None
    return Plan("decode", target, tuple(_decode_cases(quick, None)), ("fwd",))


def _paged_decode(target: str, quick: bool) -> Plan | None:
    if target != "flash":
        return None
    pages = (256,) if quick else (16, 256)
    cases = [c for p in pages for c in _decode_cases(quick, p)]
    return Plan("paged-decode", target, tuple(cases), ("fwd",))


def varlen_lengths(total: int, lo: int, hi: int, seed: int = 0) -> tuple[int, ...]:
    """A reproducible mix of sequence lengths drawn log-uniformly from [lo, hi], the last one
    trimmed so that they add up to ``total`` tokens."""
    import random

    rng = random.Random(seed)
    out, left = [], total
    while left > 0:
        n = min(left, int(round(lo * (hi / lo) ** rng.random())))
        out.append(n)
        left -= n
    return tuple(out)


def varlen_mix(device="cuda"):
    """The varlen suite's mix as the A/B scripts use it: (lengths, int32 cumulative lengths
    on ``device``, total tokens, longest length)."""
    import torch

    lengths = varlen_lengths(65536, 128, 8192)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)  # fmt: skip
    return lengths, cu, sum(lengths), max(lengths)


def _varlen(target: str, quick: bool) -> Plan | None:
    if target != "flash":
        return None
    lengths = varlen_lengths(65536, 128, 8192)
    dims = (128,) if quick else (64, 128)
    cases = [VarlenCase(lengths, 2048 // d, 2048 // d if d == 64 else 4, d, causal)
             for d in dims for causal in (False, True)]  # fmt: skip
    return Plan("varlen", target, tuple(cases), ("fwd", "bwd"))


def _varlen_equal(target: str, quick: bool) -> Plan | None:
    """The varlen suite's work as equal-length batches (issue 13: varlen >= 0.95x their
    TFLOPS): the same 64k tokens, heads and head dims, in sequences of the mix's FLOP-weighted
    mean length L = sum(l^2) / sum(l) (the same attention FLOPs as the mix), L rounded to a
    multiple of 128 and the batch to the tokens / L."""
    if target != "flash":
        return None
    lengths = varlen_lengths(65536, 128, 8192)
    mean = sum(n * n for n in lengths) / sum(lengths)
    seq = max(128, int(round(mean / 128)) * 128)
    batch = max(1, round(sum(lengths) / seq))
    dims = (128,) if quick else (64, 128)
    cases = [AttentionCase(batch, 2048 // d, seq, seq, d, causal,
                           kv_heads=2048 // d if d == 64 else 4)
             for d in dims for causal in (False, True)]  # fmt: skip
    return Plan("varlen-equal", target, tuple(cases), ("fwd", "bwd"), ("diyfa",))


def _smoke(target: str, quick: bool) -> Plan | None:
    if target == "flash":
        cases = [AttentionCase(1, 2, 64, 64, 32, False, "fp16"),
                 AttentionCase(1, 2, 48, 80, 32, True, "fp16")]  # fmt: skip
        return Plan("smoke", target, tuple(cases), ("fwd", "bwd"), ("diyfa", "sdpa-math"))
    if target == "matmul":
        return Plan("smoke", target, (MatmulCase(64, 48, 32, "fp16"),), ("fwd",),
                    ("cublas",))  # fmt: skip
    if target == "memory":
        return Plan("smoke", target, (AttentionCase(1, 2, 64, 64, 32, dtype="fp16"),),
                    ("fwd",), ("sdpa-math",))  # fmt: skip
    return None


SUITES: dict[str, Callable[[str, bool], Plan | None]] = {
    "seed": _seed,
    "fa-sweep": _fa_sweep,
    "cross": _cross,
    "gqa": _gqa,
    "variants": _variants,
    "llm-matmul": _llm_matmul,
    "memory": _memory,
    "decode": _decode,
    "paged-decode": _paged_decode,
    "varlen": _varlen,
    "varlen-equal": _varlen_equal,
    "smoke": _smoke,
}
DEFAULT_SUITES = {
    "flash": ("seed", "fa-sweep", "cross", "gqa"),
    "matmul": ("seed", "llm-matmul"),
    "memory": ("memory",),
}


def plans(target: str, suites: list[str] | None = None, quick: bool = False) -> list[Plan]:
    """The plans of ``suites`` (default: the target's) for ``target`` ('all': every target)."""
    targets = TARGETS if target == "all" else (target,)
    for t in targets:
        if t not in TARGETS:
            raise ValueError(f"unknown target {t!r}; accepted: {TARGETS + ('all',)}")
    out = []
    for t in targets:
        names = suites or DEFAULT_SUITES[t]
        for name in names:
            if name not in SUITES:
                raise ValueError(f"unknown suite {name!r}; accepted: {sorted(SUITES)}")
            plan = SUITES[name](t, quick)
            if plan is not None:
                out.append(plan)
    return out
