"""tlt.bench.compiles: Triton's compiles counted through the hooks its runtime calls around one.

No GPU here, so nothing really compiles: the test gives a real ``triton.jit`` kernel a binder for an
H100 target and a stand-in for the compiler (``compile``: the one part that needs the CUDA
toolchain's output), then drives Triton's own ``_do_compile``, which calls the hooks as a launch
does."""

from __future__ import annotations

import pytest

from tlt.bench.compiles import count_compiles

triton = pytest.importorskip("triton", reason="counting Triton's compiles needs triton (the dev extra)")
nvidia = pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's CUDA backend")


def _kernel():
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import create_function_from_signature

    @triton.jit
    def fill(X, B: tl.constexpr):
        tl.store(X + tl.arange(0, B), tl.zeros([B], tl.float32))

    backend = nvidia.CUDABackend(GPUTarget("cuda", 90, 32))
    fill.device_caches[0] = ({}, {}, backend.target, backend, create_function_from_signature(
        fill.signature, fill.params, backend))
    fill.compile = lambda src, target, options: "a compiled kernel"  # stand-in: the compiler's output
    fill.ASTSource = lambda *args: None
    return fill, backend.parse_options({})


def test_compiles_are_counted_and_hooks_already_set_still_run():
    from triton import knobs

    fill, options = _kernel()
    seen = []
    before = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    ours = knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["fn"].name.rsplit(".", 1)[-1])
    try:
        with count_compiles() as found:
            for size in (16, 32):
                key, constexprs = f"B={size}", {(1,): size}
                assert fill._do_compile(key, {"X": "*fp32", "B": "constexpr"}, 0, constexprs, options, {}, False)
        assert (found.count, found.kernels, seen) == (2, ["fill", "fill"], ["fill", "fill"])
        assert found.seconds >= 0
        assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == (before[0], ours)
        with count_compiles() as none:
            pass
        assert none.count == 0
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before
