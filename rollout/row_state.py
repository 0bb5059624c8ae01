"""The running requests' state on the device, one row per KV-cache row.

Owns :class:`RowState`: each running request's committed length, pending token, committed tokens
by position, stop ids, coupled-sampling settings and (paged cache) block table, as device tensors
in the engine's row order. A step reads them (roots, the last token, the proposers' catch-up tokens) and updates them
from the verifier's device result, so a step needs no host -> device copy of request state; the
host keeps its own token lists, filled from the step's one packed read, for stop and budget cuts
and for the outputs. Rows only change when requests leave (:meth:`select`, the one upload of a
leaving step) or join (:meth:`start` with the joining requests' prefill, then :meth:`cat`); a
paged cache's table also grows between steps (:meth:`set_blocks`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from tlt.rollout.sampling import RowSampling


@dataclasses.dataclass
class RowState:
    lens: torch.Tensor  # [B] long: committed tokens, the pending one included (its KV is not cached yet)
    last: torch.Tensor  # [B] long: the pending token (the root of the next step's tree)
    tokens: torch.Tensor  # [B, S] long: committed tokens by position (prompt included)
    stops: torch.Tensor  # [B, K] long: stop ids, -1 padding
    sampling: RowSampling  # per row
    blocks: torch.Tensor | None = None  # [B, C] int32: each row's cache blocks (paged); None: row r is cache row r

    @property
    def device(self) -> torch.device:
        return self.lens.device

    @classmethod
    def start(cls, ids: torch.Tensor, lens: torch.Tensor, first: torch.Tensor, stops: torch.Tensor,
              sampling: RowSampling, width: int, blocks: torch.Tensor | None = None) -> "RowState":
        """After a prefill. ids: [B, T] right-padded prompts; lens: [B] prompt lengths; first: [B]
        the pending token (sampled, or the last of a joining request's tokens so far); width: token slots per row (S >= the longest request)."""
        b, t = ids.shape
        tokens = torch.zeros(b, width, dtype=torch.long, device=ids.device)
        tokens[:, :t] = ids
        tokens.scatter_(1, lens[:, None], first[:, None])
        return cls(lens + 1, first.clone(), tokens, stops, sampling, blocks)

    def commit(self, committed: torch.Tensor, count: torch.Tensor) -> None:
        """Append each row's first ``count`` of ``committed`` [B, D + 1] (count: [B] >= 1), on the device."""
        d1 = committed.shape[1]
        if d1 == 1:  # a plain step: one token per row
            self.tokens.scatter_(1, self.lens[:, None], committed)
            self.last = committed[:, 0].clone()  # not a view of a graph's static output
            self.lens = self.lens + 1
            return
        pos = (self.lens[:, None] + torch.arange(d1, device=self.device)).clamp(max=self.tokens.shape[1] - 1)
        keep = torch.arange(d1, device=self.device) < count[:, None]  # [B, D + 1]
        self.tokens.scatter_(1, pos, torch.where(keep, committed, self.tokens.gather(1, pos)))
        self.last = committed.gather(1, (count - 1)[:, None])[:, 0]
        self.lens = self.lens + count

    def cat(self, other: "RowState") -> "RowState":
        """These rows, then ``other``'s (requests joining a running batch)."""
        k = max(self.stops.shape[1], other.stops.shape[1])
        pad = [F.pad(s, (0, k - s.shape[1]), value=-1) for s in (self.stops, other.stops)]
        blocks = None if self.blocks is None else torch.cat([self.blocks, other.blocks])
        return RowState(torch.cat([self.lens, other.lens]), torch.cat([self.last, other.last]),
                        torch.cat([self.tokens, other.tokens]), torch.cat(pad), self.sampling.cat(other.sampling), blocks)

    def select(self, keep: torch.Tensor) -> "RowState":
        """Rows ``keep`` [B'] (indices into these rows), in that order."""
        return RowState(self.lens[keep], self.last[keep], self.tokens[keep], self.stops[keep],
                        self.sampling.select(keep), None if self.blocks is None else self.blocks[keep])

    def set_blocks(self, rows: torch.Tensor, table: torch.Tensor) -> None:
        """Rows ``rows`` [N] (indices into these rows) get the table rows ``table`` [N, C]."""
        self.blocks[rows] = table
