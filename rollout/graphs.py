"""The CUDA graphs the engine captures: their keys and the batch sizes a step is padded to.

Owns the graph keys (frozen, so identical shapes merge into one graph) and :class:`CaptureSizes`:
* ``TargetGraphKey(batch, query_tokens)``: one target forward over ``[batch, query_tokens]``;
  an arm verifies ``tokens_to_verify + 1`` tokens (its draft nodes plus the root token), and
  ``Arm.off()`` is the plain decode graph ``query_tokens=1`` (the verify step's own key,
  :class:`tlt.rollout.static_step.VerifyGraphKey`, extends it).
* ``DraftLoopGraphKey(batch, arm, window, sampled)``: what the engine's EAGLE proposer captures,
  one whole proposal -- catch-up over ``window = depth + 1`` pairs, every draft level, top-k and
  tree selection -- per padded batch and arm, as SGLang's draft runner captures its multi-step
  draft. One launch per proposal; arms share a graph only when equal.
Arms of a model-free proposer have no drafter graph. A runtime batch is padded up to the next
captured size; above the largest it has no graph and runs eagerly. The engine captures a key on
its first uses (:class:`tlt.rollout.graph_pool.CaptureGate`); planning whole sets of graphs by the
tuner's buckets, and what they cost, is the benches' (:mod:`tlt.bench.graph_plan`).
"""

from __future__ import annotations

import dataclasses

DEFAULT_CAPTURE_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)


@dataclasses.dataclass(frozen=True, order=True, kw_only=True)
class TargetGraphKey:
    batch: int  # captured (padded) batch size
    query_tokens: int  # tokens per row: tokens_to_verify + 1, or 1 for plain decode

    @property
    def tokens(self) -> int:
        return self.batch * self.query_tokens

    def __str__(self) -> str:
        return f"target[b{self.batch} q{self.query_tokens}]"


@dataclasses.dataclass(frozen=True, order=True, kw_only=True)
class DraftLoopGraphKey:
    """A whole EAGLE proposal in one graph (as SGLang's draft runner captures it): catch-up over a
    fixed window of pairs, every draft level, top-k and tree selection, for one padded batch and
    arm. ``sampled``: whether the shared-noise scores are built (a host-side flag of the batch)."""

    batch: int  # captured (padded) batch size
    depth: int
    topk: int
    tokens_to_verify: int
    window: int  # catch-up pairs per row (the arm's depth + 1: what one speculative step commits)
    sampled: bool

    @property
    def tokens(self) -> int:
        return self.batch * (self.window + self.topk * max(self.depth - 1, 0))

    def __str__(self) -> str:
        return (f"draft-loop[b{self.batch} d{self.depth}k{self.topk}v{self.tokens_to_verify} w{self.window}"
                f"{' sampled' if self.sampled else ''}]")


GraphKey = TargetGraphKey | DraftLoopGraphKey


@dataclasses.dataclass(frozen=True)
class CaptureSizes:
    """The batch sizes graphs are captured at, ascending."""

    capture_batch_sizes: tuple[int, ...] = DEFAULT_CAPTURE_BATCH_SIZES

    def __post_init__(self) -> None:
        sizes = tuple(self.capture_batch_sizes)
        if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"capture_batch_sizes={sizes}: give one or more batch sizes >= 1")
        if list(sizes) != sorted(set(sizes)):
            raise ValueError(f"capture_batch_sizes={sizes}: sort them ascending without repeats")
        object.__setattr__(self, "capture_batch_sizes", sizes)

    def padded_batch(self, batch: int) -> int | None:
        """The captured size a runtime batch is padded up to; None above the largest (eager)."""
        if batch < 1:
            raise ValueError(f"batch={batch}: a batch has at least one request")
        return next((c for c in self.capture_batch_sizes if c >= batch), None)
