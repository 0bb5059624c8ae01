"""A request as it enters and leaves an engine: what it carries in, and what it carries out.

Owns :class:`RequestState`, everything a request needs to run, or to go on where it stopped, in any
engine: its prompt, sampling settings, seed and GRPO group, the tokens it has so far with their
log-probs, and how many of those a feature sink has already received. Also owns :class:`Finished`,
a request leaving an engine: at a stop token, at its budget, aborted, or moved elsewhere.

Coupled sampling (:mod:`tlt.rollout.sampling`) makes going on lossless: a token depends only on the
target's logits and the request's (seed, absolute position) noise. A request that joins an engine
with ``k`` tokens so far is prefilled over its prompt and those tokens. It then draws exactly the
tokens it would have drawn without the move: in fp32, and in bf16 up to near-ties.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Hashable

from tlt.rollout.generate import SamplingParams

REASONS = ("stop", "length", "aborted", "left", "evicted")  # evicted: back in the same engine's queue, never returned


@dataclasses.dataclass(frozen=True)
class RequestState:
    prompt: tuple[int, ...]
    params: SamplingParams  # max_new_tokens: the whole response's budget, tokens so far included
    seed: int  # the coupled-sampling seed: kept for the request's whole life, whatever engine runs it
    group: Hashable = None  # GRPO group key (requests sampled from one prompt); None: a group of its own
    output: tuple[int, ...] = ()  # response tokens so far
    logprobs: tuple[float, ...] = ()  # one per output token
    # response tokens a sink already received as labels: a later hand-over trains only on the rest
    # (the earlier ones are its context), so a moved request is never trained on twice
    handed_over: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        object.__setattr__(self, "output", tuple(int(t) for t in self.output))
        object.__setattr__(self, "logprobs", tuple(float(x) for x in self.logprobs))
        if not self.prompt:
            raise ValueError("RequestState.prompt is empty")
        if not isinstance(self.seed, numbers.Integral) or isinstance(self.seed, bool):
            raise ValueError(f"RequestState.seed={self.seed!r}: an int (the coupled-sampling seed)")
        if len(self.logprobs) != len(self.output):
            raise ValueError(f"RequestState: {len(self.output)} output tokens but {len(self.logprobs)} log-probs")
        if not 0 <= self.handed_over <= len(self.output):
            raise ValueError(f"RequestState.handed_over={self.handed_over} must be in 0..{len(self.output)} "
                             "(the output tokens so far)")
        if len(self.output) > self.params.max_new_tokens:
            raise ValueError(f"RequestState: {len(self.output)} output tokens exceed max_new_tokens="
                             f"{self.params.max_new_tokens}")

    @property
    def done(self) -> bool:
        """It ended: at a stop token or at its budget (nothing is left to generate)."""
        return len(self.output) >= self.params.max_new_tokens or (
            bool(self.output) and self.output[-1] in self.params.stop_ids)


@dataclasses.dataclass(frozen=True)
class Finished:
    """A request that left an engine, with its state at that point."""

    rid: int  # the engine's id for it (returned by ``RolloutEngine.add``)
    state: RequestState
    reason: str  # "stop", "length" (its budget), "aborted", or "left" (to go on elsewhere)

    def __post_init__(self) -> None:
        if self.reason not in REASONS:
            raise ValueError(f"Finished.reason={self.reason!r}: one of {REASONS}")
