"""BEG-MAB: the bucketed epsilon-greedy bandit that picks the speculation strategy (arm) per step.

Owns the strategy *policy* of the rollout engine: given the running batch size it returns an
:class:`~rollout.strategy.Arm` (possibly ``Arm.off()`` = plain autoregressive decoding), and after
each verify step it is fed the step's host-side numbers (accepted draft tokens, step wall time) to
learn which arm commits tokens fastest. It owns no tensors, no device and no clock: the engine
measures, the tuner decides. Pure Python (no torch / numpy) so the SGLang plugin can import it as is.

Policy, per batch-size bucket (each bucket has its own arms, so each has its own CUDA graphs):

1. arms never rewarded yet are tried first, round-robin;
2. else, with probability ``epsilon``, an arm chosen uniformly from the bucket (exploration);
3. else the arm with the highest **median** reward over its last ``window`` rewards (exploitation).

The median ignores outlier steps (a GC pause, a prefill mixed into the batch); the sliding window
forgets old regimes, so the tuner re-adapts when acceptance shifts (the drafter goes stale after a
target update, or is refreshed).

Reward. The engine's goodput of a step is ``(accepted + batch_size) / step_time`` [tokens/s]:
``accepted`` is the sum over the batch of accepted draft tokens and every request also commits one
bonus token, i.e. per request ``(accepted_i + 1) / step_time``, summed over the batch (equivalently
``(mean_accepted + 1) * batch_size / step_time``). The tuner ranks arms by goodput **per running
request**, ``goodput / batch_size``: at a fixed batch size the ranking is the same, but one bucket
spans several batch sizes (e.g. 9..32) that shrink over a long-tail rollout, and raw goodput grows
almost linearly with the batch size in the memory-bound regime, so rewards recorded at different
batch sizes would otherwise be compared unfairly (an arm last sampled at a larger batch would look
better than it is). ``tlt bench tuner`` measures the difference.

Not thread-safe: one tuner per scheduler thread.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging
import random
import statistics
from typing import Any, Iterable

from rollout.strategy import Arm

log = logging.getLogger(__name__)

Bucket = tuple[int, tuple[Arm, ...]]  # (max running batch size, arms offered in that bucket)


def _default_buckets() -> tuple[Bucket, ...]:
    # Small batches are memory-bound: verifying many tokens is nearly free, so deep/wide trees pay.
    # Larger batches approach the compute knee: fewer tokens to verify. Every bucket offers
    # several arms plus ``off`` so the tuner can explore and can turn speculation off.
    off = Arm.off()
    return (
        (2, (Arm(8, 4, 32), Arm(6, 4, 16), Arm(6, 2, 16), off)),
        (8, (Arm(6, 4, 16), Arm(5, 2, 8), Arm(4, 1, 4), off)),
        (32, (Arm(5, 2, 8), Arm(4, 1, 4), Arm(3, 1, 3), off)),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TunerConfig:
    # ((max_batch_size, (arm, ...)), ...), sorted by max_batch_size; a batch larger than the last
    # bucket's max uses the last bucket (the elastic threshold normally keeps SD off there).
    buckets: tuple[Bucket, ...] = dataclasses.field(default_factory=_default_buckets)
    epsilon: float = 0.1  # exploration probability per choice
    window: int = 16  # rewards kept per (bucket, arm); older ones are forgotten
    seed: int = 0  # seeds the tuner's own random.Random

    def __post_init__(self) -> None:
        buckets = tuple((b[0], tuple(b[1])) if isinstance(b, (tuple, list)) and len(b) == 2 else b
                        for b in self.buckets)
        object.__setattr__(self, "buckets", buckets)  # normalise lists -> tuples (still frozen)
        if not buckets:
            raise ValueError("TunerConfig.buckets is empty; give at least one (max_batch_size, arms)")
        prev = 0
        for b in buckets:
            if not (isinstance(b, tuple) and len(b) == 2):
                raise ValueError(f"TunerConfig.buckets entry {b!r} must be (max_batch_size, (Arm, ...))")
            max_bs, arms = b
            if isinstance(max_bs, bool) or not isinstance(max_bs, int) or max_bs < 1:
                raise ValueError(f"TunerConfig.buckets: max_batch_size {max_bs!r} must be an int >= 1")
            if max_bs <= prev:
                raise ValueError(f"TunerConfig.buckets must be sorted by strictly increasing "
                                 f"max_batch_size; {max_bs} follows {prev}")
            if not arms or not all(isinstance(a, Arm) for a in arms):
                raise ValueError(f"TunerConfig.buckets: bucket <= {max_bs} needs a non-empty tuple of Arm")
            if len(set(arms)) != len(arms):
                raise ValueError(f"TunerConfig.buckets: bucket <= {max_bs} lists an arm twice; "
                                 "remove the duplicate")
            prev = max_bs
        if isinstance(self.epsilon, bool) or not isinstance(self.epsilon, (int, float)) \
                or not 0.0 <= self.epsilon <= 1.0:
            raise ValueError(f"TunerConfig.epsilon={self.epsilon!r} must be in [0, 1] (default 0.1)")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"TunerConfig.window={self.window!r} must be an int >= 1 (default 16)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"TunerConfig.seed={self.seed!r} must be an int")

    @classmethod
    def default(cls, **overrides: Any) -> "TunerConfig":
        """The shipped configuration (buckets <= 2, <= 8, <= 32; 4 arms each incl. off)."""
        return cls(**overrides)

    @property
    def max_batch_sizes(self) -> tuple[int, ...]:
        return tuple(b[0] for b in self.buckets)


class BegMab:
    """Bucketed epsilon-greedy bandit over speculation arms; see the module docstring."""

    def __init__(self, config: TunerConfig | None = None) -> None:
        self.config = config if config is not None else TunerConfig.default()
        self._bounds = list(self.config.max_batch_sizes)
        self._rng = random.Random(self.config.seed)
        w = self.config.window
        # per bucket index, per arm: recent rewards [tokens/s per running request]
        self._rewards: list[dict[Arm, collections.deque[float]]] = [
            {a: collections.deque(maxlen=w) for a in arms} for _, arms in self.config.buckets]
        self._median: list[dict[Arm, float]] = [{} for _ in self.config.buckets]  # cache
        self._count: list[dict[Arm, int]] = [dict.fromkeys(arms, 0) for _, arms in self.config.buckets]
        self._chosen: list[dict[Arm, int]] = [dict.fromkeys(arms, 0) for _, arms in self.config.buckets]
        self._cursor = [0] * len(self.config.buckets)  # round-robin over untried arms

    def bucket_index(self, batch_size: int) -> int:
        """Index of the first bucket whose max >= batch_size (the last bucket beyond the end)."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        return min(bisect.bisect_left(self._bounds, batch_size), len(self._bounds) - 1)

    def arms(self, batch_size: int) -> tuple[Arm, ...]:
        return self.config.buckets[self.bucket_index(batch_size)][1]

    def choose(self, batch_size: int) -> Arm:
        """The arm for the next step of a running batch of ``batch_size`` requests."""
        b = self.bucket_index(batch_size)
        arm = self._pick(b)
        self._chosen[b][arm] += 1
        return arm

    def _pick(self, b: int) -> Arm:
        arms = self.config.buckets[b][1]
        k = len(arms)
        medians = self._median[b]
        if len(medians) < k:  # 1. untried arms first, round-robin (also across un-recorded choices)
            for i in range(k):
                j = (self._cursor[b] + i) % k
                if arms[j] not in medians:
                    self._cursor[b] = j + 1
                    return arms[j]
        if self._rng.random() < self.config.epsilon:  # 2. explore uniformly
            return arms[self._rng.randrange(k)]
        return max(arms, key=lambda a: medians.get(a, float("-inf")))  # 3. exploit (ties: first)

    def record(self, batch_size: int, arm: Arm, accepted_tokens: int, step_time_s: float) -> None:
        """Feed one verify step: ``accepted_tokens`` = accepted draft tokens summed over the batch
        (0 for ``Arm.off()``), ``step_time_s`` = wall seconds of draft + verify. Host numbers only."""
        if step_time_s <= 0 or accepted_tokens < 0:
            raise ValueError(f"record: step_time_s={step_time_s} must be > 0 and "
                             f"accepted_tokens={accepted_tokens} >= 0")
        b = self.bucket_index(batch_size)
        if arm not in self._rewards[b]:
            raise ValueError(f"record: arm {arm} is not offered in bucket <= {self._bounds[b]} "
                             f"(batch_size={batch_size}); offered: {[str(a) for a in self._rewards[b]]}")
        goodput = (accepted_tokens + batch_size) / step_time_s  # tokens committed per second
        window = self._rewards[b][arm]
        window.append(goodput / batch_size)  # per running request, see module docstring
        self._median[b][arm] = statistics.median(window)
        self._count[b][arm] += 1

    def best(self, batch_size: int) -> Arm | None:
        """The current exploitation choice (None while any arm of the bucket is untried)."""
        b = self.bucket_index(batch_size)
        arms = self.config.buckets[b][1]
        if len(self._median[b]) < len(arms):
            return None
        return max(arms, key=lambda a: self._median[b][a])

    def stats(self) -> dict[str, dict[str, dict[str, Any]]]:
        """JSON-able per-rollout record: per bucket, per arm: rewards recorded, times chosen, and
        the window median [tokens/s per running request] (None if never rewarded)."""
        return {f"bs<={mx}": {str(a): {"count": self._count[b][a], "chosen": self._chosen[b][a],
                                        "median_reward": self._median[b].get(a)} for a in arms}
                for b, (mx, arms) in enumerate(self.config.buckets)}

    def state_dict(self) -> dict[str, Any]:
        """Plain Python state (JSON-able) to carry the tuner across engine restarts."""
        version, internal, gauss = self._rng.getstate()
        return {
            "version": 1,
            "buckets": [[mx, [[a.depth, a.topk, a.tokens_to_verify] for a in arms]]
                        for mx, arms in self.config.buckets],
            "rewards": [[list(self._rewards[b][a]) for a in arms]
                        for b, (_, arms) in enumerate(self.config.buckets)],
            "count": [[self._count[b][a] for a in arms] for b, (_, arms) in enumerate(self.config.buckets)],
            "chosen": [[self._chosen[b][a] for a in arms] for b, (_, arms) in enumerate(self.config.buckets)],
            "cursor": list(self._cursor),
            "rng": [version, list(internal), gauss],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; the buckets must match this tuner's config."""
        if state.get("version") != 1:
            raise ValueError(f"tuner state version {state.get('version')!r} is not supported (want 1)")
        mine = self.state_dict()["buckets"]
        if _as_lists(state.get("buckets")) != mine:
            raise ValueError("tuner state was saved with different buckets; build the tuner with the "
                             "same TunerConfig.buckets or start from a fresh state")
        for b, (_, arms) in enumerate(self.config.buckets):
            for i, a in enumerate(arms):
                self._rewards[b][a] = collections.deque(state["rewards"][b][i], maxlen=self.config.window)
                self._count[b][a] = int(state["count"][b][i])
                self._chosen[b][a] = int(state["chosen"][b][i])
            self._median[b] = {a: statistics.median(d) for a, d in self._rewards[b].items() if d}
        self._cursor = [int(c) for c in state["cursor"]]
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))


def _as_lists(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return [_as_lists(v) for v in x]
    return x


def describe(buckets: Iterable[Bucket]) -> str:
    """One line per config, e.g. ``bs<=2: d8k4v32 d6k4v16 off | bs<=8: ...`` (for logs)."""
    return " | ".join(f"bs<={mx}: " + " ".join(str(a) for a in arms) for mx, arms in buckets)
