"""One simulated rollout over a cluster of replicas, driven by measured step costs.

Owns :func:`simulate`: requests of known lengths decode on ``replicas`` replicas; a replica
running ``n`` requests commits ``rate(n)`` tokens per second to each (its step-cost curve, with
speculation where it pays); consolidation may move requests between replicas at every decision
tick; a round may end early (``until``: RollPacker's short round aborts what is left). Pure Python,
no torch: the cluster-scale bench (``tlt bench cluster``) runs it at 8-256 replicas.

Events are request completions and decision ticks. Between two of its events a replica runs at a
constant batch, so all its requests advance by ``elapsed * rate(n)`` tokens (fractional steps), kept
as one progress counter per replica: a rollout costs O(requests x log) plus O(replicas) per decision
tick, not one event per engine step. A moved request costs its
destination ``move_s`` (its re-prefill), during which that replica commits nothing.

Per replica the result keeps its busy seconds and when it last decoded; from those come the GPU
seconds idle during the rollout and the replica-seconds left for drafter training (each replica's
idle time after its last request, until the rollout ends: a spot session needs the replica to stay
free, so idle gaps before a later arrival do not count).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tlt.coordinator.consolidation import Plan, ReplicaLoad, RequestLoad, StepCurve

Rate = Callable[[int], float]  # batch -> tokens per second committed to each running request


@dataclass(frozen=True)
class Speed:
    """A replica's decoding speed by batch: plain steps, and speculative ones where they pay.

    ``plain`` and ``spec``: seconds per engine step by batch; ``accept``: tokens a speculative step
    commits per request (the accept length; a function of the batch). The engine's tuner picks the
    faster of the two per batch (its "off" arm), which :meth:`rate` does exactly.
    """

    plain: StepCurve
    spec: StepCurve | None = None
    accept: Callable[[int], float] | None = None

    def __post_init__(self) -> None:
        if (self.spec is None) != (self.accept is None):
            raise ValueError("Speed: give spec and accept together, or neither")

    def rate(self, n: int) -> float:
        plain = 1.0 / self.plain.cost(n)
        if self.spec is None or n < 1:
            return plain
        return max(plain, self.accept(n) / self.spec.cost(n))

    def scaled(self, factor: float) -> Speed:
        """The same speed ``factor`` times faster (a tensor-parallel group, say)."""
        def scale(c: StepCurve | None) -> StepCurve | None:
            return None if c is None else StepCurve(tuple((b, s / factor) for b, s in c.points))
        return Speed(scale(self.plain), scale(self.spec), self.accept)


@dataclass
class Request:
    rid: str
    length: float  # tokens it generates in all
    group: int = 0
    done: float = 0.0  # tokens so far (up to date at decisions and at the end of a round)
    finished_at: float | None = None
    aborted: bool = False
    base: float = 0.0  # its replica's progress counter when it had done 0 tokens there

    @property
    def remaining(self) -> float:
        return self.length - self.done


@dataclass
class Replica:
    """Every running request of a replica advances at the same rate, so one progress counter
    (tokens per request since the replica started) stands for all of them; a request's tokens are
    ``progress - base``, and it finishes when the counter reaches ``length + base``."""

    rank: int
    speed: Speed
    running: dict[str, Request] = field(default_factory=dict)
    stalled_until: float = 0.0  # re-prefilling moved-in requests until then
    busy_s: float = 0.0
    last_busy: float = 0.0  # when it last had a request
    progress: float = 0.0
    t: float = 0.0  # the time ``progress`` is at
    ends: list = field(default_factory=list)  # heap of (length + base, rid); stale entries skipped

    def join(self, r: Request) -> None:
        r.base = self.progress - r.done
        self.running[r.rid] = r
        heapq.heappush(self.ends, (r.length + r.base, r.rid))

    def leave(self, rid: str) -> Request:
        r = self.running.pop(rid)
        r.done = self.progress - r.base
        return r

    def advance(self, t: float) -> None:
        if t <= self.t:
            return
        if self.running:
            start = max(self.t, self.stalled_until)
            if t > start:
                self.progress += (t - start) * self.speed.rate(len(self.running))
            self.busy_s += t - self.t
            self.last_busy = t
        self.t = t

    def sync(self) -> None:
        """Bring every running request's ``done`` up to date (for consolidation's view)."""
        for r in self.running.values():
            r.done = min(r.length, self.progress - r.base)

    def _first_end(self) -> float | None:
        while self.ends and (self.ends[0][1] not in self.running
                             or self.running[self.ends[0][1]].length + self.running[self.ends[0][1]].base
                             != self.ends[0][0]):
            heapq.heappop(self.ends)
        return self.ends[0][0] if self.ends else None

    def next_finish(self) -> float:
        end = self._first_end()
        if end is None:
            return math.inf
        start = max(self.t, self.stalled_until)
        return start + max(0.0, end - self.progress) / self.speed.rate(len(self.running))

    def finish_due(self, now: float) -> list[Request]:
        out = []
        while (end := self._first_end()) is not None and end - self.progress <= 1e-6:
            _, rid = heapq.heappop(self.ends)
            r = self.running.pop(rid)
            r.done, r.finished_at = r.length, now
            out.append(r)
        return out


@dataclass(frozen=True)
class Result:
    seconds: float  # when the round ended
    finished: tuple[Request, ...]
    aborted: tuple[Request, ...]
    busy_s: tuple[float, ...]  # per replica
    train_s: tuple[float, ...]  # per replica: idle from its last request to the end
    moves: int

    @property
    def idle_s(self) -> float:
        """Replica-seconds without a request to decode during the round."""
        return sum(self.seconds - b for b in self.busy_s)

    @property
    def tokens(self) -> float:
        return sum(r.length for r in self.finished) + sum(r.done for r in self.aborted)


Consolidation = Callable[[float, Sequence[Replica], int], Plan | None]  # (now, replicas, step requests) -> plan
Snapshot = Callable[[], Sequence[Replica]]  # the replicas with every request's ``done`` up to date


def place(requests: Sequence[Request], replicas: int) -> list[list[Request]]:
    """TLT's router: a GRPO group's samples go to one replica, the least loaded when the group
    arrives (by requests placed; ties to the lowest rank)."""
    out: list[list[Request]] = [[] for _ in range(replicas)]
    groups: dict[int, list[Request]] = {}
    for r in requests:
        groups.setdefault(r.group, []).append(r)
    for g in groups.values():
        min(out, key=len).extend(g)
    return out


def loads(replicas: Sequence[Replica]) -> list[ReplicaLoad]:
    """Consolidation's view of the replicas (:mod:`tlt.coordinator.consolidation`), in tokens: a step
    commits one token per request at the replica's current rate (``cost`` = seconds per token)."""
    return [ReplicaLoad(rep.rank, tuple(RequestLoad(r.rid, int(r.done), 0, r.remaining) for r in rep.running.values()),
                        token_curve(rep.speed)) for rep in replicas]


@functools.lru_cache(maxsize=64)
def token_curve(speed: Speed) -> StepCurve:
    """Seconds per committed token per request, by batch, at the measured batches."""
    return StepCurve(tuple((b, 1.0 / speed.rate(b)) for b in sorted({b for b, _ in speed.plain.points})))


def simulate(requests: Sequence[Request], speeds: Sequence[Speed], *, consolidation: Consolidation | None = None,
             tick_s: float = 0.0, move_s: float = 0.0,
             until: Callable[[Sequence[Request], Snapshot], bool] | None = None,
             start_s: float = 0.0) -> Result:
    """Run ``requests`` on one replica per entry of ``speeds`` (placed by :func:`place`) until
    all finish, or until ``until(finished, snapshot)`` holds after a request finishes (the rest are
    returned as aborted). ``consolidation`` is asked for moves every ``tick_s`` seconds (0: never).
    ``start_s``: every replica first spends this long before it decodes (a switch's cost)."""
    if consolidation is not None and tick_s <= 0:
        raise ValueError(f"tick_s={tick_s}: consolidation needs a decision interval > 0")
    reps = [Replica(i, s, stalled_until=start_s) for i, s in enumerate(speeds)]
    for rep, rs in zip(reps, place(requests, len(reps))):
        for r in rs:
            rep.join(r)
    events: list[tuple[float, int, int]] = []  # (time, version, rank)
    version = [0] * len(reps)

    def schedule(rep: Replica) -> None:
        version[rep.rank] += 1
        t = rep.next_finish()
        if t < math.inf:
            heapq.heappush(events, (t, version[rep.rank], rep.rank))

    def snapshot() -> Sequence[Replica]:
        for rep in reps:
            rep.advance(now)
            rep.sync()
        return reps

    for rep in reps:
        schedule(rep)
    finished: list[Request] = []
    now, next_tick, moves = 0.0, tick_s if consolidation else math.inf, 0
    stopped = False
    while events:
        t, v, rank = events[0]
        if v != version[rank]:
            heapq.heappop(events)
            continue
        if next_tick <= t:  # a decision first
            now, next_tick = next_tick, next_tick + tick_s
            plan = consolidation(now, snapshot(), len(requests))
            if plan is not None and plan.moves:
                for m in plan.moves:
                    req = reps[m.source].leave(m.rid)
                    dst = reps[m.destination]
                    dst.stalled_until = max(dst.stalled_until, now) + move_s
                    dst.join(req)
                    moves += 1
                for rep in reps:
                    schedule(rep)
            continue
        heapq.heappop(events)
        now = t
        rep = reps[rank]
        rep.advance(now)
        done = rep.finish_due(now)
        finished.extend(done)
        schedule(rep)
        if done and until is not None and until(finished, snapshot):
            stopped = True
            break
    if stopped:
        snapshot()
    aborted = [r for rep in reps for r in rep.running.values()]
    for r in aborted:
        r.aborted = True
    return Result(now, tuple(finished), tuple(aborted), tuple(rep.busy_s for rep in reps),
                  tuple(now - rep.last_busy for rep in reps), moves)


def with_lengths(lengths: Sequence[float], group_size: int = 1) -> list[Request]:
    """Fresh requests of these lengths, ``group_size`` consecutive ones per GRPO group."""
    return [Request(f"r{i}", float(n), group=i // group_size) for i, n in enumerate(lengths)]


def reset(requests: Sequence[Request]) -> list[Request]:
    """Copies of ``requests`` with no progress (the same work for another system)."""
    return [dataclasses.replace(r, done=0.0, finished_at=None, aborted=False) for r in requests]
