"""How many blocks a paged KV pool holds, and what one block costs.

Owns :func:`block_bytes` (the device bytes of one block over every cache a block id addresses: the
target's keys and values in every layer, the feature buffer's row, and what proposers keep per
position, e.g. an EAGLE drafter's keys and values) and :func:`pool_blocks` (the blocks an
:class:`~tlt.rollout.engine_config.EngineConfig` sizes: ``kv_blocks``; ``kv_bytes`` divided by a
block's bytes; on CUDA, ``kv_fraction`` of the device's memory less what is allocated, as vLLM's
``gpu_memory_utilization``; or, given none, ``max_batch`` rows of ``max_len + max_draft_tokens``).
"""

from __future__ import annotations

import torch

from tlt.drafter.model_config import ModelConfig
from tlt.rollout.engine_config import EngineConfig


def block_bytes(config: ModelConfig, element_size: int, block_size: int, feature_width: int,
                proposer_position_bytes: int) -> int:
    """Bytes of one block of ``block_size`` positions: ``config`` (the target's) sets the
    KV's layers, KV heads and head dim; ``feature_width`` elements per position in the feature buffer;
    ``proposer_position_bytes`` bytes per position the proposers keep."""
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    return block_size * (element_size * (kv + feature_width) + proposer_position_bytes)


def pool_blocks(cfg: EngineConfig, device: torch.device, sized_block_bytes: int) -> int:
    """The usable blocks of ``cfg``'s paged pool (its scratch block not counted); ``sized_block_bytes``:
    what a pool sized by memory divides it by. ValueError when that memory holds no block."""
    if cfg.kv_blocks is not None:
        return cfg.kv_blocks
    if cfg.kv_bytes is not None:
        n, how = cfg.kv_bytes // sized_block_bytes, f"kv_bytes={cfg.kv_bytes}"
    elif cfg.kv_fraction is not None:
        if device.type != "cuda":
            raise ValueError(f"kv_fraction={cfg.kv_fraction} sizes the pool by a CUDA device's memory; on "
                             f"{device.type} give kv_bytes or kv_blocks")
        total = torch.cuda.get_device_properties(device).total_memory
        free = cfg.kv_fraction * total - torch.cuda.memory_allocated(device)
        n, how = int(free // sized_block_bytes), f"kv_fraction={cfg.kv_fraction} of {total / 2**30:.1f} GiB"
    else:  # today's capacity: max_batch rows of max_len + max_draft_tokens
        return cfg.max_batch * -(-cfg.slots // cfg.block_size)
    if n < 1:
        raise ValueError(f"{how} holds no block of {sized_block_bytes} bytes: give the pool more memory")
    return n
