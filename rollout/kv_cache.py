"""Preallocated static KV cache written by slot, and the attention backend that reads it.

Owns the cache tensors (allocated once, so the hot step can be captured in a CUDA graph) and the
masks that say which cached slots each query sees: right-padded prefill, decode, and token trees.
Masks are additive float tensors; a masked entry holds the dtype's most negative finite value so
rows with nothing visible (padding) stay finite.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class StaticKVCache:
    """Keys/values for ``batch`` rows of up to ``max_len`` slots each, for every layer."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
                 *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if batch <= 0 or max_len <= 0:
            raise ValueError(f"batch and max_len must be > 0, got {batch=} {max_len=}")
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row0: int = 0) -> None:
        # slots: [B, T] long; k, v: [B, KV, T, D] written to rows row0..row0+B-1
        idx = slots[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        self.k[layer, row0: row0 + k.shape[0]].scatter_(2, idx, k)
        self.v[layer, row0: row0 + k.shape[0]].scatter_(2, idx, v)

    def compact_rows(self, keep: list[int]) -> None:
        """Row ``keep[i]`` becomes row ``i`` (finished requests retired, see :func:`swap_remove`)."""
        compact_rows((self.k, self.v), keep, dim=1)

    def move_slots(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Per (row, src slot, dst slot) triple, copy the keys/values (all layers) from src to dst.
        rows, src, dst: [N] long, no two pairs writing one slot; sources are read before writing."""
        if rows.numel():
            self.k[:, rows, :, dst] = self.k[:, rows, :, src]
            self.v[:, rows, :, dst] = self.v[:, rows, :, src]


def compact_rows(tensors: tuple[torch.Tensor, ...], keep: list[int], dim: int = 0) -> None:
    """Row ``keep[i]`` (index along ``dim``) becomes row ``i`` in every tensor: one batched copy of
    the rows that move. The one row-compaction routine of the target's and the drafter's caches and
    the engine's feature buffer; ``keep`` may be any selection (a source is read before writing)."""
    moved = [(new, old) for new, old in enumerate(keep) if new != old]
    if not moved:
        return
    dst, src = torch.tensor(moved, device=tensors[0].device).T  # [M] each, one upload
    for t in tensors:
        t.index_copy_(dim, dst, t.index_select(dim, src))


def swap_remove(n: int, gone: set[int]) -> list[int]:
    """New row order after retiring rows ``gone`` of ``n``: ``keep[i]`` is the old row that row
    ``i`` holds. Survivors past the new end fill the holes, so only as many rows move as holes lie
    below the new end (an order-preserving shift would move every row after the first hole).
    The engine and its proposers apply the same order to their caches and row lists."""
    m = n - len(gone)
    tail = iter(j for j in range(m, n) if j not in gone)
    return [next(tail) if i in gone else i for i in range(m)]


class CachedBackend:
    """Writes this step's keys/values to cache slots, then attends over the first ``S`` slots.
    The batch's rows are cache rows ``row0 ..`` (a prefill of requests joining running ones)."""

    def __init__(self, cache: StaticKVCache, slots: torch.Tensor, mask: torch.Tensor, row0: int = 0) -> None:
        self.cache, self.slots, self.row0 = cache, slots, row0  # slots: [B, T]
        self.mask = mask  # [B, 1, T, S] additive float
        self.span = mask.shape[-1]

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer_idx, self.slots, k, v, self.row0)
        rows = slice(self.row0, self.row0 + q.shape[0])
        keys = self.cache.k[layer_idx, rows, :, : self.span]
        vals = self.cache.v[layer_idx, rows, :, : self.span]
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=self.mask.to(q.dtype),
                                              enable_gqa=True)


def to_additive(visible: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Boolean visibility [B, T, S] -> additive mask [B, 1, T, S]."""
    neg = torch.finfo(dtype).min
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(
        ~visible, neg)[:, None]


def prefill_mask(lengths: torch.Tensor, span: int, start: torch.Tensor | None = None,
                 t: int | None = None) -> torch.Tensor:
    """Visibility for right-padded chunks: row b's token i sits at slot start_b + i.

    lengths: [B] valid tokens per row in this chunk; start: [B] tokens already cached; t: the
    longest chunk if the caller knows it on the host (else read from ``lengths``).
    Returns bool [B, T, S] with T = max(lengths); padded query rows see slot 0 only.
    """
    b = lengths.shape[0]
    t = int(lengths.max()) if t is None else t
    start = torch.zeros_like(lengths) if start is None else start
    qpos = start[:, None] + torch.arange(t, device=lengths.device)[None]  # [B, T]
    kpos = torch.arange(span, device=lengths.device)[None, None]  # [1, 1, S]
    visible = kpos <= qpos[..., None]
    valid_q = torch.arange(t, device=lengths.device)[None] < lengths[:, None]
    visible = visible & valid_q[..., None]
    visible[..., 0] |= ~valid_q
    assert visible.shape == (b, t, span)
    return visible


def tree_mask(prefix_len: torch.Tensor, parents: torch.Tensor, span: int) -> torch.Tensor:
    """Visibility for a token tree appended after each row's prefix.

    prefix_len: [B] cached tokens per row; parents: [B, T] index of each node's parent within the
    tree (-1 for children of the prefix), nodes in topological order. Node j sits at slot
    prefix_len_b + j and sees the whole prefix plus its ancestors and itself.
    """
    b, t = parents.shape
    # ancestor-or-self [B, T, T], closed by repeated squaring: ceil(log2(T)) batched products
    anc = torch.eye(t, dtype=torch.bool, device=parents.device).expand(b, t, t)
    if t > 1:  # a plain step's tree is its root alone
        anc = anc | (parents[..., None] == torch.arange(t, device=parents.device))  # self and parent
    for _ in range(max(t - 1, 0).bit_length()):
        anc = torch.bmm(anc.float(), anc.float()) > 0
    kpos = torch.arange(span, device=parents.device)[None, None]
    visible = kpos < prefix_len[:, None, None]
    off = prefix_len[:, None] + torch.arange(t, device=parents.device)[None]  # [B, T] node slots
    tree_slots = torch.zeros(b, t, span, dtype=torch.bool, device=parents.device)
    tree_slots.scatter_(2, off[:, None, :].expand(b, t, t), anc)
    return visible | tree_slots
