"""The flat draft-tree record: the only contract between proposers and the verifier.

Owns :class:`DraftTree` (per request: draft tokens, each node's parent, a validity mask; nodes in
topological order, node ``-1`` being the last verified token) and the :class:`Proposer` protocol
implemented by the EAGLE drafter and the model-free n-gram drafter. Proposers only propose; the
verifier only verifies.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import torch

from rollout.strategy import Arm


@dataclasses.dataclass
class DraftTree:
    tokens: torch.Tensor  # [B, N] long: draft token ids (target vocabulary)
    parents: torch.Tensor  # [B, N] long: parent node index, -1 = child of the last verified token
    valid: torch.Tensor  # [B, N] bool: False on padding nodes (requests with smaller trees)

    def __post_init__(self) -> None:
        if not (self.tokens.shape == self.parents.shape == self.valid.shape) or self.tokens.dim() != 2:
            raise ValueError(f"DraftTree fields must share a [B, N] shape, got {tuple(self.tokens.shape)}, "
                             f"{tuple(self.parents.shape)}, {tuple(self.valid.shape)}")

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[1])

    @classmethod
    def empty(cls, batch: int, device: torch.device | str = "cpu") -> "DraftTree":
        z = torch.zeros(batch, 0, dtype=torch.long, device=device)
        return cls(z, z.clone(), z.bool())

    @classmethod
    def chains(cls, drafts: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> "DraftTree":
        """One chain per request (may differ in length; shorter ones are padded)."""
        n = max((len(d) for d in drafts), default=0)
        tokens = torch.zeros(len(drafts), n, dtype=torch.long)
        valid = torch.zeros(len(drafts), n, dtype=torch.bool)
        for i, d in enumerate(drafts):
            tokens[i, : len(d)] = torch.tensor(list(d), dtype=torch.long)
            valid[i, : len(d)] = True
        parents = (torch.arange(n) - 1).expand(len(drafts), n).clone()
        return cls(tokens.to(device), parents.to(device), valid.to(device))

    def depths(self) -> torch.Tensor:
        """[B, N] depth of each node, 0 for children of the last verified token."""
        depth = torch.zeros_like(self.parents)
        for j in range(self.num_nodes):
            p = self.parents[:, j]
            depth[:, j] = torch.where(p >= 0, depth.gather(1, p.clamp(min=0)[:, None]).squeeze(1) + 1, 0)
        return depth


class Proposer(Protocol):
    """Drafts candidate continuations for running requests.

    The engine calls ``start`` when requests enter, ``accept`` after every verify or decode step
    with the tokens each request committed, ``finish`` when a request ends (its output may still
    inform its GRPO siblings), and ``propose`` before a speculative step. ``features[i][k]`` is
    the target hidden state (EAGLE feature, [F]) at the position that predicted ``tokens[i][k]``;
    model-free proposers set ``feature_layers = None`` and get ``features=None``. Otherwise
    ``feature_layers`` lists the target layers whose inputs are concatenated (EAGLE-3), or is
    empty for the post-norm last hidden state (EAGLE). ``start`` gets the features of prompt
    positions ``0..P-2`` (those predicting prompt tokens ``1..P-1``). Requests keep the order in
    which they were started; ``finish`` removes them without reordering the rest.
    """

    feature_layers: tuple[int, ...] | None

    def start(self, rids: Sequence[int], groups: Sequence[int], prompts: Sequence[Sequence[int]],
              features: Sequence[torch.Tensor] | None = None) -> None: ...

    def accept(self, rids: Sequence[int], tokens: Sequence[Sequence[int]],
               features: Sequence[torch.Tensor] | None = None) -> None: ...

    def finish(self, rids: Sequence[int]) -> None: ...

    def propose(self, rids: Sequence[int], arm: Arm) -> DraftTree: ...
