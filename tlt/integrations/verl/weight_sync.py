"""What a replica serves, and how it changes: the policy (pushed by verl) and the spot drafter.

Owns the policy copy (:func:`copy_policy`: every name and shape checked before anything is
written, then copied into the target in place, so the drafter's shared embedding / LM head follow
and its own weights are untouched), the drafter read from a named spot checkpoint
(:func:`load_spot_drafter`) and the target-drift probe (:class:`DriftProbe`), whose two forwards
run outside the push: the old policy's when the replica goes idle, the new one's after the push.

The caller owns the ordering: both copies happen under the replica's serving lock, between
batches; a spot session never reads the target's tensors (:func:`~tlt.integrations.verl.spot_wiring.session_weights`).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from tlt.drafter.checkpoint import load_weights
from tlt.drafter.eagle import Drafter, DrafterConfig
from tlt.rollout.graph_pool import CAPTURE_LOCK
from tlt.rollout.target import TargetModel

log = logging.getLogger(__name__)


def copy_policy(model: TargetModel, state: dict[str, torch.Tensor]) -> int:
    """Policy weights (HF names) into ``model`` in place; returns how many tensors were copied.
    Rotary buffers and a tied LM head the target does not hold are skipped; any other unknown name
    or shape mismatch raises a ValueError before anything is written."""
    own = model.state_dict()
    skip = {n for n in state if n not in own and (n.endswith("rotary_emb.inv_freq") or (
        n == "lm_head.weight" and model.config.tie_word_embeddings))}
    for name, t in state.items():
        if name in skip:
            continue
        if name not in own:
            raise ValueError(f"policy weight {name!r} is not a tensor of the rollout target")
        if tuple(t.shape) != tuple(own[name].shape):
            raise ValueError(f"policy weight {name!r} has shape {tuple(t.shape)}, the rollout target "
                             f"expects {tuple(own[name].shape)}")
    with torch.no_grad():
        for name, t in state.items():
            if name not in skip:
                own[name].copy_(t.to(own[name].dtype))
    return len(state) - len(skip)


def load_spot_drafter(root: str | Path, cfg: DrafterConfig, embed: torch.Tensor,
                      head: torch.Tensor, step: int | None = None) -> tuple[Drafter, int] | None:
    """Spot checkpoint ``step`` (default: the latest committed one) as a serving drafter (no
    process group needed; the weights only)."""
    if not root or not Path(root).exists():
        return None
    d = Drafter(cfg, embed, head).to(device=embed.device, dtype=embed.dtype)
    step = load_weights(root, d, frozen=(embed, head), step=step)
    return None if step is None else (d.eval(), step)


class DriftProbe:
    """Top-1 agreement of consecutive policies on a few sequences the replica just served.

    ``record`` keeps the last batch's first sequences; ``before`` (the replica went idle, the old
    policy still loaded) takes their greedy next tokens; ``after`` (the new policy copied in) takes
    them again and sets :attr:`top1`. Both forwards are the caller's to schedule off the push;
    ``lock`` is the replica's serving lock, taken around each forward.
    """

    def __init__(self, model: TargetModel, lock: threading.Lock, size: int = 4) -> None:
        self.model, self.lock, self.size = model, lock, size
        self._seqs: list[list[int]] = []
        self._before: tuple[torch.Tensor, torch.Tensor] | None = None
        self.top1: float | None = None

    def record(self, seqs: list[list[int]]) -> None:
        self._seqs = [list(s) for s in seqs[:self.size]]

    def before(self) -> None:
        with self.lock, CAPTURE_LOCK:  # (no forward during another thread's graph capture)
            self._before = self._argmax()

    def after(self) -> None:
        with self.lock, CAPTURE_LOCK:
            before, self._before = self._before, None
            if before is None:
                return
            after = self._argmax()
        if after is not None and after[0].shape == before[0].shape:
            self.top1 = float((before[0] == after[0])[before[1]].float().mean())

    def _argmax(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Greedy next tokens [B, T] of the current target on the probe, and the valid mask [B, T]."""
        if not self._seqs:
            return None
        dev = self.model.embed_weight.device
        t = max(len(x) for x in self._seqs)
        ids = torch.zeros(len(self._seqs), t, dtype=torch.long, device=dev)
        valid = torch.zeros(len(self._seqs), t, dtype=torch.bool, device=dev)
        for i, x in enumerate(self._seqs):
            ids[i, :len(x)], valid[i, :len(x)] = torch.tensor(x, device=dev), True
        with torch.no_grad():
            return self.model(ids).logits.argmax(-1), valid  # right padding: causal rows stay exact
