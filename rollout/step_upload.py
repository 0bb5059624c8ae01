"""A step's one host -> device copy.

Owns :class:`StepUpload`. What the host decides between two steps and the device needs for the
next one (a paged cache's grown block tables, a model-free proposer's draft trees) is added here as
integers, each part with what to do with its device tensor once it lands; :meth:`StepUpload.flush`
sends every part in one copy (from pinned memory, not blocking the host, on CUDA) and hands each
its slice. The engine makes one per step and flushes it before the device reads what is pending:
before a proposer that reads the tables, else after the proposer added its trees, so a step makes
at most one upload and one read (:mod:`tlt.bench.transfer_count` counts them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tlt.rollout.transfers import intended_sync


class StepUpload:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._parts: list[tuple[list[int], tuple[int, ...], Callable[[torch.Tensor], None]]] = []
        self.flushes = 0  # copies made (a test reads it)

    @property
    def pending(self) -> bool:
        return bool(self._parts)

    def add(self, values: Sequence[int], shape: tuple[int, ...], then: Callable[[torch.Tensor], None]) -> None:
        """Send ``values`` (ints, ``shape`` when they land: a long tensor) with the next flush, which
        calls ``then`` with them on the device."""
        values = [int(v) for v in values]
        n = 1
        for s in shape:
            n *= s
        if n != len(values):
            raise ValueError(f"{len(values)} values do not fill the shape {shape}")
        self._parts.append((values, tuple(shape), then))

    def flush(self) -> None:
        """One copy of every pending part, then each part's ``then`` in the order they were added."""
        if not self._parts:
            return
        parts, self._parts = self._parts, []
        with intended_sync(self.device):  # the step's one upload
            packed = torch.tensor([v for values, _, _ in parts for v in values], dtype=torch.long)
            if self.device.type == "cuda":
                packed = packed.pin_memory()
            packed = packed.to(self.device, non_blocking=True)
        self.flushes += 1
        at = 0
        for values, shape, then in parts:
            then(packed[at: at + len(values)].view(shape))
            at += len(values)
