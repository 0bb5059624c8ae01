"""Consolidation at work during a verl rollout: the driver reads the replicas' loads and moves requests.

Owns :class:`Consolidator`, a thread of the trainer's driver process that runs from the start of a
rollout to its end (``start`` / ``stop``, called by the ``tlt`` trainer). Every
``tlt.tail.consolidate.interval_s`` it asks each replica for its load (``TLTServer.replica_load``),
turns the loads into :class:`~tlt.coordinator.consolidation.ReplicaLoad` s, lets
:func:`~tlt.coordinator.consolidation.decide` choose a plan, and carries the plan's moves out: the
destination reserves (``reserve``; refused while a spot session may run there), then the source
lets the requests go (``move_out``) and verl's client follows them (:mod:`.moves`).

Why the driver: it alone holds a Ray handle to every replica and knows the RL step's request
count (the consolidation trigger) and the rollout's bounds. The coordinator has no Ray handles and
a replica sees only itself. A decision costs one Ray call per replica.

Inputs, measured where they can be:
- step cost by batch size: the replicas' own steps, pooled (the replicas run the same model);
- a move's cost: ``move_s``, or the replicas' measured cost of a request joining a running batch
  (its re-prefill); until one was measured, three steps at batch 1 (the lifecycle bench measured a
  re-prefill at 2-5 plain steps: docs/rollout.md);
- a request's remaining tokens: the mean excess over its tokens so far of the previous step's
  response lengths that exceeded them (RL responses to the same prompts change slowly between
  steps); with none, its budget left;
- tokens per request per step: the replicas' recent mean (the accept length when speculating).

A request moves at most once per rollout; replicas in a spot session are never destinations.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from tlt.coordinator.consolidation import ReplicaLoad, RequestLoad, StepCurve, ConsolidationConfig, decide

log = logging.getLogger(__name__)


def server_address(rank: int) -> str:
    """The server id verl's router knows replica ``rank`` of the tlt backend by."""
    return f"tlt://replica-{rank}"


def remaining_tokens(generated: int, budget: int, lengths: Sequence[int]) -> float:
    """Expected tokens still to come for a request with ``generated`` so far (see the module docstring)."""
    longer = [n - generated for n in lengths if n > generated]
    if longer:
        return min(sum(longer) / len(longer), max(budget - generated, 1))
    return float(max(budget - generated, 1))


def replica_loads(loads: Sequence[dict[str, Any]], lengths: Sequence[int]) -> list[ReplicaLoad] | None:
    """Consolidation's view of the replicas (None: no step cost measured yet anywhere)."""
    pooled: dict[int, list[float]] = collections.defaultdict(list)
    for ld in loads:
        for b, s in ld["step_s"].items():
            pooled[int(b)].append(float(s))
    if not pooled:
        return None
    curve = StepCurve(tuple((b, sum(v) / len(v)) for b, v in pooled.items()))
    tps = [ld["tokens_per_step"] for ld in loads if ld["requests"]]
    out = []
    for ld in loads:
        reqs = tuple(RequestLoad(key, generated, accepted, remaining_tokens(generated, budget, lengths))
                     for key, generated, accepted, budget in ld["requests"])
        out.append(ReplicaLoad(ld["rank"], reqs, curve, training=bool(ld["training"]),
                               tokens_per_step=max(sum(tps) / len(tps), 1.0) if tps else 1.0))
    return out


def _fresh() -> dict[str, Any]:
    """A rollout's record: requests moved, refused by their destination, decisions, plans carried
    out by kind, and the move cost the last decision used."""
    return {"moves": 0, "refused": 0, "decisions": 0, "plans": collections.Counter(), "move_s": None}


class Consolidator:
    def __init__(self, servers: Callable[[], list], cfg: ConsolidationConfig, *, interval_s: float,
                 move_s: float | None, reserve_s: float = 2.0) -> None:
        """``servers()``: the replicas' Ray handles, in rank order; ``cfg``: the rules' settings
        (its ``move_s`` is replaced per decision by ``move_s`` or the measured join cost)."""
        self.servers, self.cfg, self.interval_s = servers, cfg, interval_s
        self.move_s, self.reserve_s = move_s, reserve_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._moved: set[str] = set()
        self.record = _fresh()

    def start(self, step_requests: int, lengths: Sequence[int]) -> None:
        """A rollout of ``step_requests`` requests begins; ``lengths``: the previous step's response lengths."""
        self.stop()
        self._stop.clear()
        self._moved = set()
        self.record = _fresh()
        self._thread = threading.Thread(target=self._run, args=(step_requests, list(lengths)),
                                        name="tlt-consolidator", daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, Any]:
        """The rollout ended: the thread stops (a move in progress completes first); returns what it did."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        return {**self.record, "plans": dict(self.record["plans"])}

    def _run(self, step_requests: int, lengths: list[int]) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.decide_once(step_requests, lengths)
            except Exception:  # a replica died or answered late: the rollout goes on without moves
                log.exception("tlt: consolidator: a decision failed; trying again in %.2fs", self.interval_s)

    def decide_once(self, step_requests: int, lengths: Sequence[int]) -> int:
        """One decision: read loads, plan, move. Returns the requests moved."""
        import ray

        servers = self.servers()
        loads = ray.get([s.replica_load.remote() for s in servers], timeout=30)
        view = replica_loads(loads, lengths)
        if view is None or sum(len(r.requests) for r in view) == 0:
            return 0
        joins = [ld["join_s"] for ld in loads if ld["join_s"] is not None]
        move_s = self.move_s if self.move_s is not None else (
            sum(joins) / len(joins) if joins else 3 * view[0].curve.cost(1))
        plan = decide(view, step_requests, dataclasses.replace(self.cfg, move_s=move_s))
        self.record["decisions"] += 1
        self.record["move_s"] = move_s
        moves = [m for m in plan.moves if m.rid not in self._moved]  # once per rollout: no ping-pong
        if not moves:
            return 0
        self.record["plans"][plan.kind] += 1
        by_pair: dict[tuple[int, int], list[str]] = collections.defaultdict(list)
        for m in moves:
            by_pair[(m.source, m.destination)].append(m.rid)
        moved = 0
        for (src, dst), keys in sorted(by_pair.items()):
            if not ray.get(servers[dst].reserve.remote(len(keys), self.reserve_s), timeout=30):
                self.record["refused"] += len(keys)
                continue
            left = ray.get(servers[src].move_out.remote(keys, server_address(dst)), timeout=30)
            self._moved.update(keys)
            moved += len(left)
        self.record["moves"] += moved
        if moved:
            log.info("tlt: tail %s: moved %d requests (%s)", plan.kind, moved,
                     ", ".join(f"{s}->{d}: {len(k)}" for (s, d), k in sorted(by_pair.items())))
        return moved
