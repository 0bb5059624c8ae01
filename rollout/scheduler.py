"""The engine's queue: which waiting requests join the running batch, in what order, and which
running ones go back to the queue when a paged cache runs short.

Owns the waiting queue (arrival order; evicted requests go back to its front with their state and
ids), the request ids, admission (by free rows and, with a paged cache, free blocks: each running
row is spared a block to grow into), each running request's admission number (the eviction rule's
age, :mod:`tlt.rollout.eviction`), and the lifecycle counts (joined, left, aborted, evicted) with
the evictions and recomputed tokens of the step being prepared. Host bookkeeping only: its one
owner, :class:`~tlt.rollout.engine.RolloutEngine`, runs the prefills and the steps and tells it
which requests joined and which left, from the thread that owns the engine.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence

from tlt.rollout.blocks import BlockPool
from tlt.rollout.eviction import Candidate, choose_victims
from tlt.rollout.request import Finished, RequestState


class Scheduler:
    def __init__(self, max_batch: int, pool: BlockPool | None, eviction: str) -> None:
        self.max_batch, self.pool, self.eviction = max_batch, pool, eviction
        self.queue: list[tuple[int, RequestState]] = []  # (id, state) waiting for a row, in arrival order
        self.lifecycle: collections.Counter[str] = collections.Counter()  # joined, left, aborted, evicted
        self._next_rid = 0
        self._admitted = 0  # admissions so far
        self._admitted_at: dict[int, int] = {}  # running request -> its admission number
        self._evicted: set[int] = set()  # evicted requests waiting to come back
        self._evicted_now = 0  # evictions since the last step's record
        self._recomputed_now = 0  # tokens re-prefilled for evicted requests since then

    def add(self, requests: Sequence[RequestState]) -> list[int]:
        """Queue requests (checked by the engine); their ids, in order."""
        rids = list(range(self._next_rid, self._next_rid + len(requests)))
        self._next_rid += len(requests)
        self.queue.extend(zip(rids, requests))
        return rids

    @property
    def holds_evicted(self) -> bool:
        """Evicted requests wait to come back (their generation goes on)."""
        return bool(self._evicted)

    def admissible(self, running: int) -> int:
        """How many of the queue's first requests join now, after ``running`` rows."""
        n = min(self.max_batch - running, len(self.queue))
        if n <= 0 or self.pool is None:
            return max(n, 0)
        spare = self.pool.free - running
        for k, (_, st) in enumerate(self.queue[:n]):
            spare -= self.pool.blocks_for(len(st.prompt) + len(st.output) + 1) + 1
            if spare < 0 and (k or running):  # (an idle pool holds any one request: the engine checked)
                return k
        return n

    def take(self, n: int, running: int) -> list[tuple[int, RequestState]]:
        """The queue's first ``n`` join after ``running`` rows: each gets its admission number; one
        back from an eviction counts its tokens as recomputed, any other counts as joined (a
        generation's first batch joins nothing)."""
        batch, self.queue = self.queue[:n], self.queue[n:]
        joined = 0
        for rid, st in batch:
            self._admitted_at[rid], self._admitted = self._admitted, self._admitted + 1
            if rid in self._evicted:
                self._evicted.discard(rid)
                self._recomputed_now += len(st.prompt) + len(st.output) - 1
            else:
                joined += 1
        if running:
            self.lifecycle["joined"] += joined
        return batch

    def snapshot(self) -> tuple:
        """The queue and admission state, for :meth:`restore` if an admission fails."""
        return (list(self.queue), self._admitted, dict(self._admitted_at), set(self._evicted), self._recomputed_now,
                self.lifecycle.copy())

    def restore(self, snap: tuple) -> None:
        """Back to a :meth:`snapshot` (the batch taken since waits again, as it was)."""
        queue, self._admitted, admitted_at, evicted, self._recomputed_now, lifecycle = snap
        self.queue, self._admitted_at, self._evicted = list(queue), dict(admitted_at), set(evicted)
        self.lifecycle = lifecycle.copy()

    def victims(self, running: Sequence[int], tokens: Mapping[int, int], short: int) -> list[int]:
        """Running requests to evict, by the configured rule, to free ``short`` blocks of the paged
        cache (never the last one); ``tokens``: each one's prompt and tokens so far."""
        cands = [Candidate(rid, len(self.pool.held(rid)), tokens[rid], self._admitted_at[rid]) for rid in running]
        return choose_victims(cands, short, self.eviction)

    def evicted(self, left: list[Finished]) -> None:
        """Evicted requests (out of their rows) wait at the queue's front with their state and ids."""
        self.queue[:0] = [(f.rid, f.state) for f in left]
        self._evicted |= {f.rid for f in left}
        self._evicted_now += len(left)
        self.lifecycle["evicted"] += len(left)

    def left_row(self, rid: int) -> None:
        """A running request left its row (finished, removed or evicted)."""
        self._admitted_at.pop(rid, None)

    def remove(self, rids: list[int], running: Sequence[int], reason: str) -> list[Finished]:
        """Requests leave by ``reason`` (``left``, ``aborted``): each must run or wait here, once.
        Returns the waiting ones as finished; the engine retires the running ones."""
        here = set(running) | {r for r, _ in self.queue}
        unknown = [r for r in rids if r not in here]
        if unknown or len(set(rids)) != len(rids):
            raise ValueError(f"requests {unknown or rids}: not running or waiting here, or given twice")
        out = [Finished(r, st, reason) for r, st in self.queue if r in rids]
        self.queue = [(r, st) for r, st in self.queue if r not in rids]
        self._evicted -= set(rids)
        self.lifecycle[reason] += len(rids)
        return out

    def step_counts(self) -> tuple[int, int]:
        """Evictions and recomputed tokens since the last call (the next step's record)."""
        out = self._evicted_now, self._recomputed_now
        self._evicted_now = self._recomputed_now = 0
        return out
