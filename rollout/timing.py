"""Timing a stretch of device work: CUDA events on CUDA, the host clock elsewhere.

Owns :class:`Span`. Once a step's work is asynchronous, a host ``perf_counter`` span around it
measures only the launches; a pair of CUDA events measures the stretch on the device's stream. Read
:meth:`Span.seconds` after the host has synchronised with the stream past the span's end (the
engine does so once per step, with its packed read).
"""

from __future__ import annotations

import time

import torch


class Span:
    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._start = self._end = None
        self._t0 = self._t1 = 0.0

    def start(self) -> "Span":
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        self._t0 = time.perf_counter()
        return self

    def stop(self) -> "Span":
        if self.cuda:
            self._end = torch.cuda.Event(enable_timing=True)
            self._end.record()
        self._t1 = time.perf_counter()
        return self

    def seconds(self) -> float:
        """The span's length (0.0 if it never ran)."""
        if self.cuda and self._start is not None and self._end is not None:
            return self._start.elapsed_time(self._end) / 1000.0
        return max(self._t1 - self._t0, 0.0)
