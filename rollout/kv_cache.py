"""Preallocated static KV cache written by slot, and the tree masks of a step's own tokens.

Owns the cache tensors (allocated once, so the hot step can be captured in a CUDA graph), their
one row-compaction routine, and the ancestor closure of a draft tree (which of a step's own tokens
each one sees). In :mod:`tlt.rollout.attention`'s terms the cache is the one-block-per-row layout:
cache row ``r`` is block ``r`` of ``max_len`` slots, and a row's table is ``[r]``
(:meth:`AttnMeta.rows <tlt.rollout.attention.AttnMeta.rows>`); padding rows of a static step are
free rows, which hold no live request.
"""

from __future__ import annotations

import torch

from tlt.rollout.attention import AttnMeta, PagedBackend
from tlt.rollout.step_upload import StepUpload


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

    @property
    def released(self) -> bool:
        """The keys and values were freed (:meth:`release`) and not allocated again."""
        return self.k.untyped_storage().nbytes() == 0

    def release(self) -> int:
        """Free the keys' and values' memory, keeping the tensors (and every view of them) for
        :meth:`restore`; returns the bytes freed. Reading them before a restore is an error."""
        freed = 0
        for t in (self.k, self.v):
            freed += t.untyped_storage().nbytes()
            t.untyped_storage().resize_(0)
        return freed

    def restore(self) -> None:
        """Allocate the released keys and values again (zeros; at new addresses, so graphs captured
        over the old ones are stale)."""
        for t in (self.k, self.v):
            if t.untyped_storage().nbytes() == 0:
                t.untyped_storage().resize_(t.numel() * t.element_size())
                t.zero_()

    def backend(self, meta: AttnMeta) -> PagedBackend:
        """The attention backend of one step laid out by ``meta`` over this cache."""
        return PagedBackend(self.k, self.v, meta)

    def compact_rows(self, keep: list[int]) -> None:
        """Row ``keep[i]`` becomes row ``i`` (finished requests retired, see :func:`swap_remove`)."""
        compact_rows((self.k, self.v), keep, dim=1)

    def move(self, src: tuple[torch.Tensor, torch.Tensor], dst: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Copy the keys/values (all layers) at (block, offset) pairs src to dst: each a pair of long
        tensors of one shape, no two pairs writing one slot; sources are read before writing. (In the
        one-block-per-row layout a block is a row and an offset its slot.)"""
        if src[0].numel():
            self.k[:, dst[0], :, dst[1]] = self.k[:, src[0], :, src[1]]
            self.v[:, dst[0], :, dst[1]] = self.v[:, src[0], :, src[1]]


def compact_rows(tensors: tuple[torch.Tensor, ...], keep: list[int], dim: int = 0,
                 upload: StepUpload | None = None) -> None:
    """Row ``keep[i]`` (index along ``dim``) becomes row ``i`` in every tensor: one batched copy of
    the rows that move. The one row-compaction routine of the target's and the drafter's caches and
    the engine's feature buffer; ``keep`` may be any selection (a source is read before writing).
    The indices travel in one upload: ``upload``'s (the copy then waits for its flush), or its own."""
    moved = [(new, old) for new, old in enumerate(keep) if new != old]
    if not moved:
        return

    def copy(idx: torch.Tensor) -> None:  # idx [2, M]: destinations, then sources
        for t in tensors:
            t.index_copy_(dim, idx[0], t.index_select(dim, idx[1]))

    up = upload if upload is not None else StepUpload(tensors[0].device)
    up.add([new for new, _ in moved] + [old for _, old in moved], (2, len(moved)), copy)
    if upload is None:
        up.flush()


def swap_remove(n: int, gone: set[int]) -> list[int]:
    """New row order after retiring rows ``gone`` of ``n``: ``keep[i]`` is the old row that row
    ``i`` holds. Survivors past the new end fill the holes, so only as many rows move as holes lie
    below the new end (an order-preserving shift would move every row after the first hole).
    The engine and its proposers apply the same order to their caches and row lists."""
    m = n - len(gone)
    tail = iter(j for j in range(m, n) if j not in gone)
    return [next(tail) if i in gone else i for i in range(m)]


def tree_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """[B, T, T] bool: node ``i`` sees node ``j`` iff ``j`` is ``i`` or one of its ancestors.
    parents: [B, T] index of each node's parent within the tree (-1: a child of the prefix), nodes in
    topological order. Closed by repeated squaring: ceil(log2(T)) batched products."""
    b, t = parents.shape
    anc = torch.eye(t, dtype=torch.bool, device=parents.device).expand(b, t, t)
    if t > 1:  # a plain step's tree is its root alone
        anc = anc | (parents[..., None] == torch.arange(t, device=parents.device))  # self and parent
    for _ in range(max(t - 1, 0).bit_length()):
        anc = torch.bmm(anc.float(), anc.float()) > 0
    return anc
