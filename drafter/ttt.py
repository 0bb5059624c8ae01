"""Training-time test: multi-step self-feeding drafter forward, losses and accuracy.

Owns the loss of one batch. Step 0 pairs the target feature ``f_t`` with token ``x_{t+1}``;
step ``j`` feeds the drafter's own step ``j-1`` output (its guess of ``f_{t+j}``) with token
``x_{t+1+j}``, exactly what the drafter sees at inference after ``j`` accepted draft tokens
(HASS / EAGLE-3). Every step predicts token ``x_{t+2+j}``; only response tokens count.

Losses per step: soft cross-entropy against the target's distribution at that position and,
for "feature+ce", smooth-L1 between the drafter output and the target feature ``f_{t+1+j}``.
Step ``j`` is weighted ``decay**j``; each step's loss is a mean over its valid positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tlt.drafter.eagle import Drafter
from tlt.drafter.packing import Batch

LOSSES = ("feature+ce", "ce")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TTTConfig:
    steps: int = 3
    decay: float = 0.8
    loss: str = "feature+ce"
    feature_weight: float = 1.0
    ce_weight: float = 0.1

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"ttt steps must be >= 1, got {self.steps}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"ttt decay must be in (0, 1], got {self.decay}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss={self.loss!r}; use one of {LOSSES}")

    def for_drafter(self, drafter: Drafter) -> "TTTConfig":
        """CE only for drafters whose features live in their own space (EAGLE-3): nothing to regress."""
        return self if drafter.regresses_features else dataclasses.replace(self, loss="ce")


@dataclasses.dataclass
class StepStats:
    """Sums (not means) so results over several batches or samples combine exactly."""

    loss_sum: list[torch.Tensor]  # per step: summed per-token loss (differentiable)
    count: list[int]  # per step: valid positions
    top1: list[int]
    top3: list[int]
    chain_accept: int  # sum over step-0-valid positions of accepted draft tokens (greedy chain)
    positions: int  # step-0-valid positions

    def loss(self, cfg: TTTConfig) -> torch.Tensor:
        total = self.loss_sum[0].new_zeros(())
        for j, (s, n) in enumerate(zip(self.loss_sum, self.count)):
            if n:
                total = total + (cfg.decay ** j) * s / n
        return total

    def merge(self, other: "StepStats") -> "StepStats":
        return StepStats([a + b for a, b in zip(self.loss_sum, other.loss_sum)],
                         [a + b for a, b in zip(self.count, other.count)],
                         [a + b for a, b in zip(self.top1, other.top1)],
                         [a + b for a, b in zip(self.top3, other.top3)],
                         self.chain_accept + other.chain_accept, self.positions + other.positions)

    @property
    def accept_length(self) -> float:
        """Estimated tokens per verify step of a greedy chain of ``steps`` drafts (bonus included)."""
        return 1.0 + self.chain_accept / max(1, self.positions)

    def accuracy(self, step: int = 0, k: int = 1) -> float:
        hits = self.top1 if k == 1 else self.top3
        return hits[step] / max(1, self.count[step])


def _shift(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    # x: [B, T, ...], idx: [B, T] clamped in range -> x at idx
    if x.dim() == 2:
        return x.gather(1, idx)
    return x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))


def ttt_forward(drafter: Drafter, batch: Batch, cfg: TTTConfig,
                stop: Callable[[], bool] | None = None) -> StepStats | None:
    """Run ``cfg.steps`` self-feeding steps over ``batch``; see the module docstring.

    ``stop`` is called before every step after the first; when it returns True the forward is
    abandoned and None is returned (the caller drops the graph: no backward).
    """
    cfg = cfg.for_drafter(drafter)
    b, t = batch.input_ids.shape
    ar = torch.arange(t, device=batch.input_ids.device).expand(b, t)
    backend = batch.backend()
    head = drafter.target_head_weight
    feat = drafter.training_feature(batch.hidden, batch.aux).to(head.dtype)
    alive = torch.ones(b, t, dtype=torch.bool, device=ar.device)  # chain still fully accepted
    stats = StepStats([], [], [], [], 0, 0)
    for j in range(cfg.steps):
        if j and stop is not None and stop():
            return None
        tok_idx = ar + 1 + j
        ids = _shift(batch.input_ids, tok_idx.clamp(max=t - 1)) * (tok_idx < batch.doc_end)
        feat = drafter(ids, feat, batch.position_ids + j, backend)  # predicts f_{t+1+j}
        lbl_idx = ar + 2 + j
        valid = (lbl_idx < batch.doc_end) & _shift(batch.loss_mask, lbl_idx.clamp(max=t - 1))
        if j == 0:
            stats.positions = int(valid.sum())
        out = feat[valid]  # [N, H]
        with torch.no_grad():
            tgt_feat = _shift(batch.hidden, (ar + 1 + j).clamp(max=t - 1))[valid].to(head.dtype)
            tgt_logits = tgt_feat @ head.t()  # [N, V]
            label = tgt_logits.argmax(-1)  # the target's greedy token
            tgt_p = drafter.target_logits_to_draft(tgt_logits).float().softmax(-1)
        logp = drafter.logits(out).float().log_softmax(-1)
        loss = -(tgt_p * logp).sum(-1) * cfg.ce_weight
        if cfg.loss == "feature+ce":
            loss = loss + cfg.feature_weight * F.smooth_l1_loss(
                out.float(), tgt_feat.float(), reduction="none").mean(-1)
        with torch.no_grad():
            top = drafter.draft_to_target(logp.topk(min(3, logp.shape[-1]), -1).indices)
            hit1 = top[:, 0] == label
            hit3 = (top == label[:, None]).any(-1)
            ok = torch.zeros_like(alive)
            ok[valid] = hit1
            alive = alive & ok & valid
            stats.chain_accept += int(alive.sum())
        stats.loss_sum.append(loss.sum())
        stats.count.append(int(valid.sum()))
        stats.top1.append(int(hit1.sum()))
        stats.top3.append(int(hit3.sum()))
    return stats

