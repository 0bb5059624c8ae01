"""The driver's drafter pushes to the project's replicas, guarded (:mod:`tlt.push_guard`).

Owns, at each step end after verl's policy push: the soft verdict on the previous push (from the
rollout that just ran on it), then the push of the newest committed spot checkpoint (pinned
against pruning while the replicas read it, every replica loading exactly that step), its hard
check (each replica's digest of the draft weights its engine runs vs the driver's own digest of
the checkpoint), and the rollback of a rejected push (every replica serves its previous drafter
again, so replicas stay alike). A rejected step is never pushed again; the next newer one is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import ray
import torch

from drafter.checkpoint import latest, pin
from drafter.digest import checkpoint_digest
from tlt.push_guard import GuardConfig, PushGuard, Verdict

log = logging.getLogger(__name__)


class DrafterPusher:
    def __init__(self, servers: Callable[[], list], guard: GuardConfig) -> None:
        self.servers = servers  # Ray actor handles of the replicas (tlt.integrations.replica_api), in order
        self.guard = PushGuard(guard)
        self.pushed = 0  # spot checkpoint step last pushed (accepted or not)
        self.version = 0  # drafter version last served (a push or a rollback)

    def step_end(self, spot_root: str | None, stats: Sequence[dict]) -> None:
        """Judge the last push on this step's rollout ``stats`` (the replicas' step records), then
        push a newer checkpoint if the spot trainer committed one."""
        for s in stats:
            for step, al in s.get("heldout", ()):
                self.guard.note_heldout(step, al)
        verdict = self.guard.soft(sum(s.get("eagle_verifies", 0) for s in stats),
                                  sum(s.get("eagle_committed", 0) for s in stats))
        if verdict is not None and not verdict.ok:
            self._rollback(verdict)
        if spot_root and Path(spot_root).exists():
            self._push(spot_root)

    def _push(self, root: str) -> None:
        step = latest(root)
        if step is None or step <= self.pushed:
            return
        self.version += 1
        pin(root, [step])
        try:
            ray.get([s.load_drafter.remote(self.version, step) for s in self.servers()])
            served = ray.get([s.served_drafter.remote() for s in self.servers()])
            dtype = getattr(torch, served[0]["dtype"].removeprefix("torch."))
            expected = checkpoint_digest(root, step, dtype)
        finally:
            pin(root, [])
        self.pushed = step
        verdict = self.guard.hard(step, expected, [s["digest"] for s in served])
        if not verdict.ok:
            self._rollback(verdict)
            return
        log.info("tlt: drafter version %d (spot step %d) pushed to %d replicas, served as pushed",
                 self.version, step, len(served))

    def _rollback(self, verdict: Verdict) -> None:
        self.version += 1
        ray.get([s.rollback_drafter.remote(self.version) for s in self.servers()])
        log.warning("tlt: drafter push of spot step %d rejected, previous drafter served again as "
                    "version %d (%d rejected so far): %s", verdict.step, self.version,
                    self.guard.rejected, verdict.message)
