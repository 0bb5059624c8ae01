"""The replica's request batcher: verl's concurrent per-request ``generate`` calls -> engine batches.

Owns the queue of pending requests, the in-flight count and the loop that forms batches: requests
that arrive within ``window_s`` of each other decode together (up to ``max_batch``); later ones
form the next batch. A batch runs in a worker thread (``run``); when the queue drains and nothing
is in flight, ``on_idle`` is called (in the event loop: it must not block). A failing batch fails
its own requests only; the loop never dies.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from tlt.rollout.generate import SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    seed: int  # the request's seed (verl's sampling_params["seed"]), else unique to the replica
    future: asyncio.Future


class RequestBatcher:
    def __init__(self, run: Callable[[list[Request]], list[Any]], on_idle: Callable[[], None], *,
                 window_s: float, max_batch: int, name: str = "replica") -> None:
        self.run, self.on_idle = run, on_idle
        self.window_s, self.max_batch, self.name = window_s, max_batch, name
        self.pending: collections.deque[Request] = collections.deque()
        self.inflight = 0  # submitted and not answered yet (queued or decoding)
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None

    async def submit(self, prompt: list[int], params: SamplingParams, seed: int) -> Any:
        """Queue one request and wait for its result (what ``run`` returned for it)."""
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())
        fut = asyncio.get_running_loop().create_future()
        self.pending.append(Request(prompt, params, seed, fut))
        self.inflight += 1
        self._wake.set()
        return await fut

    @property
    def idle(self) -> bool:
        return self.inflight == 0

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._serve_pending()
            except Exception:  # never let the loop die: later requests would wait forever
                log.exception("%s: batcher error", self.name)

    async def _serve_pending(self) -> None:
        if not self.pending:
            return
        while True:  # wait until requests stop arriving for one window
            n = len(self.pending)
            await asyncio.sleep(self.window_s)
            if len(self.pending) == n or n >= self.max_batch:
                break
        batch = [self.pending.popleft() for _ in range(min(len(self.pending), self.max_batch))]
        try:
            results = await asyncio.to_thread(self.run, batch)
        except Exception as e:  # every waiter learns the error; the server keeps serving
            log.exception("%s: batch of %d failed", self.name, len(batch))
            results = [e] * len(batch)
        finally:
            self.inflight -= len(batch)
        for req, res in zip(batch, results):
            if req.future.done():  # the caller went away
                continue
            if isinstance(res, Exception):
                req.future.set_exception(res)
            else:
                req.future.set_result(res)
        if self.pending:
            self._wake.set()
        elif self.inflight == 0:
            self.on_idle()
