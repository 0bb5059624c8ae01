"""The target features a rollout computed, kept where the KV cache keeps its keys and values.

Owns one device buffer laid out like the engine's KV cache (the rows layout: [rows, slots, F]; a
paged cache: [blocks, block_size, F]), so every address of a key or value addresses the feature of
the same position: the post-norm last hidden state (when something reads it), then the inputs of
the captured target layers (EAGLE-3's). It is allocated at its first write and freed with the cache
between rollouts. Prefill chunks and steps write it, accepted draft nodes move in it with their keys
and values, rows compact in it with the cache's; a leaving request's features are read back for the
engine's feature sink, and proposers read what they missed from a view of it. The engine decides
what is stored and when (:class:`~tlt.rollout.engine.RolloutEngine`); this module only keeps it.
"""

from __future__ import annotations

import torch

from tlt.rollout.kv_cache import compact_rows


class FeatureStore:
    def __init__(self, slots: tuple[int, int], device: torch.device) -> None:
        """slots: the cache's (rows, slots per row) or (blocks, block_size)."""
        self.slots, self.device = slots, device
        self.buf: torch.Tensor | None = None  # [*slots, F], None until the first write

    def write(self, feats: torch.Tensor, where: tuple[torch.Tensor, torch.Tensor], *, running: bool) -> None:
        """feats [B, T, F] at (block or row [B, T], offset [B, T]); a first write, or one of another
        width (what is captured changed), allocates the buffer: only with no request running."""
        if self.buf is None or self.buf.shape[-1] != feats.shape[-1]:
            if running:  # cannot happen: what is captured only changes between generations
                raise RuntimeError("the feature layout changed while requests were running")
            self.buf = torch.zeros(*self.slots, feats.shape[-1], dtype=feats.dtype, device=self.device)
        self.buf[where] = feats

    def move(self, src: tuple[torch.Tensor, torch.Tensor], dst: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The features at ``src`` to ``dst`` (address pairs, as :meth:`StaticKVCache.move` takes)."""
        self.buf[dst] = self.buf[src]

    def compact(self, keep: list[int]) -> None:
        """The rows layout: row ``keep[i]`` becomes row ``i``, as the cache's rows do."""
        if self.buf is not None:
            compact_rows((self.buf,), keep)

    def read(self, n: int, *, row: int | None = None, blocks: list[int] | None = None,
             block_size: int = 0) -> torch.Tensor:
        """A request's first ``n`` positions, on the host: [n, F]. Its cache ``row`` (the rows
        layout), or its ``blocks`` (a paged cache: position p in block p // block_size)."""
        if row is not None:
            return self.buf[row, :n].to("cpu", copy=True)
        table = torch.tensor(blocks, device=self.device)
        pos = torch.arange(n, device=self.device)
        return self.buf.flatten(0, 1)[table[pos // block_size] * block_size + pos % block_size].to("cpu", copy=True)

    def view(self, layers: tuple[int, ...] | None, hidden_size: int, stores_hidden: bool) -> torch.Tensor | None:
        """What a proposer reads ([*slots, H] or [*slots, A*H]): the hidden state (``layers == ()``),
        the captured layers, or nothing (``layers`` None, or nothing stored yet)."""
        if layers is None or self.buf is None:
            return None
        if layers == ():
            return self.buf[..., :hidden_size]
        return self.buf[..., hidden_size:] if stores_hidden else self.buf

    def release(self) -> int:
        """Free the buffer (the next write allocates it again); returns the bytes freed."""
        freed = 0 if self.buf is None else self.buf.nbytes
        self.buf = None
        return freed
