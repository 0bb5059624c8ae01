"""Offline drafter training over a fixed sample set: the spot trainer's loop as a one-rank session.

The training stage of the warm-up pipeline (:mod:`tlt.warmup`, which also generates rollouts and
captures features); resume state between spot sessions is :mod:`tlt.drafter.resume_state`. Owns the
training settings (:class:`TrainConfig`: step budget, cosine schedule, checkpoint
interval), the seeded epoch order of its packed batches (:class:`EpochBatches`, replayed exactly on
resume), evaluation (top-1/top-3 accuracy and the estimated accept length of a greedy chain) and the
warm-up directory. The loop itself is :class:`tlt.drafter.spot.SpotTrainer`'s (world size 1), so the
warm-up and spot training share one loop and one checkpoint format: the training state lives under
``trainer_state/`` as the spot trainer's DCP checkpoints (selective: weights and optimizer, never
the target; committed by rename, the last one kept), which ``--resume`` continues, and the drafter
weights (safetensors + config) are replaced atomically when training ends (before that, the
directory holds the drafter the run started from). Epoch order is a function of (seed, epoch).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from tlt.drafter.seeds import derive
from tlt.drafter.checkpoint import load_weights
from tlt.drafter.eagle import Drafter
from tlt.drafter.packing import FeatureSample, pack, pack_by_budget
from tlt.drafter.resume_state import STATE_NAME
from tlt.drafter.spot import SessionSpec, SpotConfig, SpotTrainer
from tlt.drafter.ttt import StepStats, TTTConfig, ttt_forward

log = logging.getLogger(__name__)


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
        if self.max_steps < 0:
            raise ValueError(f"max_steps (--max-steps) {self.max_steps}: must be >= 0 (0: no training)")
        if not self.lr > 0:
            raise ValueError(f"lr (--lr) {self.lr}: must be > 0")
        if self.token_budget <= 0:
            raise ValueError(f"token_budget (--token-budget) {self.token_budget}: must be > 0")
        if self.save_every <= 0:
            raise ValueError(f"save_every (--save-every) {self.save_every}: must be > 0")
        self.spot_config()  # the schedule's own checks

    def spot_config(self) -> SpotConfig:
        """The spot trainer's settings for this warm-up: one rank, its own data, a step budget and
        a cosine schedule that ends at ``max_steps``."""
        return SpotConfig(lr=self.lr, weight_decay=self.weight_decay, grad_clip=self.grad_clip,
                          token_budget=self.token_budget, interval=self.save_every, keep_last=1,
                          max_steps=self.max_steps, local_data=True, ttt=self.ttt,
                          warmup_steps=self.warmup_steps, decay_steps=max(1, self.max_steps),
                          min_lr_ratio=self.min_lr_ratio, seed=self.seed)


class EpochBatches:
    """The warm-up's batches: each epoch a seeded shuffle packed to ``token_budget`` tokens.

    Called by the spot loop once per micro-step; ``seek`` replays the order up to a resumed state."""

    def __init__(self, samples: Sequence[FeatureSample], token_budget: int, seed: int) -> None:
        self.samples, self.token_budget, self.seed = list(samples), token_budget, seed
        self.epoch, self.pos = 0, 0
        self.batches = self._epoch(0)

    def _epoch(self, e: int) -> list[list[FeatureSample]]:
        shuffled = list(self.samples)
        random.Random(derive(self.seed, e)).shuffle(shuffled)
        return pack_by_budget(shuffled, self.token_budget)

    def __call__(self, want: int) -> list[FeatureSample]:
        if self.pos >= len(self.batches):
            self.epoch, self.pos = self.epoch + 1, 0
            self.batches = self._epoch(self.epoch)
        self.pos += 1
        return self.batches[self.pos - 1]

    def seek(self, consumed: int) -> None:
        """Skip the batches that held the first ``consumed`` samples."""
        left = consumed
        while left > 0:
            left -= len(self(self.token_budget))
        if left:
            raise ValueError(f"the checkpoint consumed {consumed} samples, which does not end on a batch of "
                             "these samples: it was trained on other data; start without --resume")


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
    """Train ``drafter`` (in place) to ``cfg.max_steps`` optimizer steps; returns this run's losses.

    With ``resume`` and a checkpoint in ``out_dir`` the run continues from its step, replaying the
    interrupted epoch's shuffle, so an interrupted-and-resumed run equals an uninterrupted one.
    Without ``resume`` an earlier training state in ``out_dir`` is replaced.
    """
    if not samples:
        raise ValueError("no training samples: the data produced no response tokens")
    scratch = None if out_dir is not None else Path(tempfile.mkdtemp(prefix="tlt-warmup-"))
    root = (out_dir if out_dir is not None else scratch) / STATE_NAME
    if not resume:
        shutil.rmtree(root, ignore_errors=True)
        if out_dir is not None:  # the directory is a loadable drafter from the start
            save_weights(drafter, out_dir, {"step": 0, **(extra or {})})
    trainer = SpotTrainer(spec=SessionSpec(rank=0, world_size=1, master_port=_free_port(), session_id="warmup"),
                          config=cfg.spot_config(), drafter_config=drafter.config,
                          embed_weight=drafter.embed_weight, head_weight=drafter.target_head_weight,
                          checkpoint_root=root, init_from=drafter.state_dict())
    bar = tqdm(total=cfg.max_steps, desc="train drafter", disable=not progress)

    def on_step(step: int, loss: float) -> None:
        bar.n = step
        bar.set_postfix(loss=f"{loss:.3f}")

    try:
        result = trainer.run(EpochBatches(samples, cfg.token_budget, cfg.seed), lambda: False, on_step)
        step = load_weights(root, drafter, frozen=(drafter.embed_weight, drafter.target_head_weight))
        if out_dir is not None and step is not None:
            save_weights(drafter, out_dir, {"step": step, **(extra or {})})
    finally:
        bar.close()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if result.start_step:
        log.info("resumed from step %d in %s", result.start_step, out_dir)
    return list(result.losses)


def save_weights(drafter: Drafter, out_dir: Path, extra: dict) -> None:
    """The drafter's weights and config into ``out_dir``, each file replaced atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".ckpt-", dir=out_dir))
    try:
        drafter.save(tmp, extra=extra)
        for f in tmp.iterdir():
            os.replace(f, out_dir / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
