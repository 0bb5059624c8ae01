"""Which blocks of a paged cache each request holds: the host's bookkeeping between steps.

Owns :class:`BlockPool`: a fixed number of blocks of ``block_size`` positions, a free list, and the
blocks each request holds, in position order (a request's position ``p`` lives in its block
``p // block_size``). One pool serves every cache laid out by the same block ids (the target's KV,
the drafter's KV, the feature buffer): a block id addresses all of them. The last block is the
scratch block no request ever holds: padding rows and positions past a request's blocks point at
it (:class:`~tlt.rollout.attention.AttnMeta`'s ``scratch``). No tensors, no device: the engine
turns :meth:`table` into the device block table of its step.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable


class PoolExhausted(RuntimeError):
    """The pool has fewer free blocks than asked for (the caller evicts, or waits)."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: at least one usable block and the scratch block")
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: at least 1 position per block")
        self.block_size = block_size
        self.scratch = num_blocks - 1
        self._free = list(range(num_blocks - 2, -1, -1))  # a stack: the lowest ids are handed out first
        self._held: dict[Hashable, list[int]] = {}
        self.peak = 0  # the most blocks held at once

    @property
    def capacity(self) -> int:
        """Blocks a request can hold (all but the scratch block)."""
        return self.scratch

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.capacity - self.free

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold ``positions`` positions."""
        return -(-positions // self.block_size)

    def held(self, rid: Hashable) -> list[int]:
        return self._held.get(rid, [])

    def shortfall(self, need: dict[Hashable, int]) -> int:
        """Blocks missing for every request ``rid`` to hold ``need[rid]`` positions (0: they fit)."""
        more = sum(max(self.blocks_for(n) - len(self.held(r)), 0) for r, n in need.items())
        return max(more - self.free, 0)

    def grow(self, rid: Hashable, positions: int) -> list[int]:
        """Give ``rid`` the blocks it lacks to hold ``positions`` positions; returns the new ones.
        PoolExhausted (nothing taken) if the pool has too few."""
        have = self._held.setdefault(rid, [])
        more = self.blocks_for(positions) - len(have)
        if more <= 0:
            return []
        if more > len(self._free):
            raise PoolExhausted(f"request {rid!r} needs {more} more blocks of {self.block_size} positions for "
                                f"{positions} positions; {len(self._free)} of {self.capacity} are free")
        new = [self._free.pop() for _ in range(more)]
        have.extend(new)
        self.peak = max(self.peak, self.used)
        return new

    def release(self, rid: Hashable) -> int:
        """Every block ``rid`` holds goes back to the pool; returns how many."""
        blocks = self._held.pop(rid, [])
        self._free.extend(reversed(blocks))
        return len(blocks)

    def table(self, rids: Iterable[Hashable], width: int) -> list[list[int]]:
        """Each request's blocks in position order, padded with the scratch block to ``width``."""
        out = []
        for r in rids:
            blocks = self.held(r)
            if len(blocks) > width:
                raise ValueError(f"request {r!r} holds {len(blocks)} blocks, the table has {width} columns")
            out.append(blocks + [self.scratch] * (width - len(blocks)))
        return out
