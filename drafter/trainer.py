"""Single-process drafter training loop with atomic, resumable checkpoints.

Owns the optimizer schedule, packed mini-batches, evaluation (top-1/top-3 accuracy and the
estimated accept length of a greedy chain) and the warm-up checkpoint directory: drafter weights
(safetensors + config) plus ``trainer_state.pt`` (optimizer, step, RNG). Every save replaces the
directory's files atomically, so a crash leaves the previous complete checkpoint.
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

from drafter.eagle import Drafter
from drafter.packing import FeatureSample, pack, pack_by_budget
from drafter.ttt import StepStats, TTTConfig, ttt_forward

log = logging.getLogger(__name__)
STATE_NAME = "trainer_state.pt"


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
    start, epoch_pos = 0, 0
    rng = random.Random(cfg.seed)
    if resume and out_dir is not None and (out_dir / STATE_NAME).is_file():
        state = torch.load(out_dir / STATE_NAME, weights_only=False)
        drafter.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start, epoch_pos = state["step"], state["epoch_pos"]
        rng.setstate(state["epoch_rng"])
        log.info("resumed from step %d in %s", start, out_dir)

    def new_epoch() -> tuple[object, list[list[FeatureSample]]]:
        state = rng.getstate()  # replaying this shuffle restores the epoch on resume
        shuffled = list(samples)
        rng.shuffle(shuffled)
        return state, pack_by_budget(shuffled, cfg.token_budget)

    epoch_rng, epoch = new_epoch()
    losses: list[float] = []
    drafter.train()
    bar = tqdm(range(start, cfg.max_steps), desc="train drafter", disable=not progress,
               initial=start, total=cfg.max_steps)
    for step in bar:
        if epoch_pos >= len(epoch):
            (epoch_rng, epoch), epoch_pos = new_epoch(), 0
        batch = pack(epoch[epoch_pos])
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
            save_checkpoint(drafter, opt, out_dir, extra,
                            {"step": done, "epoch_rng": epoch_rng, "epoch_pos": epoch_pos})
    return losses


def save_checkpoint(drafter: Drafter, opt: torch.optim.Optimizer, out_dir: Path,
                    extra: dict | None, progress_state: dict) -> None:
    """Write weights, config and trainer state to a temp dir, then move each file into place.

    ``trainer_state.pt`` holds the weights too, so resuming never pairs an optimizer state with
    weights from another step even if a crash falls between two of the moves.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".ckpt-", dir=out_dir))
    try:
        drafter.save(tmp, extra={"step": progress_state["step"], **(extra or {})})
        torch.save({"model": drafter.state_dict(), "optimizer": opt.state_dict(), **progress_state},
                   tmp / STATE_NAME)
        for f in tmp.iterdir():
            os.replace(f, out_dir / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
