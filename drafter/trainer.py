"""Single-process drafter training loop with atomic, resumable checkpoints.

Owns the optimizer schedule, packed mini-batches, evaluation (top-1/top-3 accuracy and the
estimated accept length of a greedy chain) and the warm-up checkpoint directory: drafter weights
(safetensors + config) plus the training state under ``trainer_state/`` in the spot trainer's
format (:mod:`drafter.checkpoint`: DCP, selective — weights and optimizer, never the target —
committed by rename, the last one kept). Weights and state are each replaced atomically, the state
first, so a crash leaves the previous complete checkpoint; a resume reads weights and optimizer
from the same state. Epoch order is a function of (seed, epoch), so a resume replays it exactly.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from drafter import checkpoint as ckpt
from drafter.eagle import Drafter
from drafter.packing import FeatureSample, pack, pack_by_budget
from drafter.ttt import StepStats, TTTConfig, ttt_forward

log = logging.getLogger(__name__)
STATE_NAME = "trainer_state"  # DCP checkpoints (drafter.checkpoint layout), newest kept


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    max_steps: int = 300
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    token_budget: int = 4096
    save_every: int = 100
    seed: int = 0
    ttt: TTTConfig = TTTConfig()

    def __post_init__(self) -> None:
        if self.max_steps < 0 or self.lr <= 0 or self.token_budget <= 0 or self.save_every <= 0:
            raise ValueError("max_steps >= 0, lr > 0, token_budget > 0 and save_every > 0 are "
                             f"required; got {self.max_steps=}, {self.lr=}, {self.token_budget=}, "
                             f"{self.save_every=}")

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        frac = (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def evaluate(drafter: Drafter, samples: Sequence[FeatureSample], ttt: TTTConfig,
             token_budget: int = 8192) -> StepStats:
    was_training = drafter.training
    drafter.eval()
    total = None
    for group in pack_by_budget(samples, token_budget):
        st = ttt_forward(drafter, pack(group), ttt)
        total = st if total is None else total.merge(st)
    drafter.train(was_training)
    assert total is not None, "evaluate needs at least one sample"
    return total


def train(drafter: Drafter, samples: Sequence[FeatureSample], cfg: TrainConfig, out_dir: Path | None,
          *, resume: bool = False, progress: bool = True, extra: dict | None = None) -> list[float]:
    """Train for ``cfg.max_steps`` optimizer steps, one packed batch each; returns the losses.

    With ``resume`` and a checkpoint in ``out_dir`` the run continues from its step, replaying the
    interrupted epoch's shuffle, so an interrupted-and-resumed run equals an uninterrupted one.
    """
    if not samples:
        raise ValueError("no training samples: the data produced no response tokens")
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    state = ckpt.TrainState(drafter, opt, frozen=(drafter.embed_weight, drafter.target_head_weight),
                            progress={"epoch": 0, "epoch_pos": 0})
    if resume and out_dir is not None and ckpt.latest(out_dir / STATE_NAME) is not None:
        ckpt.load(out_dir / STATE_NAME, {"train": state})
        log.info("resumed from step %d in %s", state.step, out_dir)
    start, epoch, epoch_pos = state.step, state.progress["epoch"], state.progress["epoch_pos"]

    def epoch_batches(e: int) -> list[list[FeatureSample]]:
        shuffled = list(samples)
        random.Random(cfg.seed * 1_000_003 + e).shuffle(shuffled)
        return pack_by_budget(shuffled, cfg.token_budget)

    batches = epoch_batches(epoch)
    losses: list[float] = []
    drafter.train()
    bar = tqdm(range(start, cfg.max_steps), desc="train drafter", disable=not progress,
               initial=start, total=cfg.max_steps)
    for step in bar:
        if epoch_pos >= len(batches):
            epoch, epoch_pos = epoch + 1, 0
            batches = epoch_batches(epoch)
        batch = pack(batches[epoch_pos])
        epoch_pos += 1
        for g in opt.param_groups:
            g["lr"] = cfg.lr_at(step)
        stats = ttt_forward(drafter, batch, cfg.ttt)
        loss = stats.loss(cfg.ttt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", acc=f"{stats.accuracy(0):.2f}")
        done = step + 1
        if out_dir is not None and (done % cfg.save_every == 0 or done == cfg.max_steps):
            state.step, state.progress = done, {"epoch": epoch, "epoch_pos": epoch_pos}
            save_checkpoint(drafter, state, out_dir, extra)
    return losses


def save_checkpoint(drafter: Drafter, state: ckpt.TrainState, out_dir: Path, extra: dict | None) -> None:
    """Commit the training state (DCP, rename), drop older states, then move the weights in place.

    The state holds the weights too, so resuming never pairs an optimizer state with weights from
    another step even if a crash falls between the two commits.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    root = out_dir / STATE_NAME
    ckpt.save_sync(root, state.step, {"train": state})
    ckpt.prune(root, keep_last=1)
    tmp = Path(tempfile.mkdtemp(prefix=".ckpt-", dir=out_dir))
    try:
        drafter.save(tmp, extra={"step": state.step, **(extra or {})})
        for f in tmp.iterdir():
            os.replace(f, out_dir / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
