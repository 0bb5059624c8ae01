"""Counting Triton's kernel compiles in a block of code.

Owns :func:`count_compiles`. A Triton kernel compiles once per key of its specialization, at its
first launch under that key; each compile costs about a second on a GPU. In a timed rollout that
is time spent neither drafting nor verifying: the rollout bench records it for each variant, beside
graph captures. Triton's runtime calls one hook before a compile and one after
(``triton.knobs.runtime.jit_cache_hook`` and ``jit_post_compile_hook``); this wraps both for the
block, keeping any hook already set. Without Triton, or where nothing compiles (the CPU runs the
attention's torch path), the count stays 0. One thread; for benches, not for production.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator


@dataclasses.dataclass
class Compiles:
    count: int = 0
    seconds: float = 0.0
    kernels: list[str] = dataclasses.field(default_factory=list)  # the compiled functions' names, in order


@contextlib.contextmanager
def count_compiles() -> Iterator[Compiles]:
    """The compiles Triton makes inside the block: how many, their seconds and kernels."""
    found = Compiles()
    try:
        from triton import knobs
    except ImportError:
        yield found
        return
    rt = knobs.runtime
    before, after = rt.jit_cache_hook, rt.jit_post_compile_hook
    started: list[float] = []

    def pre(*args, **kwargs):
        started.append(time.perf_counter())
        return before(*args, **kwargs) if before is not None else False  # truthy would skip the compile

    def post(*args, **kwargs):
        if started:
            found.seconds += time.perf_counter() - started.pop()
        found.count += 1
        found.kernels.append(getattr(kwargs.get("fn"), "name", "?").rsplit(".", 1)[-1])
        return after(*args, **kwargs) if after is not None else None

    rt.jit_cache_hook, rt.jit_post_compile_hook = pre, post
    try:
        yield found
    finally:
        rt.jit_cache_hook, rt.jit_post_compile_hook = before, after
