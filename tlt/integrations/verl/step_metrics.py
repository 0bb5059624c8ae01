"""One RL step's rollout as the ``tlt`` trainer saw it, and the metrics and record fields made from it.

Owns :class:`RolloutWindow` (from ``prepare_step`` to ``on_sample_end``: its clock, the replicas'
statistics, the coordinator's outcome, the consolidator's moves) and the two pure functions over it:
:func:`step_metrics` (verl's metrics, ``tlt/*`` and ``rollout/spec_*``) and :func:`step_extra` (the
step record's fields that are not scalars). Owner: the trainer's driver thread.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from collections.abc import Mapping
from typing import Any

from tlt.integrations.verl.step_stats import replica_fields


@dataclasses.dataclass
class RolloutWindow:
    began: float = 0.0  # monotonic seconds, at prepare_step
    ended: float = 0.0  # monotonic seconds, at on_sample_end
    stats: list[dict] = dataclasses.field(default_factory=list)  # each replica's step_stats()
    outcome: Any = None  # the coordinator's RolloutOutcome; None without a coordinator
    tail: dict = dataclasses.field(default_factory=dict)  # the consolidator's summary
    lengths: list[int] = dataclasses.field(default_factory=list)  # response lengths: the consolidator's estimate

    def begin(self) -> None:
        self.began = time.monotonic()

    def end(self) -> None:
        self.ended = time.monotonic()

    def collect(self, stats: list[dict], outcome: Any, tail: dict) -> None:
        """What the rollout left, gathered after :meth:`end`."""
        self.stats, self.outcome, self.tail = stats, outcome, tail
        self.lengths = [n for s in stats for n in s.get("lengths", ())]

    @property
    def seconds(self) -> float:
        return self.ended - self.began


def step_metrics(w: RolloutWindow, *, drafter_version: int, drafter_spot_step: int, push_rejected: int,
                 repushed: int, failures: Mapping[str, int], feeds_dropped: int,
                 rounds: dict | None) -> dict[str, float]:
    """verl's metrics for the step (``rounds``: tail batching's round record, None without it;
    ``drafter_spot_step``: the spot checkpoint served after the step, 0 for the warm-up drafter)."""
    st = w.stats
    verifies = sum(s["verifies"] for s in st)
    committed = sum(s["committed"] for s in st)
    tokens = sum(s["tokens"] for s in st)
    drafted, accepted = sum(s["drafted"] for s in st), sum(s["accepted"] for s in st)
    losses = [x for s in st for x in s["losses"]]
    arms, arm_verifies, arm_committed = collections.Counter(), collections.Counter(), collections.Counter()
    for s in st:
        arms.update(s["arms"])
        arm_verifies.update(s.get("arm_verifies", {}))
        arm_committed.update(s.get("arm_committed", {}))
    n_arms = sum(arms.values()) or 1
    m = {
        # NaN when nothing was verified (speculation off all step): no accept length, not 0
        "rollout/spec_accept_length": committed / verifies if verifies else float("nan"),
        "rollout/spec_accept_rate": accepted / drafted if drafted else float("nan"),
        "tlt/spec_verifies": float(verifies),
        "tlt/spec_committed": float(committed),
        "tlt/drafter_version": float(drafter_version),
        "tlt/drafter_spot_step": float(drafter_spot_step),  # (a rollback to the warm-up drafter: 0 again)
        "tlt/drafter_push_rejected": float(push_rejected),
        "tlt/drafter_repushed": float(repushed),
        "tlt/drafter_loss": statistics.fmean(losses) if losses else float("nan"),
        "tlt/spot_train_steps": float(sum(s["train_steps"] for s in st)),
        "tlt/idle_replica_s": float(sum(s["idle_s"] for s in st)),
        "tlt/sd_token_share": min(1.0, committed / tokens) if tokens else 0.0,
        "tlt/buffer_samples": float(sum(s["buffer"]["samples"] for s in st)),
        "tlt/rollout_s": w.seconds,
        "tlt/sessions": float(sum(s["sessions"] for s in st)),
        "tlt/tail_moves": float(w.tail.get("moves", 0)),
        # a paged cache out of blocks: requests evicted, and their tokens prefilled again
        "tlt/evicted": float(sum(s["lifecycle"].get("evicted", 0) for s in st)),
        "tlt/recomputed_tokens": float(sum(s.get("recomputed", 0) for s in st)),
        # the KV positions the fullest replica held at its peak, over a static cache of its batch
        "tlt/kv_peak_share": max((s.get("kv_peak_positions", 0) / (s["kv_peak_batch"] * s["kv_slots"])
                                  for s in st if s.get("kv_peak_batch") and s.get("kv_slots")), default=0.0),
        # failures the run went on after (cumulative): a lost draft source shows here, not only in a log
        "tlt/history_push_failures": float(failures.get("history", 0) + failures.get("responses", 0)),
        "tlt/response_record_failures": float(failures.get("record", 0) + failures.get("responses", 0)),
        "tlt/feeds_dropped": float(feeds_dropped),
        "tlt/checkpoint_failures": float(failures.get("checkpoint", 0)),  # TLT state not saved with verl's
    }
    if rounds is not None:  # tail batching: prompts waiting for a long round, tokens dropped
        m["tlt/tail_queue"] = float(rounds.get("queued_after", 0))
        m["tlt/tail_dropped_share"] = float(rounds.get("dropped_share", 0.0))
    drift = [s["drift_top1"] for s in st if s["drift_top1"] is not None]
    if drift:  # 1 - top-1 agreement of the policies before and after the last update
        m["tlt/target_drift"] = 1.0 - statistics.fmean(drift)
    m.update({f"tlt/arm_share/{a}": n / n_arms for a, n in arms.items()})
    # per arm (strategy@proposer): the summary compares drafters at the same strategy
    m.update({f"tlt/arm_verifies/{a}": float(n) for a, n in arm_verifies.items()})
    m.update({f"tlt/arm_committed/{a}": float(n) for a, n in arm_committed.items()})
    suffix = sum(n for a, n in arms.items() if a.endswith("@suffix"))
    if arms:  # which proposer drafted the speculative steps
        m["tlt/proposer_share/suffix"] = suffix / n_arms
        m["tlt/proposer_share/eagle"] = 1.0 - suffix / n_arms
    return m


def step_extra(w: RolloutWindow, *, rounds: dict | None) -> dict[str, Any]:
    """The step record's fields besides the metrics: the coordinator's outcome, spot phases, the
    proposers, moves and tail batching, and each replica's figures (:func:`.step_stats.replica_fields`)."""
    o, st = w.outcome, w.stats
    return {"stopped": list(o.stopped) if o else [], "lost": list(o.lost) if o else [],
            "timed_out": list(o.timed_out) if o else [], "coordinator_reachable": bool(o.reachable) if o else False,
            "preempt_s": [x for s in st for x in s["preempt_s"]],
            "spot_phase_s": [list(x) for s in st for x in s["phases"]],
            "proposers": [s["proposer"] for s in st], "tail": w.tail,
            "buffer_fed": [s.get("buffer_fed", {}) for s in st], "tail_batching": rounds,
            **replica_fields(st, w.began, w.ended)}
