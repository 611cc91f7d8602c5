"""Compile a Triton or Gluon kernel for an sm90a GPU without one (Triton bundles ptxas).

For the CPU tests that Hopper kernels compile and fit (shared memory, registers, spills), and
for reading their PTX. Run it in a process that has not run kernels under the Triton
interpreter, which leaves Triton's language module patched.
"""

from __future__ import annotations


def compile_for_sm90(fn, args: dict, num_warps: int, num_stages: int | None = None,
                     arch: int = 90, maxnreg: int | None = None):
    """Triton's ``CompiledKernel`` of ``fn`` (``@triton.jit`` or ``@gluon.jit``) specialised on
    ``args`` (every parameter by name: constexprs by value, the others as Triton's launcher
    would see them: integers equal to 1 compiled in, 16-byte-aligned pointers and integers
    divisible by 16 marked so, which is what lets loads vectorise); ``.asm["ptx"]``,
    ``.metadata``. ``arch``: another compute capability (89: an sm89 GPU's limits) for
    Triton kernels."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    target = GPUTarget("cuda", arch, 32)
    backend = CUDABackend(target)
    signature, constants, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constants[(i,)] = args[p.name]
        else:
            kind, spec = native_specialize_impl(backend, args[p.name], False, True, True)[:2]
            signature[p.name] = kind
            if kind == "constexpr":  # an int equal to 1 is compiled in
                constants[(i,)] = args[p.name]
            elif isinstance(spec, str):  # "D": 16-divisible pointer or int, as a launch sees
                attrs[(i,)] = backend.parse_attr(spec)
    source = GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(source(fn, signature, constants, attrs), target=target, options=options)


def sass(kernel) -> str:
    """The SASS of a ``CompiledKernel`` for sm90a (its cubin through the cuobjdump that
    Triton bundles with ptxas), for reading the machine code without a GPU."""
    import os
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")  # fmt: skip
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    finally:
        os.unlink(f.name)


def _ptxas_report(kernel, arch: str) -> str:
    """What ptxas (Triton's) reports (``-v``) compiling a ``CompiledKernel``'s PTX."""
    import os
    import subprocess
    import tempfile

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    try:
        done = subprocess.run([ptxas, f"-arch={arch}", "-v", f.name, "-o", os.devnull],
                              capture_output=True, text=True, check=True)  # fmt: skip
    finally:
        os.unlink(f.name)
    return done.stderr


def spill_bytes(kernel, arch: str = "sm_90a") -> int:
    """The bytes of spill stores ptxas (Triton's) reports for a ``CompiledKernel``'s PTX."""
    return int(_ptxas_report(kernel, arch).split(" bytes spill stores")[0].rsplit(" ", 1)[-1])


def registers(kernel, arch: str = "sm_90a") -> int:
    """The registers a thread of a ``CompiledKernel`` takes, as ptxas (Triton's) reports."""
    return int(_ptxas_report(kernel, arch).split(" registers")[0].rsplit(" ", 1)[-1])
