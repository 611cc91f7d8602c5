"""A lean launch path for compiled Triton kernels (GPU only).

``kernel[grid](**args)`` re-derives on every call, in Python, what the compiled kernel was
specialised on (argument types, which integers are 1 or multiples of 16, which pointers are
16-byte aligned), builds a cache key from it, reads the runtime knobs and only then calls the
compiled launcher. Measured on an H200 host (torch 2.11, triton 3.6) for the 34-argument
attention forward kernel: 19.9 us per ``kernel[grid](...)`` call, of which the compiled
launcher (``CompiledKernel.run``) is 4.8 us. For a seqlen-1024 attention backward (two
launches, ~120 us of GPU work) that overhead decides whether the GPU ever waits on Python.

``FastLauncher`` keeps the compiled kernel per *specialisation key* and calls its launcher
directly. The key holds every constexpr argument's value, what Triton's
``native_specialize_impl`` sees of the other arguments (``tests/test_launcher.py`` checks the
two agree), the warps, stages and device, and the Triton settings that change compilation
(debug, instrumentation, target override, FMA fusion). It over-specifies where that is
cheaper: a distinct key can only cause one more trip through the normal path, never a wrong
kernel. The first call with a new key, and every call while a launch hook or a pre-run hook
is installed (profilers such as proton use them), goes through Triton's own path. Not
modelled: Triton's check that global variables a kernel read have not changed since it was
compiled (diyfa's kernels read none).
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
from triton import knobs
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor

from diyfa import _triton_key

_triton_key.install()  # Triton's installation key from disk: ~0.3 s off a process's first compile

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_local = threading.local()  # .compile_only: see compile_only()
_U64_MIN = 2**63


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host code: ``triton.cdiv`` is a constexpr function in Triton 3.6, whose
    call wrapper costs about a microsecond per use on the launch path."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1); host-side ``triton.next_power_of_2``."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def spec_key(arg) -> object:
    """What Triton's specialisation sees of one argument value, as a hashable key.

    Tensors: dtype and 16-byte alignment. Ints: == 1 (becomes a constant), % 16 == 0, and the
    width (i32 / i64 / u64). Floats: nothing (all fp32). Host TMA descriptors: the dtype and
    the block shape, and for Gluon's the shared-memory layout. Anything else (constexpr
    values such as bools, strings, None): the value itself, tagged with its type.
    """
    cls = type(arg)
    if cls is int:
        width = 0 if _I32_MIN <= arg <= _I32_MAX else (2 if arg >= _U64_MIN else 1)
        return (arg == 1, arg % 16 == 0, width)
    if cls is torch.Tensor or isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if cls is float:
        return float
    if cls is TensorDescriptor:
        return (cls, arg.base.dtype, tuple(arg.block_shape))
    if cls is GluonDescriptor:
        return (cls, arg.base.dtype, tuple(arg.block_shape), arg.layout)
    return (cls, arg)


def _constexpr_key(value) -> tuple:
    """A constexpr argument is compiled in by value; the type tag keeps True apart from 1."""
    return (type(value), value)


def compile_knobs() -> tuple:
    """The Triton settings read at launch that change what gets compiled (Triton's own cache
    key holds them through the compile options): device asserts, instrumentation, an
    overridden target architecture, FMA fusion."""
    return (knobs.runtime.debug, knobs.compilation.instrumentation_mode,
            knobs.runtime.override_arch, knobs.language.default_fp_fusion)  # fmt: skip


def _hooked(hook) -> bool:
    """Whether a launch hook is installed: Triton 3.6 keeps an always-present ``HookChain``
    (a list of callables, empty by default); older versions use None for none."""
    return hook is not None and bool(getattr(hook, "calls", True))


class FastLauncher:
    """Launch one ``@triton.jit`` (or ``@gluon.jit``) function, caching compiled kernels per
    specialisation."""

    def __init__(self, fn) -> None:
        for p in fn.params:
            if p.do_not_specialize or p.do_not_specialize_on_alignment or p.is_const or (
                    p.annotation_type and not p.is_constexpr):  # fmt: skip
                raise ValueError(f"{fn.__name__}: parameter {p.name} has specialisation "
                                 "options FastLauncher does not model")  # fmt: skip
        self.fn = fn
        self.names = tuple(p.name for p in fn.params)
        # constexpr parameters are compiled in by value (BLOCK_M=64 and 128 are two kernels);
        # the others by what specialisation sees of them.
        self._const = tuple(p.is_constexpr for p in fn.params)
        self._compiled: dict[tuple, object] = {}
        self.slow_launches = 0  # launches that went through Triton's own path

    def key(self, values: list) -> tuple:
        """The specialisation key of the kernel's argument values (in parameter order): what
        :func:`spec_key` and :func:`_constexpr_key` give, with the two commonest cases (ints
        and tensors) written inline: a call per argument was half the key's cost, and the
        key runs on every launch (tests/test_launcher.py checks the two agree)."""
        tensor = torch.Tensor
        return tuple(
            (type(v), v) if const
            else (v == 1, v % 16 == 0, 0 if _I32_MIN <= v <= _I32_MAX else 2 if v >= _U64_MIN
                  else 1) if type(v) is int  # noqa: E721 (bool is not an int here)
            else (v.dtype, v.data_ptr() % 16 == 0) if type(v) is tensor  # noqa: E721
            else spec_key(v)
            for const, v in zip(self._const, values, strict=True))  # fmt: skip

    def __call__(self, grid: tuple, args: dict, num_warps: int, num_stages: int):
        """Launch with keyword ``args`` naming every kernel parameter, meta-parameters included;
        returns the compiled kernel that ran.

        ``grid`` is a tuple of 1..3 ints; the tensors must be on the current CUDA device.
        """
        if getattr(_local, "compile_only", False):
            return compile_kernel(self.fn, grid, args, num_warps, num_stages)
        values = [args[name] for name in self.names]
        key = self._launch_key(values, num_warps, num_stages)
        kernel = self._compiled.get(key)
        if kernel is None or not self.lean_ok():
            self.slow_launches += 1
            kernel = self.fn[grid](**args, num_warps=num_warps, num_stages=num_stages)
            kernel = self._compiled[key] = kernel.result() if hasattr(kernel, "result") else kernel
            return kernel
        run_compiled(kernel, grid, key[2], values)
        return kernel

    def _launch_key(self, values: list, num_warps: int, num_stages: int) -> tuple:
        """What a launch's compiled kernel is kept by: the launch settings, the current
        device, the compile knobs and :meth:`key`."""
        return (num_warps, num_stages, torch.cuda.current_device(), compile_knobs(),
                *self.key(values))  # fmt: skip

    def compiled(self, args: dict, num_warps: int, num_stages: int) -> bool:
        """Whether a launch with these arguments (on the current device) would find its
        kernel compiled in this launcher."""
        values = [args[name] for name in self.names]
        return self._launch_key(values, num_warps, num_stages) in self._compiled

    def lean_ok(self) -> bool:
        """Whether a compiled kernel may be called directly: not while a pre-run hook or a
        launch hook is installed (they run only on Triton's own path)."""
        return not (self.fn.pre_run_hooks or _hooked(knobs.runtime.launch_enter_hook)
                    or _hooked(knobs.runtime.launch_exit_hook))  # fmt: skip


def run_compiled(kernel, grid: tuple, device: int, values: list) -> None:
    """Call a compiled kernel's launcher on ``device``'s current stream; ``values`` are the
    kernel's arguments in parameter order, constexprs included."""
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    stream = torch._C._cuda_getCurrentRawStream(device)
    kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None,
               None, None, *values)  # fmt: skip


@contextlib.contextmanager
def compile_only():
    """Within (this thread only): every launch through :func:`launch` or ``FastLauncher`` (and
    the portable kernels' first launch of a config) compiles its kernel into Triton's caches,
    builds and loads its launcher, and runs nothing. ``diyfa.attention.prefetch`` runs a
    backward this way on a worker thread while the forward compiles."""
    previous = getattr(_local, "compile_only", False)
    _local.compile_only = True
    try:
        yield
    finally:
        _local.compile_only = previous


def compiling_only() -> bool:
    """Whether this thread is inside :func:`compile_only`."""
    return getattr(_local, "compile_only", False)


def compile_kernel(fn, grid: tuple, args: dict, num_warps: int, num_stages: int):
    """What a launch of ``fn`` with these arguments would run, compiled (Triton's
    ``warmup``: its in-memory and disk caches) and its C launcher built (Triton's disk
    cache); nothing runs. Raises Triton's OutOfResources, as a launch would, when the kernel
    needs more shared memory than the device has. Returns the ``CompiledKernel``.

    The kernel object itself is left unloaded: Triton loads it (module and launcher, in two
    steps) at its first launch, and a launch on another thread must never find it half
    loaded. Building the launcher here (a C compile, ~0.35 s) leaves that first launch a
    disk-cache hit and a module load: milliseconds."""
    from triton.compiler.compiler import max_shared_mem
    from triton.runtime import driver
    from triton.runtime.errors import OutOfResources

    kernel = fn.warmup(grid=grid, **args, num_warps=num_warps, num_stages=num_stages)
    driver.active.launcher_cls(kernel.src, kernel.metadata)  # built and cached, then dropped
    limit = max_shared_mem(driver.active.get_current_device())
    if kernel.metadata.shared > limit:
        raise OutOfResources(kernel.metadata.shared, limit, "shared memory")
    return kernel


_launchers: dict = {}  # jit function -> its FastLauncher


def launcher_for(fn) -> FastLauncher:
    """The process-wide :class:`FastLauncher` of ``fn``."""
    launcher = _launchers.get(fn)
    if launcher is None:
        launcher = _launchers[fn] = FastLauncher(fn)
    return launcher


def launch(fn, grid: tuple, args: dict, meta: dict, num_warps: int, num_stages: int):
    """Launch ``fn`` (a ``@triton.jit`` function) with ``args`` plus the config's ``meta``
    through its process-wide :class:`FastLauncher`; returns the compiled kernel that ran."""
    return launcher_for(fn)(grid, {**args, **meta}, num_warps, num_stages)


def launch_recorded(fn, grid: tuple, args: dict, on_gpu: bool, launched: list | None = None,
                    num_warps: int = 4, num_stages: int = 1, meta: dict | None = None) -> None:
    """Launch ``fn``: on a GPU by :func:`launch` (its (fn, kernel, grid, args) appended to
    ``launched`` when given, for :meth:`Replay.record`), elsewhere under the interpreter."""
    if on_gpu:
        kernel = launch(fn, grid, args, meta or {}, num_warps, num_stages)
        if launched is not None:
            launched.append((fn, kernel, grid, args))
    else:
        fn[grid](**args)


class Replay:
    """One call's launches, kept to run again for the next call with the same signature.

    A call's host work (checking, building dozens of arguments, specialisation keys) is
    most of a small problem's time. A family that knows two calls agree on everything but
    their tensors' addresses (same shapes, strides, dtypes, options: its cache key) records
    the first call's launches and replays them: the next call allocates its outputs as
    usual and :meth:`run` puts its tensors where the first call's were and calls the
    compiled kernels, nothing else.

    ``Replay.record(launches, roles, constants)``: ``launches`` are (fn, compiled kernel,
    grid, args) of the launches just run, in order; ``roles`` names the call's tensors
    (inputs, outputs, workspaces: {"q": q, "out": out, ...}). Every tensor argument must
    start where one role's tensor does (it is that tensor or a view of it: the kernels take
    the address, with the strides as separate arguments that the signature fixes), and a
    host TMA descriptor's base likewise (the descriptor's shape, strides and block are kept,
    its base replaced); or be one of ``constants`` (kept by reference). Anything else, or
    two roles at one address (q passed as k too: the slots could not be told apart), and
    nothing is recorded (None).

    :meth:`run` returns False (and launches nothing) when the call must take the full path:
    a tensor whose 16-byte alignment differs from the recorded one's (another
    specialisation), a launch hook installed, other compile settings, another current device,
    inside :func:`compile_only`.
    """

    __slots__ = ("launches", "device", "knobs")

    def __init__(self, launches, device, knobs):
        self.launches = launches
        self.device = device
        self.knobs = knobs

    @classmethod
    def record(cls, launches, roles: dict, constants=()) -> Replay | None:
        by_ptr = {t.data_ptr(): name for name, t in roles.items()}
        if len(by_ptr) != len(roles):
            return None
        kept = {id(c) for c in constants}
        recorded = []
        for fn, kernel, grid, args in launches:
            launcher = launcher_for(fn)
            template = [args[name] for name in launcher.names]
            slots = []  # (index, role, descriptor template or None, 16-byte aligned)
            for i, value in enumerate(template):
                if isinstance(value, torch.Tensor):
                    base, desc = value, None
                elif type(value) in (TensorDescriptor, GluonDescriptor):
                    base, desc = value.base, value
                else:
                    continue
                if id(base) in kept:
                    continue
                role = by_ptr.get(base.data_ptr())
                if role is None:
                    return None
                if desc is not None:
                    desc = _rebased(value, None)  # no reference to this call's tensors kept
                slots.append((i, role, desc, base.data_ptr() % 16 == 0))
                template[i] = None
            slots = tuple(slots)
            recorded.append((kernel, grid, launcher, template, slots,
                             _Direct.of(kernel, template, slots)))  # fmt: skip
        return cls(recorded, torch.cuda.current_device(), compile_knobs())

    def run(self, roles: dict) -> bool:
        """Launch the recorded kernels with ``roles``' tensors (the recording's names)."""
        runs = self.prepare(roles)
        if runs is None:
            return False
        self.launch(runs)
        return True

    def prepare(self, roles: dict) -> list | None:
        """The launches of :meth:`run` with ``roles``' tensors, arguments filled in, for
        :meth:`launch` (None where a replay cannot serve: see :meth:`run`). A caller that
        must wait for something before launching (packed sequences' lengths) prepares
        first."""
        if (compiling_only() or torch.cuda.current_device() != self.device
                or compile_knobs() != self.knobs):  # fmt: skip
            return None
        runs = []
        for kernel, grid, launcher, template, slots, direct in self.launches:
            if not launcher.lean_ok():
                return None
            if direct is not None:
                args = direct.args(roles)
                if args is None:
                    return None
                runs.append((direct, grid, args))
                continue
            values = template.copy()
            for i, role, desc, aligned in slots:
                t = roles[role]
                if (t.data_ptr() % 16 == 0) != aligned:
                    return None
                values[i] = t if desc is None else _rebased(desc, t)
            runs.append((kernel, grid, values))
        return runs

    def launch(self, runs: list) -> None:
        """Launch what :meth:`prepare` filled in."""
        for kernel, grid, values in runs:
            if type(kernel) is _Direct:
                kernel.run(grid, self.device, values)
            else:
                run_compiled(kernel, grid, self.device, values)


def _rebased(desc, base):
    """A copy of the host TMA descriptor ``desc`` (shape, strides, block, layout) on
    ``base``."""
    copy = object.__new__(type(desc))
    copy.__dict__.update(desc.__dict__)
    copy.base = base
    return copy


class _Direct:
    """One recorded launch, made by calling the compiled kernel's C launcher itself.

    Triton's Python launcher (``CudaLauncher``, Triton 3.6) sits between ``kernel.run`` and
    its C ``launch``: per call it works out scratch buffers, walks every argument to expand
    host TMA descriptors, and encodes each descriptor's ``CUtensorMap`` again in the driver;
    the C code then asks the driver about every tensor's pointer (``cuPointerGetAttribute``)
    after calling its ``data_ptr`` method. For a replay whose geometry is fixed, the
    arguments are flattened once at recording (each descriptor into Triton's own expansion,
    ``make_tensordesc_arg``: the map, then its shape and strides) and each call fills in its
    tensors' addresses as integers (taken as they are) and the maps of their descriptors,
    encoded once per address and kept (a map holds the address, shape, strides, block and
    swizzle: all but the address fixed by the signature). Where the launcher is not that
    shape (another Triton, scratch memory, a kernel object of a test) there is none and the
    launch goes through ``run_compiled``.
    """

    __slots__ = ("launch", "head", "flat", "fills", "maps")

    MAPS_KEPT = 8  # encoded maps kept per descriptor slot (addresses an allocator reuses)

    def __init__(self, launch, head, flat, fills):
        self.launch = launch  # the C entry point
        self.head = head  # (function, cooperative, pdl, None, None, packed metadata, None x 3)
        self.flat = flat  # the flattened argument list, None where a call's tensor goes
        self.fills = fills  # (position, role, descriptor template or None, meta, aligned)
        self.maps = [{} for _ in fills]

    @classmethod
    def of(cls, kernel, template: list, slots: tuple) -> _Direct | None:
        if not DIRECT:
            return None
        run = getattr(kernel, "run", None)  # (the property loads the kernel: it has run)
        launch = getattr(run, "launch", None)
        if launch is None or getattr(run, "global_scratch_size", 1) or getattr(
                run, "profile_scratch_size", 1):  # fmt: skip
            return None
        metas = {}
        code = getattr(launch, "__code__", None)
        if code is not None:  # Triton's wrapper expanding descriptors: its C launch inside
            names = code.co_freevars
            if code.co_name != "inner" or not {"launcher", "tensordesc_indices",
                                                "tensordesc_meta"} <= set(names):  # fmt: skip
                return None
            cells = dict(zip(names, (c.cell_contents for c in launch.__closure__), strict=True))
            launch = cells["launcher"]
            metas = dict(zip(sorted(cells["tensordesc_indices"]), cells["tensordesc_meta"],
                             strict=True))  # fmt: skip
        by_index = {i: (role, desc, aligned) for i, role, desc, aligned in slots}
        flat, fills = [], []
        for i, value in enumerate(template):
            slot = by_index.get(i)
            if i in metas:
                if slot is None or slot[1] is None or metas[i] is None:
                    return None  # a constant descriptor, or one Triton does not encode
                role, desc, aligned = slot
                fills.append((len(flat), role, desc, metas[i], aligned))
                # the expansion's length and its geometry (a map, then shape and strides)
                shape = list(desc.shape)
                if metas[i]["fp4_padded"]:
                    shape[-1] *= 2
                flat.extend([None, *shape, *desc.strides])
            elif slot is not None:
                if slot[1] is not None:
                    return None
                fills.append((len(flat), slot[0], None, None, slot[2]))
                flat.append(None)
            else:
                flat.append(value)
        head = (kernel.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                kernel.packed_metadata, None, None, None)  # fmt: skip
        return cls(launch, head, flat, tuple(fills))

    def args(self, roles: dict) -> list | None:
        """This call's flattened arguments, or None (a tensor aligned unlike the recording's)."""
        flat = self.flat.copy()
        for (pos, role, desc, meta, aligned), maps in zip(self.fills, self.maps, strict=True):
            t = roles[role]
            ptr = t.data_ptr()
            if (ptr % 16 == 0) != aligned:
                return None
            if desc is None:
                flat[pos] = ptr
                continue
            tmap = maps.get(ptr)
            if tmap is None:
                from triton.backends.nvidia.driver import make_tensordesc_arg

                if len(maps) >= self.MAPS_KEPT:
                    maps.clear()
                tmap = maps[ptr] = make_tensordesc_arg(_rebased(desc, t), meta)[0]
            flat[pos] = tmap
        return flat

    def run(self, grid: tuple, device: int, args: list) -> None:
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        self.launch(grid[0], g1, g2, torch._C._cuda_getCurrentRawStream(device), *self.head,
                    *args)  # fmt: skip


# Replays call the C launchers directly (_Direct); DIYFA_DIRECT_LAUNCH=0 keeps Triton's
# Python launcher in between (for comparisons), read at import.
DIRECT = os.environ.get("DIYFA_DIRECT_LAUNCH", "1") != "0"


_replay_caches: list = []  # every ReplayCache, for forget_replays


class ReplayCache:
    """Signature -> value (a :class:`Replay`, or a tuple holding one), least recently used
    dropped past ``size``; thread-safe. ``forget_replays()`` empties every one (when what a
    launch would choose changes: pinned configs, launch settings under test)."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._items: dict = {}
        self._lock = threading.Lock()
        _replay_caches.append(self)

    def get(self, key):
        with self._lock:
            value = self._items.pop(key, None)
            if value is not None:
                self._items[key] = value  # most recently used last
            return value

    def put(self, key, value) -> None:
        if value is None:
            return
        with self._lock:
            self._items.pop(key, None)
            if len(self._items) >= self.size:
                del self._items[next(iter(self._items))]
            self._items[key] = value

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


def forget_replays() -> None:
    """Empty every :class:`ReplayCache`: the next call of each signature takes the full path
    (and records again)."""
    for cache in _replay_caches:
        cache.clear()
