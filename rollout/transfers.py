"""The engine's mark on the host <-> device transfers it means to make.

Owns :func:`intended_sync`: the step's packed read and upload, prefill, leaving requests run inside
it; under ``torch.cuda.set_sync_debug_mode("error")`` (the GPU tests) those are exempt, and any
other synchronising call fails. Counting transfers (on any device) is the benches' and the tests'
(:mod:`tlt.bench.transfer_count`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def intended_sync(device: torch.device) -> Iterator[None]:
    """A transfer the engine means to make: exempt from CUDA's sync debug mode while inside."""
    mode = torch.cuda.get_sync_debug_mode() if device.type == "cuda" else 0
    if mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        if mode:
            torch.cuda.set_sync_debug_mode(mode)
