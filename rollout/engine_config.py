"""The engine's configuration: batch and length limits, speculation (a fixed arm or the tuner's,
the elastic threshold), static shapes and CUDA graphs, the attention kernel, prefill chunking and
the KV cache's layout (static rows or a paged pool and how it is sized, the eviction rule).

Owns the keys, their defaults and their validation (one check per key, ValueError naming the key
and the value); :class:`~tlt.rollout.engine.RolloutEngine` reads them.
"""

from __future__ import annotations

import dataclasses

from tlt.rollout.attention import KERNELS
from tlt.rollout.eviction import RULES
from tlt.rollout.strategy import Arm


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    max_batch: int = 64
    max_len: int = 2048  # prompt + new tokens per request
    max_draft_tokens: int = 64  # largest draft tree (extra KV slots per request)
    # speculate only while running requests <= this; None: at any batch size where the tuner's
    # arms (its "off" arm is in every bucket) find it pays -- the learned threshold
    elastic_threshold: int | None = None
    arm: Arm | None = None  # fixed strategy; None = ask the tuner
    seed: int = 0
    # Static step shapes (batch padded to a captured size, tree to the arm's width, attention over
    # the whole cache): what CUDA graphs need. None: on CUDA only (eager dynamic shapes on CPU).
    static_shapes: bool | None = None
    cuda_graphs: bool = True  # with static shapes on CUDA: replay captured graphs (rollout.static_step)
    # tokens per prefill forward, over the joining rows: a longer prefill runs in chunks (bounded memory)
    prefill_tokens: int = 16384
    # attention kernel (tlt.rollout.attention): "auto" = the Triton kernel on CUDA (each row reads its
    # own length), else the torch path; "torch" = the torch path everywhere (SDPA under one mask)
    attention: str = "auto"
    # a step shape's first uses run eagerly and its CUDA graph is captured at this use (1: at the
    # first): an arm the tuner tries once costs an eager step, not a capture
    capture_after: int = 2
    # The KV cache's layout. None: one block of max_len + max_draft_tokens slots per row, rows
    # compacted by copying (the static cache). N: a paged cache of N-position blocks shared by the
    # target's KV, the drafter's KV and the feature buffer, held as requests grow and freed as they
    # leave; kv_blocks of them (None: max_batch rows' worth), and when the pool cannot grow every running
    # row for the next step, that step runs without speculation, then requests are evicted (by
    # ``eviction``) and prefilled again later, token-identical (tlt.rollout.eviction).
    block_size: int | None = None
    kv_blocks: int | None = None
    # or the pool sized by memory (per block: the target's KV, the feature buffer and the proposers'
    # KV, RolloutEngine.block_bytes): kv_bytes bytes
    # (any device), or on CUDA kv_fraction of the device's total memory less what is allocated (the
    # weights) when the engine is built, as vLLM's gpu_memory_utilization
    kv_bytes: int | None = None
    kv_fraction: float | None = None
    # bytes per position such a pool also keeps for proposers set after construction (a first
    # spot-trained EAGLE drafter's keys and values); proposers that outgrow it are refused
    draft_position_bytes: int = 0
    eviction: str = "youngest"

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_len < 2:
            raise ValueError(f"max_batch >= 1 and max_len >= 2 required, got {self.max_batch}, {self.max_len}")
        if self.prefill_tokens < 16:
            raise ValueError(f"prefill_tokens={self.prefill_tokens}: at least 16 tokens per prefill forward")
        if self.attention not in KERNELS:
            raise ValueError(f"attention={self.attention!r}: use one of {KERNELS}")
        if self.capture_after < 1:
            raise ValueError(f"capture_after={self.capture_after}: a shape is captured at its first use or later (>= 1)")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size={self.block_size}: None (one block per row) or >= 1 positions per block")
        if self.kv_blocks is not None and (self.block_size is None or self.kv_blocks < 1):
            raise ValueError(f"kv_blocks={self.kv_blocks}: needs a block_size, and at least 1 block")
        if self.kv_bytes is not None and (self.block_size is None or self.kv_bytes < 1):
            raise ValueError(f"kv_bytes={self.kv_bytes}: needs a block_size, and a positive byte count")
        if self.kv_fraction is not None and (self.block_size is None or not 0 < self.kv_fraction <= 1):
            raise ValueError(f"kv_fraction={self.kv_fraction}: needs a block_size, and a fraction in (0, 1]")
        if sum(x is not None for x in (self.kv_blocks, self.kv_bytes, self.kv_fraction)) > 1:
            raise ValueError("kv_blocks, kv_bytes and kv_fraction each size the pool: give one")
        if self.draft_position_bytes < 0:
            raise ValueError(f"draft_position_bytes={self.draft_position_bytes}: bytes per position, >= 0")
        if self.eviction not in RULES:
            raise ValueError(f"eviction={self.eviction!r}: use one of {RULES}")
        if self.max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be >= 0, got {self.max_draft_tokens}")
        if self.arm is not None and self.arm.tokens_to_verify > self.max_draft_tokens:
            raise ValueError(f"arm {self.arm} verifies more than max_draft_tokens={self.max_draft_tokens}")
        if self.elastic_threshold is not None and self.elastic_threshold < 0:
            raise ValueError(f"elastic_threshold must be None or >= 0, got {self.elastic_threshold}")

    @property
    def slots(self) -> int:
        """Positions a request may reach: its tokens and a draft tree."""
        return self.max_len + self.max_draft_tokens
