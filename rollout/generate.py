"""Plain autoregressive batched generation on the static KV cache.

Owns the reference decoding loop (right-padded prefill, one token per step, per-request stop) and
the sampling settings (:class:`SamplingParams`); each token is drawn by the coupled-sampling rule
of :mod:`tlt.rollout.sampling`, which the speculative engine reproduces token for token.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from tlt.rollout.draft_tree import right_pad
from tlt.rollout.attention import AttnMeta
from tlt.rollout.kv_cache import StaticKVCache
from tlt.rollout.sampling import RowSampling, sample
from tlt.rollout.target import TargetModel


MIN_TEMPERATURE = 1e-6  # a positive temperature's floor: fp32 logits / 1e-38 overflow


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 256
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_ids", tuple(int(t) for t in self.stop_ids))
        if any(not 0 <= t < 2**63 for t in self.stop_ids):
            raise ValueError(f"stop_ids must be token ids (0 <= id < 2**63), got {self.stop_ids}")
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, "
                             f"got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.max_new_tokens <= 0:
            raise ValueError(f"top_k must be >= 0 and max_new_tokens > 0, got {self.top_k}, "
                             f"{self.max_new_tokens}")


@torch.no_grad()
def generate(model: TargetModel, prompts: list[list[int]], params: SamplingParams,
             *, seeds: list[int] | None = None) -> list[list[int]]:
    """Response token ids per prompt (stop token included when hit); ``seeds``: one sampling seed
    per prompt (default 0, 1, ...), the key of :mod:`tlt.rollout.sampling`."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt and no empty prompt")
    if seeds is not None and len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    cfg, device = model.config, model.embed_weight.device
    b = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    span = int(lengths.max()) + params.max_new_tokens
    cache = StaticKVCache(cfg.num_hidden_layers, b, cfg.num_key_value_heads, span, cfg.head_dim,
                          dtype=model.embed_weight.dtype, device=device)
    ids = right_pad(prompts, device=device)  # [B, T]
    pos = torch.arange(ids.shape[1], device=device).expand_as(ids)
    rs = RowSampling.build([params] * b, seeds if seeds is not None else list(range(b)), device)
    t = ids.shape[1]  # right-padded: a shorter prompt's padding is written past it, then overwritten
    out = model(ids, pos, cache.backend(AttnMeta.rows(torch.zeros_like(lengths), t, span, span=t)))
    tok = sample(out.logits[torch.arange(b), lengths - 1][:, None], rs, lengths[:, None])[0][:, 0]
    results: list[list[int]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool, device=device)
    cur = lengths.clone()
    stops = torch.tensor(params.stop_ids, device=device, dtype=torch.long)
    for step in range(params.max_new_tokens):
        for i in torch.nonzero(~done).flatten().tolist():
            results[i].append(int(tok[i]))
        done |= torch.isin(tok, stops)
        if bool(done.all()) or step == params.max_new_tokens - 1:
            break
        slots = cur[:, None]
        out = model(tok[:, None], slots, cache.backend(AttnMeta.rows(cur, 1, span)))
        tok = sample(out.logits, rs, slots + 1)[0][:, 0]
        cur = cur + 1
    return results
