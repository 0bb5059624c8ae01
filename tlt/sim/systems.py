"""The rollout systems the cluster simulator compares, each as its paper states it.

Owns how one RL step's rollout runs under each system, on top of :func:`tlt.sim.rollout.simulate`:

- ``plain``: plain decoding, no moves.
- ``tlt``: speculation where it pays (the engine's tuner picks per batch, its "off" arm included);
  the replica-seconds each replica sits idle after its last request are what spot training gets.
- ``rlhfspec``: speculation plus RLHFSpec's reallocation (section 6), through the consolidation rules the
  trainer runs (:mod:`tlt.coordinator.consolidation`, ``mode="reallocate"``).
- ``rlhfuse``: RLHFuse's consolidation (section 4.2, ``mode="consolidate"``), without speculation
  as RLHFuse has none; its freed instances start the next stage, here counted as free seconds.
- ``tlt+consolidate``: speculation plus the cost-model choice of the tail-consolidation issue
  (``mode="auto"``).
- ``rollpacker`` (and ``tlt+rollpacker``): RollPacker's tail batching over several steps. A short
  round launches ``(1 + prompt_over)`` times the prompts a step needs with ``(1 + response_over)``
  times the responses each, keeps the first ``P0`` prompts whose ``R0`` responses all finished and
  aborts the rest into a queue; once ``P0`` prompts have queued, a long round runs them with ``R0``
  responses each to the end, and a flush trains what is left at the pool's end. Aborted tokens are
  regenerated (on-policy). Its figures are means over whole cycles of short and long rounds
  (:func:`rollpacker_rounds`), so the long rounds weigh as often as they run.
- ``pat`` (and ``tlt+pat``): PAT's Algorithm 1 (section 4.2). At each decision (a request
  finishing, at most once per ``tick_s``) the predicted
  remaining time at the current tensor parallelism is compared with each power-of-two TP plus
  ``C_switch`` = min(KV migration, re-prefill) + reshard (+ graph recapture); the tail switches when
  that is shorter. A TP-``k`` instance runs ``tp_speedup[k]`` times faster than one GPU's replica
  (an assumption of the workload, not measured here). The project's engine has no tensor
  parallelism and SGLang cannot change TP at run time: this row is the simulator's alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from tlt.coordinator.consolidation import Plan, ConsolidationConfig, decide, drain_s
from tlt.sim.rollout import Request, Result, Speed, loads, reset, simulate, token_curve

SYSTEMS = ("plain", "tlt", "rlhfspec", "rlhfuse", "tlt+consolidate", "rollpacker", "tlt+rollpacker", "pat",
            "tlt+pat")


@dataclass(frozen=True)
class StepOutcome:
    """One RL step (or the mean over a RollPacker cycle's steps) under one system."""

    rollout_s: float
    idle_s: float  # replica-seconds without a request during the rollout
    train_s: float  # replica-seconds free after each replica's last request (spot training)
    tokens: float  # tokens generated, aborted ones included
    wasted_tokens: float  # tokens generated and thrown away (RollPacker's aborts)
    moves: int = 0
    switched_tp: int = 1  # PAT: the tensor parallelism the tail ran at
    trained: tuple[int, ...] = ()  # RollPacker: the prompts this step trains (their r0 responses finished)


@dataclass(frozen=True)
class Knobs:
    tick_s: float = 0.5  # seconds between tail decisions
    move_s: float = 0.05  # a moved request's re-prefill
    knee: float = 0.9
    remaining_share: float = 0.2
    train_value: float = 0.5
    max_batch: int = 256
    # RollPacker launches eta * P0 prompts with eta * R0 responses each; eta = 1.25, as the tlt
    # trainer's tlt.tail.batching defaults
    prompt_over: float = 0.25  # RollPacker: extra prompts launched in a short round
    response_over: float = 0.25  # RollPacker: extra responses per prompt
    tp_speedup: tuple[tuple[int, float], ...] = ((1, 1.0), (2, 1.8), (4, 3.2), (8, 5.6))
    switch_s: float = 2.0  # PAT: reshard and graph recapture, on top of the KV's re-prefill


def _outcome(r: Result, switched: int = 1) -> StepOutcome:
    return StepOutcome(r.seconds, r.idle_s, sum(r.train_s), r.tokens, sum(q.done for q in r.aborted), r.moves,
                       switched)


def consolidator(cfg: ConsolidationConfig):
    """The trainer's consolidator: :func:`tlt.coordinator.consolidation.decide` at each tick, and a request
    moves at most once per rollout (as ``tlt.integrations.verl.consolidator`` enforces)."""
    moved: set[str] = set()

    def decide_moves(now, reps, step_requests) -> Plan | None:
        plan = decide(loads(reps), step_requests, cfg)
        keep = tuple(m for m in plan.moves if m.rid not in moved)
        moved.update(m.rid for m in keep)
        return dataclasses.replace(plan, moves=keep)
    return decide_moves


def run_step(system: str, requests: Sequence[Request], plain: Speed, spec: Speed, replicas: int,
             knobs: Knobs = Knobs()) -> StepOutcome:
    """One RL step's rollout of ``requests`` (fresh copies are run) under ``system``."""
    if system not in SYSTEMS or system.endswith("rollpacker"):
        raise ValueError(f"system={system!r}: one of {[p for p in SYSTEMS if 'rollpacker' not in p]} "
                         "(RollPacker runs over several steps: run_rollpacker)")
    reqs = reset(requests)
    speed = plain if system in ("plain", "rlhfuse", "pat") else spec
    if system in ("plain", "tlt"):
        return _outcome(simulate(reqs, [speed] * replicas))
    if system in ("pat", "tlt+pat"):
        return _pat(reqs, speed, replicas, knobs)
    mode = {"rlhfspec": "reallocate", "rlhfuse": "consolidate", "tlt+consolidate": "auto"}[system]
    cfg = ConsolidationConfig(mode=mode, knee=knobs.knee, remaining_share=knobs.remaining_share, max_batch=knobs.max_batch,
                     move_s=knobs.move_s, train_value=knobs.train_value)
    return _outcome(simulate(reqs, [speed] * replicas, consolidation=consolidator(cfg), tick_s=knobs.tick_s, move_s=knobs.move_s))


def _pat(reqs: list[Request], speed: Speed, replicas: int, knobs: Knobs) -> StepOutcome:
    """Algorithm 1: decide at each tick whether the tail finishes sooner at a higher TP."""
    speedup = dict(knobs.tp_speedup)
    choice: dict[str, int] = {}

    def predicted(remaining: list[float], k: int) -> float:
        n_inst = max(1, replicas // k)
        per = [remaining[i::n_inst] for i in range(n_inst)]
        sp = speed.scaled(speedup[k])
        curve = token_curve(sp)
        return max((drain_s(p, curve, 1.0) for p in per if p), default=0.0)

    def until(finished, snapshot) -> bool:
        reps = snapshot()
        left = [r.remaining for rep in reps for r in rep.running.values()]
        if not left:
            return False
        now = max(drain_s([r.remaining for r in rep.running.values()], token_curve(rep.speed), 1.0)
                  for rep in reps if rep.running)
        switch = knobs.move_s + knobs.switch_s  # min(KV migration, re-prefill) + reshard
        options = [(predicted(left, k) + switch, k) for k in speedup if 1 < k <= replicas]
        best = min(options, default=(math.inf, 1))
        if best[0] < now:
            choice["k"] = best[1]
            return True
        return False

    first = simulate(reqs, [speed] * replicas, until=_every(knobs.tick_s, until))
    k = choice.get("k", 1)
    if k == 1 or not first.aborted:
        return _outcome(first)
    rest = [dataclasses.replace(r, aborted=False) for r in first.aborted]
    second = simulate(rest, [speed.scaled(speedup[k])] * (replicas // k), start_s=knobs.move_s + knobs.switch_s)
    # every GPU joins a TP group at the switch: only the groups idle after it count for training
    return StepOutcome(first.seconds + second.seconds, first.idle_s + k * second.idle_s, k * sum(second.train_s),
                       sum(r.length for r in first.finished) + second.tokens, 0.0, 0, k)


def _every(tick_s: float, until):
    """``until`` asked at most once per ``tick_s`` of simulated time (decisions, not every event)."""
    state = {"next": tick_s}

    def check(finished, snapshot) -> bool:
        now = finished[-1].finished_at if finished else 0.0
        if now < state["next"]:
            return False
        state["next"] = now + tick_s
        return until(finished, snapshot)
    return check


def rollpacker_rounds(steps: int, p0: int, prompt_over: float) -> int:
    """The rounds to simulate for at least ``steps`` steps in whole cycles: a cycle is the short
    rounds that queue ``p0`` prompts (each launches ``ceil(p0 * (1 + prompt_over))`` and trains
    ``p0``) and the long round they feed."""
    queued = math.ceil(p0 * (1 + prompt_over)) - p0
    if queued <= 0:
        return steps  # nothing queues: short rounds only
    cycle = math.ceil(p0 / queued) + 1
    return cycle * math.ceil(steps / cycle)


def run_rollpacker(prompts: Sequence[Sequence[float]], speed: Speed, replicas: int, knobs: Knobs = Knobs(), *,
                   p0: int, r0: int, group_base: int = 0) -> list[StepOutcome]:
    """RollPacker's rounds over ``prompts`` (each: its responses' lengths, at least ``r0`` of them with
    ``response_over`` 0, ``ceil(r0 * (1 + response_over))`` otherwise), ``p0`` prompts per step. A
    step is a short round (launched with extra prompts; its unfinished prompts queue) or, once
    ``p0`` prompts have queued, a long round of queued prompts; when too few fresh prompts are left
    for a short round, a flush (as the trainer's epoch end: the queue, topped up with fresh prompts
    to ``p0``) runs to the end like a long round. Every prompt is trained once. Returns one outcome
    per step."""
    launch_r = math.ceil(r0 * (1 + knobs.response_over))
    launch_p = math.ceil(p0 * (1 + knobs.prompt_over))
    if any(len(p) < launch_r for p in prompts):
        raise ValueError(f"every prompt needs at least {launch_r} response lengths")
    fresh = list(range(len(prompts)))
    queue: list[int] = []
    out: list[StepOutcome] = []
    while fresh or queue:
        if len(queue) >= p0 or len(fresh) < launch_p:  # long round, or the flush: p0 prompts to the end
            batch, queue = queue[:p0], queue[p0:]
            batch, fresh = batch + fresh[:p0 - len(batch)], fresh[p0 - len(batch):]
            reqs = [Request(f"p{i}r{j}", prompts[i][j], group=group_base + i) for i in batch for j in range(r0)]
            out.append(dataclasses.replace(_outcome(simulate(reqs, [speed] * replicas)), trained=tuple(batch)))
            continue
        batch, fresh = fresh[:launch_p], fresh[launch_p:]
        reqs = [Request(f"p{i}r{j}", prompts[i][j], group=group_base + i) for i in batch for j in range(launch_r)]
        need = p0

        per: dict[int, int] = {}
        seen = [0, 0]  # finished requests counted, prompts complete

        def enough(finished, snapshot, need=need, per=per, seen=seen) -> bool:
            """p0 prompts with r0 finished responses each (counted as requests finish)."""
            for r in finished[seen[0]:]:
                per[r.group] = per.get(r.group, 0) + 1
                seen[1] += per[r.group] == r0
            seen[0] = len(finished)
            return seen[1] >= need

        res = simulate(reqs, [speed] * replicas, until=enough)
        at: dict[int, list[float]] = {}  # prompt -> when its r0-th response finished
        for r in sorted(res.finished, key=lambda r: r.finished_at):
            at.setdefault(r.group, []).append(r.finished_at)
        kept = sorted((g for g, ts in at.items() if len(ts) >= r0), key=lambda g: at[g][r0 - 1])[:need]
        queue += [i for i in batch if group_base + i not in kept]
        # thrown away: aborted partial outputs, the responses of prompts not kept, and a kept prompt's
        # responses past its first r0
        extra: dict[int, int] = {}
        wasted, kept_set = sum(r.done for r in res.aborted), set(kept)
        for r in sorted(res.finished, key=lambda r: r.finished_at):
            extra[r.group] = extra.get(r.group, 0) + 1
            if r.group not in kept_set or extra[r.group] > r0:
                wasted += r.length
        o = _outcome(res)
        out.append(dataclasses.replace(o, wasted_tokens=wasted, trained=tuple(g - group_base for g in kept)))
    return out
