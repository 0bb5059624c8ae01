"""Speculation strategies (arms): which proposer drafts, how deep and how wide, and how many tokens
to verify.

Owns the :class:`Arm` value type shared by the proposers, the BEG-MAB tuner and the CUDA-graph
planner. ``Arm.off()`` (all zeros) means plain autoregressive decoding: the tuner may pick it
when speculation does not pay. ``proposer`` names one of the engine's proposers ("" = its main
one, e.g. the EAGLE drafter; "suffix" = the model-free drafter): proposers are arms, not fallbacks.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, order=True)
class Arm:
    depth: int  # draft levels
    topk: int  # children expanded per node (1 = chain)
    tokens_to_verify: int  # draft nodes sent to the target (the root token is not counted)
    proposer: str = ""  # which of the engine's proposers drafts ("": the main one)

    def __post_init__(self) -> None:
        if (self.depth, self.topk, self.tokens_to_verify) == (0, 0, 0):
            if self.proposer:
                raise ValueError(f"{self!r}: the off arm drafts nothing; give it no proposer")
            return
        if self.depth < 1 or self.topk < 1 or self.tokens_to_verify < 1:
            raise ValueError(f"{self}: depth, topk and tokens_to_verify must all be >= 1 "
                             "(or all 0 for 'no speculation')")
        if self.tokens_to_verify > self.max_nodes:
            raise ValueError(f"{self}: a depth-{self.depth}, top-{self.topk} tree has at most "
                             f"{self.max_nodes} candidate nodes; lower tokens_to_verify")

    @classmethod
    def off(cls) -> "Arm":
        return cls(0, 0, 0)

    @property
    def is_off(self) -> bool:
        return self.depth == 0

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def max_nodes(self) -> int:
        """Candidates an EAGLE-2 tree can offer: topk at depth 1, topk^2 at each later depth."""
        return self.topk + (self.depth - 1) * self.topk * self.topk

    def __str__(self) -> str:
        if self.is_off:
            return "off"
        return f"d{self.depth}k{self.topk}v{self.tokens_to_verify}" + (f"@{self.proposer}" if self.proposer else "")
