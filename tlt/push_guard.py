"""Drafter-push health guard: is a pushed drafter served as pushed, and does it pay as its trainer
measured? Backend-agnostic decisions; the trainer asks the replicas and acts on the verdicts.

The failure it catches is the one online-drafter systems report most: a push that silently does
nothing, lands in the wrong model, or is lost later, after which acceptance collapses to ~1.

* **Hard check**, right after a push: every replica's digest of the draft weights it serves
  (:func:`tlt.drafter.digest.module_digest`, read from the engine's proposer) must equal the digest of
  the checkpoint step the driver pushed (:func:`tlt.drafter.digest.checkpoint_digest`, read from the
  checkpoint by the driver itself).
* **Soft check**, at the next step boundary: the accept length of the verifies the EAGLE
  drafter drafted during the rollout after the push, against the drafter's held-out accept length
  that the spot trainer measured on its DataBuffer (each batch scored before it was trained on).
  The push fails when the live gain over one token is under ``fraction`` of the held-out gain;
  with fewer than ``min_verifies`` EAGLE verifies there is no verdict. Not compared with the
  previous step: the policy push at the same boundary moves acceptance too.

A failed push is rolled back by the caller to the drafter served before it, one warning names both
figures, and :attr:`PushGuard.rejected` counts it (``tlt/drafter_push_rejected``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    fraction: float = 0.25  # soft check: live gain >= fraction x held-out gain (0: soft check off)
    min_verifies: int = 32  # soft check: EAGLE verifies needed for a verdict

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"push guard fraction={self.fraction!r}: use a float in [0, 1] (0: soft check off)")
        if self.min_verifies < 1:
            raise ValueError(f"push guard min_verifies={self.min_verifies!r}: use an int >= 1")


@dataclasses.dataclass(frozen=True)
class Verdict:
    ok: bool
    step: int  # the pushed checkpoint step judged
    message: str  # what was compared, with both figures


class PushGuard:
    """The driver's record of drafter pushes: the step awaiting its soft check, the held-out accept
    length of each checkpoint step the spot trainer reported, and the rejections so far."""

    def __init__(self, cfg: GuardConfig = GuardConfig()) -> None:
        self.cfg = cfg
        self.rejected = 0
        self.heldout: dict[int, float] = {}  # checkpoint step -> held-out accept length
        self.pending: int | None = None  # pushed step whose soft check is still to come

    def note_heldout(self, step: int | None, accept_length: float | None) -> None:
        if step is not None and accept_length is not None:
            self.heldout[step] = accept_length

    def hard(self, step: int, expected: str, served: Sequence[str | None]) -> Verdict:
        """``served``: each replica's digest of the draft weights it serves after the push (None:
        it serves no EAGLE drafter)."""
        bad = [i for i, d in enumerate(served) if d != expected]
        if bad:
            self.rejected += 1
            self.pending = None
            return Verdict(False, step, f"replicas {bad} of {len(served)} do not serve checkpoint step {step} "
                           f"(weights digest {expected[:12]}, served "
                           f"{[None if served[i] is None else served[i][:12] for i in bad]})")
        self.pending = step
        return Verdict(True, step, f"all {len(served)} replicas serve checkpoint step {step}")

    def soft(self, eagle_verifies: int, eagle_committed: int) -> Verdict | None:
        """Judge the pending push from the EAGLE verifies of the rollout that followed it; None (and
        still pending) without a held-out figure, with the check off, or with too few verifies."""
        step = self.pending
        if step is None or self.cfg.fraction == 0 or step not in self.heldout:
            return None
        if eagle_verifies < self.cfg.min_verifies:
            return None
        self.pending = None
        live, held = eagle_committed / eagle_verifies, self.heldout[step]
        need = 1.0 + self.cfg.fraction * max(0.0, held - 1.0)
        figures = (f"live EAGLE accept length {live:.2f} over {eagle_verifies} verifies, held-out "
                   f"{held:.2f} (needs >= {need:.2f})")
        if live < need:
            self.rejected += 1
            return Verdict(False, step, f"checkpoint step {step} drafts below its held-out accept length: {figures}")
        return Verdict(True, step, figures)
