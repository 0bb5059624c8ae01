"""Counting device -> host reads (host syncs) in a block of code, for the engine's benchmark.

Owns :func:`count_host_syncs`: while active, every ``Tensor.item``, ``tolist``, ``__bool__``,
``__int__``, ``__float__`` and ``__index__`` call is counted — the reads that make the host wait
for the device on CUDA (on a CPU they cost a little Python, no wait). Host-to-device copies are
not counted. Patches ``torch.Tensor`` for the duration only; not thread-safe, not for production.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@dataclasses.dataclass
class SyncCount:
    total: int = 0


@contextlib.contextmanager
def count_host_syncs() -> Iterator[SyncCount]:
    count = SyncCount()
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def counted(fn):
        def wrapper(self, *args, **kwargs):
            count.total += 1
            return fn(self, *args, **kwargs)
        return wrapper

    try:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, counted(fn))
        yield count
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
