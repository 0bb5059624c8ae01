"""The flat draft-tree record: the only contract between proposers and the verifier.

Owns :class:`DraftTree` (per request: draft tokens, each node's parent, a validity mask; nodes in
topological order, node ``-1`` being the last verified token), :class:`ProposerInput` (the one
record a proposer receives) and the :class:`Proposer` base class of the EAGLE / EAGLE-3
drafters and the model-free suffix drafter. Proposers only propose; the verifier only verifies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Mapping
from typing import Sequence

import torch

from tlt.rollout.row_state import RowState
from tlt.rollout.sampling import RowSampling
from tlt.rollout.step_upload import StepUpload
from tlt.rollout.strategy import Arm


@dataclasses.dataclass
class DraftTree:
    tokens: torch.Tensor  # [B, N] long: draft token ids (target vocabulary)
    parents: torch.Tensor  # [B, N] long: parent node index, -1 = child of the last verified token
    valid: torch.Tensor  # [B, N] bool: False on padding nodes (requests with smaller trees)
    depth: torch.Tensor | None = None  # [B, N] long: each node's depth when the proposer knows it (else computed)

    def __post_init__(self) -> None:
        if not (self.tokens.shape == self.parents.shape == self.valid.shape) or self.tokens.dim() != 2 or (
                self.depth is not None and self.depth.shape != self.tokens.shape):
            raise ValueError(f"DraftTree fields must share a [B, N] shape, got {tuple(self.tokens.shape)}, "
                             f"{tuple(self.parents.shape)}, {tuple(self.valid.shape)}"
                             + (f", {tuple(self.depth.shape)}" if self.depth is not None else ""))

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[1])

    def padded_to(self, n: int) -> "DraftTree":
        """The same tree with invalid nodes appended up to ``n`` nodes (a static step shape)."""
        extra = n - self.num_nodes
        if extra <= 0:
            return self
        b, dev = self.tokens.shape[0], self.tokens.device
        return DraftTree(torch.cat([self.tokens, self.tokens.new_zeros(b, extra)], 1),
                         torch.cat([self.parents, torch.full((b, extra), -1, dtype=torch.long, device=dev)], 1),
                         torch.cat([self.valid, self.valid.new_zeros(b, extra)], 1),
                         None if self.depth is None else torch.cat([self.depth, self.depth.new_zeros(b, extra)], 1))

    @classmethod
    def empty(cls, batch: int, device: torch.device | str = "cpu") -> "DraftTree":
        z = torch.zeros(batch, 0, dtype=torch.long, device=device)
        return cls(z, z.clone(), z.bool())

    @classmethod
    def chains(cls, drafts: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> "DraftTree":
        """One chain per request (may differ in length; shorter ones are padded)."""
        tokens = right_pad(drafts, device=device)  # [B, N]
        n = tokens.shape[1]
        valid = torch.arange(n, device=device) < torch.tensor([len(d) for d in drafts], device=device)[:, None]
        parents = (torch.arange(n, device=device) - 1).expand(len(drafts), n).clone()
        return cls(tokens, parents, valid)

    @classmethod
    def from_nodes(cls, rows: Sequence[Sequence[tuple[int, int]]], device: torch.device | str = "cpu",
                   upload: StepUpload | None = None) -> "DraftTree":
        """Per request, its nodes as (token, parent) in topological order; one host -> device copy:
        ``upload``'s (with whatever it holds already, on its device), else one of its own."""
        width = max(map(len, rows), default=0)
        flat: list[int] = []  # all tokens, then all parents (padding hangs off the root), then valid flags
        for r in rows:
            flat += [t for t, _ in r] + [0] * (width - len(r))
        for r in rows:
            flat += [p for _, p in r] + [-1] * (width - len(r))
        for r in rows:
            flat += [1] * len(r) + [0] * (width - len(r))
        up = upload if upload is not None else StepUpload(device)
        got: list[torch.Tensor] = []
        up.add(flat, (3, len(rows), width), got.append)
        up.flush()
        return cls(got[0][0], got[0][1], got[0][2].bool())  # [B, N] each

    def depths(self) -> torch.Tensor:
        """[B, N] depth of each node, 0 for children of the last verified token."""
        return self.depth if self.depth is not None else tree_depths(self.parents)


def right_pad(rows: Sequence[Sequence[int]], *, fill: int = 0, width: int | None = None,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, T] long: row i is ``rows[i]`` followed by ``fill`` (T = the longest row, or ``width``).
    Built on the host and sent in one copy; the one right-padding routine of the rollout side."""
    t = max((len(r) for r in rows), default=0) if width is None else width
    return torch.tensor([[int(x) for x in r] + [fill] * (t - len(r)) for r in rows],
                        dtype=torch.long, device=device).reshape(len(rows), t)


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth (0 for children of the prefix) of each node; parents: [B, T] -> [B, T].

    Pointer jumping: each round adds the distance already known at a node's current jump target and
    doubles the jump, so ceil(log2(T)) + 1 rounds of batched device ops, no per-node loop."""
    if parents.shape[1] == 0:  # a plain step's empty tree
        return torch.zeros_like(parents)
    dist = torch.ones_like(parents)  # [B, T] edges from a node to its jump target
    jump = parents.clone()  # [B, T] jump target, -1 = the prefix
    for _ in range(max(parents.shape[1] - 1, 0).bit_length() + 1):
        has = jump >= 0
        at = jump.clamp(min=0)
        dist = dist + torch.where(has, dist.gather(1, at), 0)
        jump = torch.where(has, jump.gather(1, at), -1)
    return dist - 1


def request_ids(tokens: Mapping[int, Sequence[int]] | Sequence[Sequence[int]]) -> Iterable[int]:
    """The request ids of :attr:`ProposerInput.tokens` (a mapping's keys, a sequence's indices)."""
    return tokens.keys() if isinstance(tokens, Mapping) else range(len(tokens))


@dataclasses.dataclass(frozen=True)
class ProposerInput:
    """Everything a proposer receives, once per speculative step (flat, as in vLLM v1's proposers).

    The engine hands over references, never copies: nothing is fed to a proposer while speculation
    is off, so an attached proposer adds no per-step work to plain decoding; on its next proposal
    it catches up from these (tokens and features committed since its last call). Requests are
    indexed by request id ``r`` (unique within a generation; the engine's ids keep growing), cache
    rows by ``i``.
    """

    generation: int  # a new value means all-new requests (the engine went idle in between)
    rows: tuple[int, ...]  # request id in each running cache row, in the engine's row order
    # per request id (the generation's finished ones too): prompt + committed tokens; a mapping,
    # or a sequence indexed 0..n-1
    tokens: Mapping[int, Sequence[int]] | Sequence[Sequence[int]]
    prompt_lens: Mapping[int, int] | Sequence[int]  # per request id
    groups: Mapping[int, Hashable] | Sequence[Hashable]  # per request id: GRPO group key
    # [max_batch, S, F] target features by cache row i and position t, the feature that predicted
    # token t + 1; valid for t < len(tokens[rows[i]]) - 1. None for model-free proposers.
    features: torch.Tensor | None
    arm: Arm
    # per running row, in row order: seed keys and temperatures of coupled sampling
    # (rollout.sampling); a proposer may draft argmax(log q + G) with the target's own noise.
    # None: draft deterministically.
    sampling: RowSampling | None = None
    # the running rows' state on the device, in row order (lengths, committed tokens, sampling):
    # what a proposer indexes with, instead of uploading host lists. None: outside an engine.
    state: RowState | None = None
    # the step's pending upload (a paged cache's grown tables, not yet in ``state``): a proposer
    # with ``packs_upload`` sends what it uploads through it. None: outside an engine.
    upload: StepUpload | None = None

    @property
    def device(self) -> torch.device:
        """Where the proposer's tree goes: the engine's device (the CPU outside an engine)."""
        return self.state.device if self.state is not None else torch.device("cpu")


class Proposer:
    """Drafts candidate continuations for running requests. Subclass it: the members below are
    everything the engine reads of a proposer, with what a model-free, graph-free one needs as
    defaults; ``propose`` is the one to write.

    ``feature_layers`` says which target features the proposer reads: ``None`` for none (model-free,
    ``ProposerInput.features`` is None), ``()`` for the post-norm last hidden state (EAGLE), or the
    target layers whose inputs are concatenated (EAGLE-3).

    Rows follow the requests: between two proposals requests may leave (finished, aborted or moved
    away: swap-removed by :func:`tlt.rollout.kv_cache.swap_remove`) and join (appended after the
    running rows, possibly with tokens they made elsewhere). A proposer with per-row state maps its
    old rows to ``ProposerInput.rows`` by request id, and starts a request id it has not seen from
    the request's tokens (all of them are in ``tokens``; their features in ``features``).
    """

    feature_layers: tuple[int, ...] | None = None
    capture_s: float = 0.0  # seconds spent capturing graphs, summed (the engine keeps them out of tuner rewards)
    catch_up_s: float = 0.0  # of the last proposal's time: its catch-up on tokens committed since
    kv_position_bytes: int = 0  # device bytes it keeps per request position in a paged engine's blocks
    # True: propose() sends what it uploads through ``ProposerInput.upload`` and flushes it before it
    # reads a block table of ``ProposerInput.state``, so the step's grown tables travel in the same
    # copy; False: the engine flushes the tables before propose()
    packs_upload: bool = False

    def propose(self, inp: ProposerInput) -> DraftTree:
        raise NotImplementedError(f"{type(self).__name__} does not implement propose()")

    def forget(self, rids: Iterable[int]) -> None:
        """Requests the engine evicted: state kept for them in the engine's blocks went with them, and
        each starts over from its tokens when it next appears."""

    def close(self) -> None:
        """Give captured graphs and device memory back now (the proposer is replaced, or its engine
        releases its memory between rollouts); the next proposal allocates again."""
