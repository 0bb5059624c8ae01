"""The attention kernel as Triton builds it for an H100 (sm_90), on a machine without a GPU.

Owns :func:`record_launches`, which swaps the kernel's two launches for stand-ins that bind each
launch's arguments as Triton's JIT binds them for an H100 (nothing runs on a device), and
:func:`resources`, which compiles one bound launch with Triton's own compiler and reads what its
bundled ptxas allocates (registers and spills per thread), with the shared memory Triton lays out.
Both need Triton's CUDA backend (the dev extra pins Triton 3.6; its internals used here are 3.6's).
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import tempfile
from pathlib import Path

TARGET = ("cuda", 90, 32)  # an H100: compute capability 9.0, warps of 32
SMS = 132  # an H100 SXM's multiprocessors
REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024  # bytes; each resident program also reserves 1 KiB
MAX_WARPS_PER_SM = 64


def backend():
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    return CUDABackend(GPUTarget(*TARGET))


@dataclasses.dataclass(frozen=True)
class Launch:
    kernel: str  # _partials or _merge
    fn: object  # the JITFunction
    bound: tuple  # (bound arguments, specialization, options) as Triton's binder returns them


def record_launches(monkeypatch, on_launch=None) -> list[Launch]:
    """Patch :mod:`tlt.rollout.attention_triton`'s kernels: each launch appends its bound arguments
    (for an H100 target) to the returned list, or hands them to ``on_launch``, and runs nothing."""
    import pytest
    from triton.runtime.jit import create_function_from_signature

    from tlt.rollout import attention_triton as at

    if at.INTERPRET:
        pytest.skip("the kernel as compiled for a GPU: not under TRITON_INTERPRET=1 (its interpreter)")
    launches: list[Launch] = []
    target = backend()

    class StandIn:
        def __init__(self, fn):
            self.fn, self.bind = fn, create_function_from_signature(fn.signature, fn.params, target)

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                (on_launch or launches.append)(Launch(self.fn.__name__, self.fn, self.bind(*args, **kwargs)))
            return launch

    monkeypatch.setattr(at, "_partials", StandIn(at._partials))
    monkeypatch.setattr(at, "_merge", StandIn(at._merge))
    return launches


@dataclasses.dataclass(frozen=True)
class Resources:
    registers: int  # per thread
    spill_bytes: int  # spill stores per thread
    shared: int  # bytes per program
    warps: int

    def by_registers(self) -> int:
        """Programs of this kernel an H100 multiprocessor's registers hold (allocated per warp in
        units of 256)."""
        return REGISTERS_PER_SM // (-(-self.registers * 32 // 256) * 256 * self.warps)

    def by_shared_memory(self) -> int:
        """Programs its shared memory holds (each with a 1 KiB reserve), and its warp slots."""
        return min(SHARED_PER_SM // (self.shared + 1024), MAX_WARPS_PER_SM // self.warps)

    def programs_per_sm(self) -> int:
        return min(self.by_registers(), self.by_shared_memory())


def resources(launch: Launch) -> Resources:
    """Compile ``launch`` for sm_90a (Triton's compiler, no device) and read ptxas's allocation."""
    import triton
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource
    from triton.runtime.jit import find_paths_if, get_iterable_path

    target = backend()
    args, spec, opts = launch.bound
    values = [s[0] for s in spec]
    signature = dict(zip([p.name for p in launch.fn.params], values))
    constexprs = {p: get_iterable_path(list(args.values()), p)
                  for p in find_paths_if(values, lambda _, v: v == "constexpr")}
    attrs = [s[1] for s in spec]
    attrs = {p: target.parse_attr(get_iterable_path(attrs, p))
             for p in find_paths_if(attrs, lambda _, a: isinstance(a, str))}
    options = target.parse_options(opts)
    kernel = triton.compile(ASTSource(launch.fn, signature, constexprs, attrs), target=target.target,
                            options=options.__dict__)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        log = subprocess.run([get_ptxas(target.target.arch).path, "-v", "--gpu-name=sm_90a", str(ptx), "-o",
                              str(Path(tmp) / "k.cubin")], capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    return Resources(regs, spills, kernel.metadata.shared, options.num_warps)
