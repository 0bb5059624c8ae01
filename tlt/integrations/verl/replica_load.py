"""A replica's load as consolidation reads it: its running requests' progress and its measured costs.

Owns :class:`Load` (what a replica reports: ``TLTServer.replica_load``) and :class:`LoadMeter`,
which the batcher's worker thread feeds after each engine step: the step's cost by batch size (a
running mean over about the last 64 steps at each size), the extra cost of a request joining a
running batch (its re-prefill), tokens committed per request per step, and the running requests.
Consolidation (:mod:`tlt.coordinator.consolidation`) turns these into its step-cost curve and
drain times.

Owner and order: the worker thread writes (``measure``, ``publish``, ``clear``); any thread reads
the last published :class:`Load` (``load``). ``_mu`` guards only the published value.
"""

from __future__ import annotations

import dataclasses
import threading

from tlt.rollout.engine import StepRecord


@dataclasses.dataclass(frozen=True)
class Load:
    requests: tuple[tuple[str, int, int, int], ...]  # running: (key, tokens so far, accepted here, max new)
    step_s: dict[int, float]  # batch size -> seconds per step (running mean of this replica's steps)
    join_s: float | None  # seconds a joining request added to its step (mean), None: none measured
    tokens_per_step: float  # tokens committed per request per step (recent mean)


class LoadMeter:
    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._load = Load((), {}, None, 1.0)  # published (guarded by _mu)
        self._step_s: dict[int, tuple[float, int]] = {}  # batch -> (mean seconds, count) (worker)
        self._join: tuple[float, int] = (0.0, 0)  # (mean extra seconds per joining request, count) (worker)
        self._tps: float = 1.0  # tokens per request per step, running mean (worker)

    def load(self) -> Load:
        with self._mu:
            return self._load

    def measure(self, rec: StepRecord, seconds: float, joined: int) -> None:
        """One step's cost (``seconds``: the whole ``step()``) into the curve (steps without joins)
        or the join cost (a step in which ``joined`` requests joined running ones: its excess over
        the curve at that batch, per joining request)."""
        if rec.batch < 1 or rec.evicted or rec.recomputed:  # (re-prefills are no join and no plain step)
            return
        if joined:
            base = self._step_s.get(rec.batch)
            if base is not None:
                mean, n = self._join
                self._join = ((mean * n + max(seconds - base[0], 0.0) / joined) / (n + 1), n + 1)
            return
        mean, n = self._step_s.get(rec.batch, (0.0, 0))
        n = min(n, 63)  # a running mean over about the last 64 steps at this batch size
        self._step_s[rec.batch] = ((mean * n + seconds) / (n + 1), n + 1)
        self._tps = 0.9 * self._tps + 0.1 * (rec.committed / rec.batch)

    def publish(self, requests: list[tuple[str, int, int, int]]) -> None:
        """The running requests after a step, with the costs measured so far."""
        mean, n = self._join
        load = Load(tuple(requests), {b: s for b, (s, _) in self._step_s.items()}, mean if n else None, self._tps)
        with self._mu:
            self._load = load

    def clear(self) -> None:
        """The generation ended: nothing runs (the costs stay)."""
        with self._mu:
            self._load = dataclasses.replace(self._load, requests=())
