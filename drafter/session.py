"""What one spot-training session is given and returns: the rank's place in it, the training
config, the result, and the thread-safe preemption flag. The session itself is
:mod:`tlt.drafter.spot`, which re-exports these names.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Sequence

from tlt.drafter.packing import FeatureSample
from tlt.drafter.ttt import TTTConfig

STOP_REASONS = ("preempted", "max_steps", "no_data")
NextBatch = Callable[[int], Sequence[FeatureSample]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SessionSpec:
    """This rank's place in one training session (from the coordinator's PROMOTE message)."""

    rank: int
    world_size: int
    master_addr: str = "127.0.0.1"
    master_port: int
    session_id: str

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size}: a session needs at least 1 rank")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} must be in 0..{self.world_size - 1} (world_size)")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port={self.master_port} must be in 1..65535")
        if not self.master_addr or not self.session_id:
            raise ValueError("master_addr and session_id must be non-empty")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpotConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # 0 disables clipping
    token_budget: int = 4096  # tokens per rank per micro-step
    micro_steps: int = 1  # micro-steps (gradient accumulation) per optimizer step
    interval: int = 50  # optimizer steps between async checkpoints
    keep_last: int = 2  # complete checkpoints kept on disk
    # Snapshot copy overlapping the next forward/backward (AsyncCheckpointer.overlap_staging).
    # None = on CUDA only: on a CPU-only host the copy competes with the compute threads and
    # costs more than copying inside save() (measured by `tlt bench checkpoint`).
    overlap_staging: bool | None = None
    max_steps: int | None = None  # total optimizer steps over all sessions; None = until stopped
    # False: next_batch(world * budget) returns the same list on every rank, which is sharded.
    # True: next_batch(budget) returns this rank's own samples (e.g. its local DataBuffer).
    local_data: bool = False
    # Stop-check interval target (seconds): micro-steps are trained in chunks that take about this
    # long (from the measured tokens/s). None: one chunk per micro-step (exact accumulation order).
    preempt_s: float | None = None
    ttt: TTTConfig = TTTConfig()
    # Learning rate by optimizer step: linear warm-up over ``warmup_steps``, then cosine decay to
    # ``lr * min_lr_ratio`` at ``decay_steps`` (None: constant, the spot trainer's default).
    warmup_steps: int = 0
    decay_steps: int | None = None
    min_lr_ratio: float = 1.0
    seed: int = 0  # drafter init when there is neither a checkpoint nor init_from
    mixed_precision: bool = True  # CUDA only: bf16 compute, fp32 master weights and reduction
    timeout_s: float = 120.0  # process-group collective timeout
    rendezvous_timeout_s: float = 30.0  # all ranks must meet within this (a STOP aborts it sooner)

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr} must be > 0")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError(f"weight_decay={self.weight_decay} and grad_clip={self.grad_clip} "
                             "must be >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas={self.betas} must be two numbers in [0, 1)")
        for name in ("token_budget", "micro_steps", "interval", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError(f"max_steps={self.max_steps} must be >= 0 or None (until stopped)")
        if self.preempt_s is not None and self.preempt_s <= 0:
            raise ValueError(f"preempt_s={self.preempt_s} must be > 0 seconds or None (no chunking)")
        if self.timeout_s <= 0 or self.rendezvous_timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s} and rendezvous_timeout_s="
                             f"{self.rendezvous_timeout_s} must be > 0")
        if self.warmup_steps < 0 or (self.decay_steps is not None and self.decay_steps < 1):
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0 and decay_steps="
                             f"{self.decay_steps} >= 1 or None (constant after the warm-up)")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.decay_steps is None:
            return self.lr
        frac = min(1.0, (step - self.warmup_steps) / max(1, self.decay_steps - self.warmup_steps))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SessionResult:
    session_id: str
    rank: int
    world_size: int
    start_step: int  # resumed from this step (0 when there was no checkpoint)
    end_step: int
    losses: tuple[float, ...]  # global loss per optimizer step of this session
    stop_reason: str  # one of STOP_REASONS
    preempt_latency_s: float | None  # this rank's flag set -> loop exited (None: not preempted here)
    stop_latency_s: float | None  # this rank's flag set -> final checkpoint durable, group gone
    checkpoint_step: int | None  # newest complete checkpoint when the session ended
    check_interval_s: tuple[float, ...]  # between consecutive stop checks: the preemption granularity
    checkpoint_stall_s: tuple[float, ...]  # loop time blocked in each checkpoint save
    tokens_per_s: float | None = None  # this rank's measured training throughput (chunk sizing)
    phase_s: tuple[float, ...] = ()  # seconds in: forming the group, build + resume, training, final save
    warm: bool = False  # resumed from this process's memory (no checkpoint read)
    # greedy-chain accept length of the session's batches, each scored by the forward it was then
    # trained with (progressive validation: never data the weights had seen); None: nothing trained
    heldout_accept_length: float | None = None

    @property
    def steps(self) -> int:
        return self.end_step - self.start_step


class PreemptFlag:
    """Thread-safe stop request that remembers when it was first raised (``time.monotonic``)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.set_at: float | None = None

    def set(self) -> None:
        if not self._event.is_set():
            self.set_at = time.monotonic()
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    __call__ = is_set
