"""Prefill in bounded memory: the target's forward over joining requests, in chunks, without logits.

Owns :func:`prefill_last_hidden`. The right-padded prompts run in chunks of ``chunk`` positions over
the rows that still have tokens there (a row whose prompt ended drops out); each chunk attends to the
chunks cached before it without a mask and causally within itself, and writes its keys and values
into its rows' cache rows or blocks. No position gets logits: the function returns each prompt's last
hidden state, so the caller asks the LM head for one position per request. Each chunk's output goes
to ``keep`` (the engine writes its features into its buffer). Memory is bounded by the chunk, not by
the prompt: no ``[T, T]`` mask, no ``[B, T, V]`` logits. A chunk's query rows fill the device, so it
runs with no context splits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tlt.rollout.attention import AttnMeta
from tlt.rollout.kv_cache import StaticKVCache
from tlt.rollout.target import TargetModel


@torch.no_grad()
def prefill_last_hidden(target: TargetModel, cache: StaticKVCache, ids: torch.Tensor, lens: torch.Tensor,
                        host_lens: list[int], *, chunk: int, row0: int, tables: torch.Tensor | None,
                        kernel: str, scratch: int, capture: tuple[int, ...],
                        keep: Callable[[object, AttnMeta, int], None]) -> torch.Tensor:
    """The last hidden state of each prompt, [B, H], after caching every position's keys and values.

    ``ids``: [B, T] right-padded prompts; ``lens``: [B] their lengths on the device, ``host_lens`` the
    same on the host. The rows are cache rows ``row0 ..`` (``tables`` None) or, on a paged cache, the
    blocks of ``tables`` [B, C] int32 (``scratch``: the block no live row reads). ``capture``: the
    target layers whose inputs the forward records; ``keep(out, meta, c0)`` receives each chunk's
    output and layout, its first position ``c0``."""
    b, t = ids.shape
    device = ids.device
    last = torch.zeros(b, target.config.hidden_size, dtype=cache.k.dtype, device=device)  # [B, H]
    for c0 in range(0, t, chunk):
        alive = [i for i, n in enumerate(host_lens) if n > c0]
        tc = min(chunk, max(host_lens[i] for i in alive) - c0)
        ctx = torch.full((len(alive),), c0, device=device)  # [A]
        idx = torch.arange(b, device=device) if len(alive) == b else torch.tensor(alive, device=device)  # [A]
        part = ids[idx, c0: c0 + tc] if len(alive) < b else ids[:, c0: c0 + tc]  # [A, tc]
        if tables is not None:  # a paged cache: the rows' blocks
            meta = AttnMeta(tables[idx], cache.max_len, torch.zeros_like(ctx), ctx, tc, span=c0 + tc,
                            kernel=kernel, scratch=scratch)
        elif len(alive) == b:  # every row: cache rows row0 .. (views)
            meta = AttnMeta.rows(ctx, tc, cache.max_len, row0=row0, span=c0 + tc, kernel=kernel)
        else:  # the rows still going: their cache rows by block table
            meta = AttnMeta((row0 + idx)[:, None].int(), cache.max_len, torch.zeros_like(ctx), ctx, tc,
                            span=c0 + tc, kernel=kernel)
        pos = torch.arange(c0, c0 + tc, device=device).expand(len(alive), tc)  # [A, tc]
        out = target(part, pos, cache.backend(meta), capture=capture, logits=False)
        n = lens[idx]  # [A]
        h = out.hidden[torch.arange(len(alive), device=device), (n - 1 - c0).clamp(0, tc - 1)]  # [A, H]
        last[idx] = torch.where(((n - 1 >= c0) & (n - 1 < c0 + tc))[:, None], h, last[idx])
        keep(out, meta, c0)
    return last
