"""``tlt_varlen_sdpa``: attention over packed sequences for machines without flash-attn.

Owns one transformers attention function, registered under TLT's own name. verl's remove-padding
path (``use_remove_padding=true``) packs a micro-batch into one row ``[1, total_tokens]`` with
``position_ids`` restarting at 0 for each sequence, and on a GPU hands it to flash-attn's varlen
kernel. Without flash-attn, transformers' ``sdpa`` attends over the whole packed row with a
block-diagonal mask: cost quadratic in the micro-batch's tokens, not in each sequence's. On the
demo's target a fwd+bwd of 16 packed sequences (3,590 tokens, 1 thread) took 4.8 s that way, 1.6 s
padded and 0.7 s here, where each sequence gets its own causal ``scaled_dot_product_attention``.

Select it with ``actor_rollout_ref.model.override_config.attn_implementation=tlt_varlen_sdpa``
(``configs/tlt_grpo_cpu.yaml`` does). transformers builds no mask for a name it has no mask
function for, so the sequence boundaries come from ``position_ids`` alone; a padded batch (more
than one row) is refused, since its padding would be attended.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "tlt_varlen_sdpa"


def varlen_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                **kwargs) -> tuple[torch.Tensor, None]:
    """query: [1, H, S, D]; key, value: [1, Hkv, S, D]; ``position_ids`` [1, S] (0 starts a
    sequence). Returns ([1, S, H, D], None), as transformers' attention functions do."""
    pos = kwargs.get("position_ids")
    if query.shape[0] != 1 or pos is None:
        raise ValueError(f"{NAME} attends packed rows only (batch {query.shape[0]}, position_ids "
                         f"{'missing' if pos is None else tuple(pos.shape)}): set "
                         "actor_rollout_ref.model.use_remove_padding=true, or use attn_implementation=sdpa")
    pos = pos.reshape(-1)  # [S]
    bounds = (pos == 0).nonzero().flatten().tolist()
    if not bounds or bounds[0] != 0:
        bounds = [0, *bounds]
    bounds.append(pos.numel())
    outs = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout_p=dropout,
                                           is_causal=True, scale=scaling, enable_gqa=True)
            for a, b in zip(bounds[:-1], bounds[1:]) if b > a]  # each [1, H, len, D]
    return torch.cat(outs, 2).transpose(1, 2).contiguous(), None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_sdpa)
