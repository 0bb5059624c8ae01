"""A replica's per-RL-step statistics, which the trainer turns into ``tlt/*`` metrics.

Owns the counters of one step (engine batches, speculation, arms, idle time, spot sessions) and
their lock: the batch thread, the event loop and the spot agent's thread all write here.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING, Any

from tlt.rollout.assembly import SUFFIX

if TYPE_CHECKING:
    from tlt.integrations.verl.batcher import Generation


def _empty() -> dict[str, Any]:
    return {"committed": 0, "verifies": 0, "accepted": 0, "drafted": 0, "tokens": 0,
            "arms": collections.Counter(), "arm_verifies": collections.Counter(),
            "arm_committed": collections.Counter(), "idle_at": None, "idle_s": 0.0, "sessions": 0,
            "failed_sessions": 0, "train_steps": 0, "losses": [], "preempt_s": [], "batches": 0,
            "requests": 0, "gen_s": 0.0, "phases": [], "eagle_verifies": 0, "eagle_committed": 0,
            "heldout": [], "first_at": None, "done_at": None, "lifecycle": collections.Counter(),
            "lengths": [], "step_cost": {}, "recomputed": 0, "kv_peak_positions": 0, "kv_peak_blocks": 0,
            "kv_peak_batch": 0}


class StepStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._st = _empty()
        self.spot_rate: float | None = None  # spot tokens/s of the last session (sizes the next one's chunks)

    def reset(self) -> None:
        with self._lock:
            self._st = _empty()

    def went_idle(self) -> None:
        with self._lock:
            self._st["idle_at"] = time.monotonic()

    def batch(self, gen: "Generation") -> None:
        """One engine generation (:class:`~tlt.integrations.verl.batcher.Generation`): its time, its
        requests, the tokens generated in it (a moved or resubmitted request's earlier tokens were
        counted where they were made), its lifecycle counts (joined running, left, aborted, evicted) and
        the response lengths of the requests that ended in it (a stop token or the budget)."""
        started, gen_s = gen.started, gen.seconds
        self.resumed(started)
        with self._lock:
            st = self._st
            if st["first_at"] is None:  # when decoding began and last ended: the rest of the rollout is verl's
                st["first_at"] = started
            st["done_at"] = started + gen_s
            st["gen_s"] += gen_s
            st["batches"] += 1
            st["requests"] += len(gen.finished)
            st["tokens"] += gen.tokens
            st["lifecycle"].update(gen.lifecycle)
            st["lengths"] += [len(f.state.output) for f in gen.finished if f.reason in ("stop", "length")]
            for s in gen.steps:
                st["recomputed"] += s.recomputed  # an evicted request's tokens prefilled again
                st["kv_peak_positions"] = max(st["kv_peak_positions"], s.positions)
                st["kv_peak_blocks"] = max(st["kv_peak_blocks"], s.blocks)
                st["kv_peak_batch"] = max(st["kv_peak_batch"], s.batch)
                c = st["step_cost"].setdefault(s.batch, [0.0, 0, 0])  # seconds, steps, committed tokens
                c[0] += s.seconds
                c[1] += 1
                c[2] += s.committed
                if s.sd:
                    st["verifies"] += s.batch
                    st["committed"] += s.committed
                    st["accepted"] += s.accepted
                    st["drafted"] += s.drafted
                    st["arms"][s.arm] += 1
                    st["arm_verifies"][s.arm] += s.batch
                    st["arm_committed"][s.arm] += s.committed
                    if not s.arm.endswith(f"@{SUFFIX}"):  # drafted by the EAGLE proposer
                        st["eagle_verifies"] += s.batch
                        st["eagle_committed"] += s.committed

    def resumed(self, at: float) -> None:
        """Work arrived at ``at`` (monotonic): an idle period, if one was open, ends."""
        with self._lock:
            st = self._st
            if st["idle_at"] is not None:
                st["idle_s"] += at - st["idle_at"]
                st["idle_at"] = None

    def request(self, *, tokens: int, verifies: int, eagle: bool) -> None:
        """One request an SGLang server answered: its completion tokens and the verify passes that
        produced them (0: not speculated); ``eagle``: drafted by the EAGLE drafter."""
        with self._lock:
            st = self._st
            st["requests"] += 1
            st["tokens"] += tokens
            if verifies:
                st["verifies"] += verifies
                st["committed"] += tokens
                if eagle:
                    st["eagle_verifies"] += verifies
                    st["eagle_committed"] += tokens

    def session(self, rec) -> None:
        """One spot session's formation record (the agent's ``on_record``)."""
        r = rec.result
        with self._lock:
            st = self._st
            if r is None:
                st["failed_sessions"] += 1
                return
            if r.tokens_per_s:
                self.spot_rate = r.tokens_per_s
            if r.preempt_latency_s is not None:
                st["preempt_s"].append(r.preempt_latency_s)
            st["phases"].append(r.phase_s)
            if r.rank == 0:  # every rank reports the same global steps and losses
                st["sessions"] += 1
                st["train_steps"] += r.end_step - r.start_step
                st["losses"] += list(r.losses)
                if r.heldout_accept_length is not None:  # the push guard's figure for that checkpoint
                    st["heldout"].append((r.checkpoint_step, r.heldout_accept_length))

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            st = dict(self._st)
            for k in ("arms", "arm_verifies", "arm_committed", "lifecycle"):
                st[k] = dict(st[k])
            for k in ("losses", "preempt_s", "phases", "heldout", "lengths"):
                st[k] = list(st[k])
            st["step_cost"] = {str(b): list(c) for b, c in st["step_cost"].items()}
        if st["idle_at"] is not None:
            st["idle_s"] += time.monotonic() - st["idle_at"]
        return st


def replica_fields(stats: list[dict[str, Any]], began: float, ended: float) -> dict[str, list]:
    """Per replica, in order, from their snapshots: idle, decoding and spot-training seconds,
    engine generations, the drafter version served, its engine steps by batch size (seconds, steps,
    tokens committed: the step-cost curve ``tlt bench cluster --validate`` reads), requests that left it
    to go on elsewhere (moved), that were aborted, and that were evicted (a paged cache out of blocks)
    with the tokens their returns prefilled again, the KV memory they held at their peak beside a
    static cache of their peak batch, and the rollout outside their decoding (``began``/``ended``: the rollout's monotonic bounds on the
    driver; monotonic clocks are machine-wide): seconds before the first batch, after the last."""
    def since(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else b - a

    return {"replica_idle_s": [s["idle_s"] for s in stats], "replica_gen_s": [s["gen_s"] for s in stats],
            "replica_train_s": [sum(p[2] for p in s["phases"] if len(p) > 2) for s in stats],
            "replica_moved": [s.get("lifecycle", {}).get("left", 0) for s in stats],
            "replica_aborted": [s.get("lifecycle", {}).get("aborted", 0) for s in stats],
            "replica_evicted": [s.get("lifecycle", {}).get("evicted", 0) for s in stats],
            "replica_recomputed": [s.get("recomputed", 0) for s in stats],
            # KV memory: the peak positions held, and what a static cache of the peak batch holds
            "replica_kv_peak_positions": [s.get("kv_peak_positions", 0) for s in stats],
            "replica_kv_peak_blocks": [s.get("kv_peak_blocks", 0) for s in stats],
            "replica_kv_static_positions": [s.get("kv_peak_batch", 0) * s.get("kv_slots", 0) for s in stats],
            "replica_batches": [s["batches"] for s in stats],
            "replica_drafter_version": [s.get("drafter_version") for s in stats],
            "replica_step_cost": [s.get("step_cost", {}) for s in stats],
            "replica_lead_s": [since(began, s.get("first_at")) for s in stats],
            "replica_trail_s": [since(s.get("done_at"), ended) for s in stats]}
