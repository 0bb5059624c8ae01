"""The driver's drafter pushes to the project's replicas, guarded (:mod:`tlt.push_guard`).

Owns, at each step end after verl's policy push: the soft verdict on the previous push (from the
rollout that just ran on it), a read-back of the drafter accepted last (pushed again to a replica
that lost it across verl's memory release/resume), then the push of the newest committed spot checkpoint (pinned
against pruning while the replicas read it, every replica loading exactly that step), its hard
check (each replica's digest of the draft weights its engine runs vs the driver's own digest of
the checkpoint), and the rollback of a rejected push (every replica serves its previous drafter
again, so replicas stay alike). A rejected step is never pushed again; the next newer one is. Its record
(:meth:`DrafterPusher.state`) rides with verl's checkpoints (:mod:`.resume`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import ray
import torch

from tlt.drafter.checkpoint import latest, pin
from tlt.drafter.digest import checkpoint_digest
from tlt.push_guard import GuardConfig, PushGuard, Verdict

log = logging.getLogger(__name__)


class DrafterPusher:
    def __init__(self, servers: Callable[[], list], guard: GuardConfig) -> None:
        self.servers = servers  # Ray actor handles of the replicas (tlt.integrations.replica_api), in order
        self.guard = PushGuard(guard)
        self.pushed = 0  # spot checkpoint step last pushed (accepted or not)
        self.version = 0  # drafter version last served (a push or a rollback)
        # spot steps served now and before it (rollbacks and re-pushes read them: kept pinned)
        self.accepted: int | None = None
        self.previous: int | None = None
        self.repushed = 0  # replicas that lost a served drafter and got it again

    def step_end(self, spot_root: str | None, stats: Sequence[dict]) -> None:
        """Judge the last push on this step's rollout ``stats`` (the replicas' step records), check
        that the drafter accepted last is still served (verl released and resumed the replicas'
        memory since), then push a newer checkpoint if the spot trainer committed one."""
        for s in stats:
            for step, al in s.get("heldout", ()):
                self.guard.note_heldout(step, al)
        verdict = self.guard.soft(sum(s.get("eagle_verifies", 0) for s in stats),
                                  sum(s.get("eagle_committed", 0) for s in stats))
        if verdict is not None and not verdict.ok:
            self._rollback(verdict)
        if spot_root and Path(spot_root).exists():
            self._recheck(spot_root)
            self._push(spot_root)

    def state(self) -> dict:
        """What a resumed run needs to go on serving as this one would (JSON-able)."""
        return {"pushed": self.pushed, "version": self.version, "accepted": self.accepted, "previous": self.previous,
                "repushed": self.repushed, "rejected": self.guard.rejected, "pending": self.guard.pending,
                "heldout": [[s, al] for s, al in self.guard.heldout.items()]}

    def restore(self, state: dict) -> None:
        self.pushed, self.version, self.repushed = int(state["pushed"]), int(state["version"]), int(state["repushed"])
        self.accepted, self.previous = state["accepted"], state["previous"]
        self.guard.rejected, self.guard.pending = int(state["rejected"]), state["pending"]
        self.guard.heldout = {int(s): float(al) for s, al in state["heldout"]}

    def serve_accepted(self, root: str) -> None:
        """Every replica serves the accepted spot step as the current version (a resumed run's
        replicas start without it); raises RuntimeError if one does not serve it as pushed."""
        self._pin(root)
        ray.get([s.load_drafter.remote(self.version, self.accepted) for s in self.servers()])
        expected, served = self._served(root, self.accepted)
        bad = [i for i, s in enumerate(served) if s["digest"] != expected]
        if bad:
            raise RuntimeError(f"replicas {bad} do not serve spot step {self.accepted} after the resume")

    def _served(self, root: str, step: int) -> tuple[str, list]:
        """(expected digest of checkpoint ``step``, each replica's read-back); the caller pins it."""
        served = ray.get([s.served_drafter.remote() for s in self.servers()])
        return _expected(root, step, served[0]), served

    def _recheck(self, root: str) -> None:
        """A drafter served as pushed may be lost later (a memory release/resume that drops draft
        weights): the accepted step is read back again and, where it is gone, pushed again."""
        self._pin(root)
        step = self.accepted
        if step is None:
            return
        try:
            expected, served = self._served(root, step)
            lost = [i for i, s in enumerate(served) if s["digest"] != expected]
            if lost:
                log.warning("tlt: replicas %s no longer serve drafter version %d (spot step %d) (a memory "
                            "release/resume, or a push that failed); pushing it again", lost, self.version, step)
                servers = self.servers()
                ray.get([servers[i].load_drafter.remote(self.version, step) for i in lost])
                self.repushed += len(lost)
        except ValueError:  # a checkpoint pruned before pinning existed: nothing to compare with
            log.warning("tlt: spot step %d is gone; the served drafter is not re-checked", step)

    def _push(self, root: str) -> None:
        step = latest(root)
        if step is None or step <= self.pushed:
            return
        self.version += 1
        self._pin(root, step)
        try:
            ray.get([s.load_drafter.remote(self.version, step) for s in self.servers()])
            expected, served = self._served(root, step)
        finally:
            self._pin(root)
        self.pushed = step
        verdict = self.guard.hard(step, expected, [s["digest"] for s in served])
        if not verdict.ok:
            self._rollback(verdict)  # every replica serves `accepted` again
            return
        self.previous, self.accepted = self.accepted, step
        self._pin(root)
        log.info("tlt: drafter version %d (spot step %d) pushed to %d replicas, served as pushed",
                 self.version, step, len(served))

    def _pin(self, root: str, *extra: int) -> None:
        pin(root, [s for s in (self.previous, self.accepted, *extra) if s is not None])

    def _rollback(self, verdict: Verdict) -> None:
        if verdict.step == self.accepted:  # the soft check failed the served step: its predecessor returns
            self.accepted, self.previous = self.previous, None
        self.version += 1
        ray.get([s.rollback_drafter.remote(self.version) for s in self.servers()])
        log.warning("tlt: drafter push of spot step %d rejected, previous drafter served again as "
                    "version %d (%d rejected so far): %s", verdict.step, self.version,
                    self.guard.rejected, verdict.message)


def _expected(root: str, step: int, served: dict) -> str:
    """What a replica serving checkpoint ``step`` reads back: a digest of all draft weights (the
    project's engine), or of the canary's first elements (SGLang: ``served["canary"]``)."""
    dtype = getattr(torch, served["dtype"].removeprefix("torch."))
    canary = served.get("canary")
    if canary:
        from tlt.integrations.verl.sglang_drafts import expected_canary

        return expected_canary(root, step, dtype, int(canary["elements"]))
    return checkpoint_digest(root, step, dtype)
