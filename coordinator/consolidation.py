"""Consolidation: which running requests move between rollout replicas in the tail, and where.

Pure logic, in the style of :mod:`tlt.coordinator.promotion`: no sockets, no clock, no torch. In go each
replica's running requests with their progress, whether it is in a spot session, and its measured
step-cost curve; out come moves (request, source, destination). The rollout's tail then runs on
fewer replicas (consolidation) or evenly (reallocation), and the engine's request lifecycle carries
the moves out losslessly (leave, then join with the request's state).

Rules
- Step cost (:class:`StepCurve`): seconds per engine step at batch ``b``, piecewise linear through
  measured points; past the largest measured batch it grows in proportion to the batch (a batch
  no replica ran is never assumed cheap), below the smallest it stays at that one's cost.
  Throughput is ``b / cost(b)`` requests per
  second (times the tokens a step commits per request, the same for every plan).
- Drain time of a replica: its requests' remaining tokens sorted ``r_1 <= ... <= r_n``; it runs
  ``r_1`` steps at batch ``n``, then ``r_2 - r_1`` at ``n - 1``, and so on (the long tail), each
  step committing ``tokens_per_step`` tokens per request. A moved request costs its destination
  ``move_s`` first (its re-prefill).
- Reallocation (RLHFSpec section 6): ``theta`` is the knee of the throughput curve, the smallest
  batch whose throughput reaches ``knee`` of the best over ``1..max_batch``. Replicas sorted by
  running requests pair up, the most loaded with the least loaded, the second with the second,
  and so on, each replica in at most one pair per decision; a pair moves ``min(n_s - theta,
  theta - n_d)`` requests when that is positive, the source's shortest first (fewest generated
  tokens, then fewest accepted). Sources keep at least ``theta``, destinations end with at most it.
- Consolidation (RLHFuse section 4.2): once the requests left ``R`` are at most ``remaining_share``
  of the step's requests, they go onto ``m = max(ceil(R / max_batch), ceil(R * M / C))`` replicas
  (``M``: the KV bytes of a max-length request, ``C``: a replica's KV bytes; the second term only
  when both are known): the ``m`` with the most running requests stay (fewest moves), the others'
  requests fill the least loaded of them first, at most ``max_batch`` each.
- A replica in a spot session is never a destination (it is training; a request would stop it).
- Choice (``mode="auto"``): each plan (none, reallocation, consolidation) is scored by what it
  frees and what it costs: ``train_value x`` the replica-seconds replicas sit idle before the
  rollout ends (what spot training can use) ``- replicas x`` the seconds it adds to the rollout (every
  replica and the trainer wait for the tail). The best score wins; ties go to fewer moves. Here
  consolidation is a candidate at every decision, not only below ``remaining_share`` (RLHFuse's
  fixed trigger, which ``mode="consolidate"`` keeps): the score decides when the tail is short
  enough for it to pay.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

MODES = ("off", "reallocate", "consolidate", "auto")


@dataclass(frozen=True, kw_only=True)
class ConsolidationConfig:
    mode: str = "auto"
    knee: float = 0.9  # theta: the smallest batch reaching this share of the best throughput
    remaining_share: float = 0.2  # consolidate once at most this share of the step's requests run
    max_batch: int = 64  # requests one replica decodes together (RLHFuse's BS_max)
    kv_request_bytes: int | None = None  # KV of a max-length request (RLHFuse's M)
    kv_capacity_bytes: int | None = None  # a replica's KV memory (RLHFuse's C)
    move_s: float = 0.0  # seconds a moved request costs its destination (its re-prefill)
    train_value: float = 0.5  # rollout seconds one replica-second of spot training is worth

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"tail mode={self.mode!r}: one of {MODES}")
        if not 0 < self.knee <= 1:
            raise ValueError(f"tail knee={self.knee}: in (0, 1]")
        if not 0 <= self.remaining_share <= 1:
            raise ValueError(f"tail remaining_share={self.remaining_share}: in [0, 1]")
        if self.max_batch < 1:
            raise ValueError(f"tail max_batch={self.max_batch}: >= 1")
        if (self.kv_request_bytes is None) != (self.kv_capacity_bytes is None) or (
                self.kv_request_bytes is not None and min(self.kv_request_bytes, self.kv_capacity_bytes) <= 0):
            raise ValueError("tail kv_request_bytes and kv_capacity_bytes: both > 0, or both unset")
        if self.move_s < 0:
            raise ValueError(f"tail move_s={self.move_s}: >= 0")
        if self.train_value < 0:
            raise ValueError(f"tail train_value={self.train_value}: >= 0")


@dataclass(frozen=True)
class StepCurve:
    """Seconds per engine step by batch size, from measured (batch, seconds) points."""

    points: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        pts = tuple(sorted((int(b), float(s)) for b, s in self.points))
        if not pts or pts[0][0] < 1 or any(s <= 0 for _, s in pts) or len({b for b, _ in pts}) != len(pts):
            raise ValueError(f"StepCurve needs distinct batches >= 1 with seconds > 0, got {self.points}")
        object.__setattr__(self, "points", pts)
        object.__setattr__(self, "_batches", tuple(b for b, _ in pts))

    def cost(self, b: int) -> float:
        """Interpolated between measured batches; below the smallest, its cost; above the largest,
        proportional to the batch (throughput no better than measured: a batch no replica ran is
        never assumed cheap, which would make piling the tail onto one replica look free)."""
        pts = self.points
        (lo, s_lo), (hi, s_hi) = pts[0], pts[-1]
        if b <= lo:
            return s_lo
        if b >= hi:
            return s_hi * b / hi
        i = bisect.bisect_left(self._batches, b)
        (b0, s0), (b1, s1) = pts[i - 1], pts[i]
        return s0 + (s1 - s0) * (b - b0) / (b1 - b0)

    def theta(self, knee: float, max_batch: int) -> int:
        """The smallest batch whose throughput reaches ``knee`` of the best over 1..max_batch."""
        return _theta(self, knee, max_batch)


@functools.lru_cache(maxsize=1024)
def _theta(curve: StepCurve, knee: float, max_batch: int) -> int:  # a curve is immutable: computed once
    tput = [b / curve.cost(b) for b in range(1, max_batch + 1)]
    best = max(tput)
    return next(b for b, t in enumerate(tput, 1) if t >= knee * best)


@dataclass(frozen=True)
class RequestLoad:
    rid: str
    generated: int  # tokens so far
    accepted: int  # draft tokens accepted so far (RLHFSpec's tie-break: move the least helped)
    remaining: float  # tokens it is expected to generate still (the caller's estimate)


@dataclass(frozen=True)
class ReplicaLoad:
    rank: int
    requests: tuple[RequestLoad, ...]
    curve: StepCurve
    training: bool = False  # in a spot session: never a destination
    tokens_per_step: float = 1.0  # committed per request per step (the accept length when speculating)


@dataclass(frozen=True)
class Move:
    rid: str
    source: int
    destination: int


@dataclass(frozen=True)
class Plan:
    kind: str  # "none", "reallocate" or "consolidate"
    moves: tuple[Move, ...]
    tail_s: float  # when the last replica drains
    idle_s: float  # replica-seconds idle before that (what spot training can use)
    score: float = 0.0
    scores: dict[str, float] = field(default_factory=dict)  # every plan considered (auto)


def drain_s(remaining: Sequence[float], curve: StepCurve, tokens_per_step: float, start_s: float = 0.0) -> float:
    """Seconds until a replica with these requests' remaining tokens drains (batch shrinking)."""
    rs = sorted(remaining)
    t, done, n = start_s, 0.0, len(rs)
    for k, r in enumerate(rs):
        steps = max(r - done, 0.0) / tokens_per_step
        t += steps * curve.cost(n - k)
        done = max(done, r)
    return t


def _evaluate(kind: str, replicas: Sequence[ReplicaLoad], moves: list[Move], cfg: ConsolidationConfig) -> Plan:
    by = {r.rank: r for r in replicas}
    reqs = {r.rank: {q.rid: q for q in r.requests} for r in replicas}
    arrived: dict[int, int] = {r.rank: 0 for r in replicas}
    for m in moves:
        q = reqs[m.source].pop(m.rid)
        reqs[m.destination][m.rid] = q
        arrived[m.destination] += 1
    ends = {rank: drain_s([q.remaining for q in reqs[rank].values()], by[rank].curve, by[rank].tokens_per_step,
                          arrived[rank] * cfg.move_s) if reqs[rank] else 0.0 for rank in by}
    tail = max(ends.values(), default=0.0)
    return Plan(kind, tuple(moves), tail, sum(tail - e for e in ends.values()))


def reallocate(replicas: Sequence[ReplicaLoad], cfg: ConsolidationConfig) -> list[Move]:
    """RLHFSpec's reallocation (one decision): see the module docstring."""
    order = sorted(replicas, key=lambda r: (-len(r.requests), r.rank))
    moves: list[Move] = []
    lo, hi = 0, len(order) - 1
    while lo < hi:
        src, dst = order[lo], order[hi]
        if dst.training:  # never a destination: try the next least loaded
            hi -= 1
            continue
        theta = src.curve.theta(cfg.knee, cfg.max_batch)
        k = min(len(src.requests) - theta, theta - len(dst.requests))
        if k > 0:
            for q in sorted(src.requests, key=lambda q: (q.generated, q.accepted, q.rid))[:k]:
                moves.append(Move(q.rid, src.rank, dst.rank))
        lo, hi = lo + 1, hi - 1
    return moves


def receivers_needed(remaining: int, cfg: ConsolidationConfig) -> int:
    """RLHFuse's m = max(ceil(R / BS_max), ceil(R * M / C)) (the second term when M and C are known)."""
    m = math.ceil(remaining / cfg.max_batch)
    if cfg.kv_request_bytes is not None:
        m = max(m, math.ceil(remaining * cfg.kv_request_bytes / cfg.kv_capacity_bytes))
    return max(m, 1) if remaining else 0


def consolidate(replicas: Sequence[ReplicaLoad], step_requests: int, cfg: ConsolidationConfig) -> list[Move]:
    """RLHFuse's consolidation: see the module docstring. ``step_requests``: the step's requests."""
    left = sum(len(r.requests) for r in replicas)
    if not left or left > cfg.remaining_share * step_requests:
        return []
    m = receivers_needed(left, cfg)
    open_ = sorted((r for r in replicas if not r.training), key=lambda r: (-len(r.requests), r.rank))
    keep = open_[:m]
    if len(keep) < m:
        return []
    load = {r.rank: len(r.requests) for r in keep}
    moves = []
    for r in sorted(replicas, key=lambda r: r.rank):
        if r.rank in load:
            continue
        for q in r.requests:
            dst = min(load, key=lambda k: (load[k], k))
            if load[dst] >= cfg.max_batch:
                return []  # no room: consolidation does not fit
            moves.append(Move(q.rid, r.rank, dst))
            load[dst] += 1
    return moves


def decide(replicas: Sequence[ReplicaLoad], step_requests: int, cfg: ConsolidationConfig) -> Plan:
    """The plan for the replicas' current state (``step_requests``: the RL step's requests)."""
    none = _evaluate("none", replicas, [], cfg)
    if cfg.mode == "off":
        return none
    candidates = [none]
    if cfg.mode in ("reallocate", "auto"):
        candidates.append(_evaluate("reallocate", replicas, reallocate(replicas, cfg), cfg))
    if cfg.mode in ("consolidate", "auto"):  # auto: whenever it fits; the cost model says when it pays
        gate = cfg if cfg.mode == "consolidate" else dataclasses.replace(cfg, remaining_share=1.0)
        candidates.append(_evaluate("consolidate", replicas, consolidate(replicas, step_requests, gate), cfg))
    n = len(replicas)
    scored = [(cfg.train_value * (p.idle_s - none.idle_s) - n * (p.tail_s - none.tail_s), p) for p in candidates
              if p.kind == "none" or p.moves]
    if cfg.mode != "auto":  # a fixed rule: its moves, whatever they cost
        best = scored[-1][1]
        return Plan(best.kind, best.moves, best.tail_s, best.idle_s, scored[-1][0])
    score, best = max(scored, key=lambda sp: (sp[0], -len(sp[1].moves)))
    return Plan(best.kind, best.moves, best.tail_s, best.idle_s, score, {p.kind: s for s, p in scored})
