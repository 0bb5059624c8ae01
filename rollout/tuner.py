"""BEG-MAB: the bucketed epsilon-greedy bandit that picks the speculation strategy (arm) per step.

Owns the strategy *choice* of the rollout engine: given the running batch size it returns an
:class:`~tlt.rollout.strategy.Arm` (possibly ``Arm.off()`` = plain autoregressive decoding), and after
each verify step it is fed the step's host-side numbers (accepted draft tokens, step wall time) to
learn which arm commits tokens fastest. It owns no tensors, no device and no clock: the engine
measures, the tuner decides. Pure Python (no torch / numpy) so the SGLang plugin can import it as is.

Rules, per batch-size bucket (each bucket has its own arms, so each has its own CUDA graphs):

1. arms never rewarded yet are tried first, round-robin;
2. else, with probability ``epsilon``, an arm re-measured (exploration), chosen with weight
   ``min(1, explore_gap / cost)`` where ``cost`` is the extra time per token it is estimated to
   take over the best arm: near-equal arms are compared often, far worse ones rarely, so exploring
   costs at most ``epsilon * (k-1) * explore_gap`` of the time (1.5%) even when the drafter is
   useless and a speculative step costs several plain ones;
3. else the arm with the highest reward estimate over its last ``window`` steps (exploitation).

Every default bucket offers ``Arm.off()``: speculation stops where it stops paying, per bucket
(the learned elastic threshold); an engine may still cap it with a fixed ``elastic_threshold``.

Reward. The goodput of a step is ``(accepted + batch_size) / step_time`` [tokens/s]: ``accepted``
is the sum over the batch of accepted draft tokens and every request also commits one bonus token,
i.e. per request ``(accepted_i + 1) / step_time`` summed over the batch (equivalently
``(mean_accepted + 1) * batch_size / step_time``). Arms are ranked by goodput **per running
request** (``goodput / batch_size``): at one batch size the ranking is the same, but a bucket spans
several batch sizes (e.g. 9..32) that shrink over a long-tail rollout, and raw goodput grows almost
linearly with the batch size in the memory-bound regime, so an arm last sampled at a larger batch
would look better than it is.

Estimator over the window (per bucket and arm), robust where the outliers are:

* default: ``mean(committed tokens per request per step) / median(step time)``. Outliers live in
  the step time (a GC pause, a prefill chunk mixed into the batch): the median ignores them.
  Accepted tokens are bounded (by the draft depth), so they cannot be outliers, and their *mean* is
  what throughput is made of; the median of a capped, skewed accepted length ranks arms by their
  typical step instead (at batch size 1 it barely separates a depth-8 from a depth-6 tree).
* ``median_of_goodput=True``: the paper's median of per-step goodput (kept for comparison).

The sliding window (last ``window`` steps per bucket and arm) forgets old regimes, so the tuner
re-adapts when acceptance shifts (the drafter goes stale after a target update, or is refreshed).
Known weak spot of epsilon-greedy, kept simple on purpose: an arm loses exploitation when its
estimate is unluckily low, and that estimate then moves only with exploration (eps/k of the steps),
so under heavy noise a near-best arm can be exploited for a few hundred steps instead of the best
(forgetting samples by age was tried: no gain on the modelled rollouts of ``examples/research/tuner_surface.py``).
Not thread-safe: one tuner per scheduler thread.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging
import math
import random
import statistics
from collections.abc import Iterable
from typing import Any

from tlt.rollout.strategy import Arm

log = logging.getLogger(__name__)

Bucket = tuple[int, tuple[Arm, ...]]  # (max running batch size, arms offered in that bucket)


def _default_buckets() -> tuple[Bucket, ...]:
    # The paper's idea: small batches are memory-bound, so verifying many tokens is nearly free and
    # deep/wide trees pay; larger batches near the compute knee verify fewer. tokens_to_verify per
    # bucket: {32, 16, 8} up to 12 running requests, {16, 8, 4} up to 24 and up to 40 (two buckets:
    # their best arms differ), {8, 4, 2} above. A bucket holds few verify widths and topk values so
    # that its CUDA graphs stay few (``tlt bench graphs``). Every bucket has 4 arms, ``off``
    # included, at every batch size: where speculation stops paying is learned per bucket, not
    # fixed (``examples/research/tuner_surface.py``: these sets reach the oracle over all of their arms at every batch
    # size within 0.2%; learning costs ~2%).
    off = Arm.off()
    v32, v16, v8, v4, v2 = Arm(8, 4, 32), Arm(6, 4, 16), Arm(5, 2, 8), Arm(4, 1, 4), Arm(2, 1, 2)
    return ((12, (v32, v16, v8, off)), (24, (v16, v8, v4, off)), (40, (v16, v8, v4, off)),
            (64, (v8, v4, v2, off)))


def compute_bound_buckets() -> tuple[Bucket, ...]:
    # On a CPU every verified token costs about as much as a decoded one (no memory-bound regime),
    # so only chains can pay; on the demo's tiny target, where per-step overhead dominates, a
    # d5k1v5 chain measured 1.03-1.49x AR at batch 1 and 0.83-1.33x at batch 4-32 across runs of
    # ``tlt bench rollout`` (noisy). Chains and ``off`` in every bucket, no cap: the tuner finds
    # where they stop paying.
    off = Arm.off()
    d3, d5, d7 = Arm(3, 1, 3), Arm(5, 1, 5), Arm(7, 1, 7)
    return ((1, (d5, d7, d3, off)), (4, (d7, d5, d3, off)), (16, (d5, d3, off)), (64, (d5, d3, off)))


# The model-free drafter's chains: drafting costs microseconds, so only verifying costs; a long
# chain pays where a history match runs long, a short one where it does not.
SUFFIX_ARMS = (Arm(4, 1, 4, "suffix"), Arm(8, 1, 8, "suffix"))


def with_proposers(buckets: Iterable[Bucket], proposers: tuple[str, ...]) -> tuple[Bucket, ...]:
    """``buckets`` (arms of the main proposer "") for an engine with these proposers: the main
    one's arms only if "" is among them, the suffix chains if "suffix" is; ``off`` always."""
    if not proposers:
        raise ValueError("with_proposers: give at least one proposer name")
    unknown = set(proposers) - {"", "suffix"}
    if unknown:
        raise ValueError(f"with_proposers: unknown proposers {sorted(unknown)}; use '' (main) and 'suffix'")
    out = []
    for mx, arms in buckets:
        main = [a for a in arms if not a.is_off] if "" in proposers else []
        extra = list(SUFFIX_ARMS) if "suffix" in proposers else []
        out.append((mx, tuple(main + extra + [Arm.off()])))
    return tuple(out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TunerConfig:
    # ((max_batch_size, (arm, ...)), ...), sorted by max_batch_size; a batch larger than the last
    # bucket's max uses the last bucket. Give every bucket Arm.off() so the tuner can stop
    # speculating where it does not pay (an engine's elastic_threshold may also cap it).
    buckets: tuple[Bucket, ...] = dataclasses.field(default_factory=_default_buckets)
    # Exploration probability per choice, once every arm of the bucket was tried. 0.05 with 4 arms
    # costs ~1% of goodput where the off arm is 3x slower; 0 locks in on an early lucky arm.
    epsilon: float = 0.05
    # Steps remembered per (bucket, arm). At batch size 1 one step's committed tokens vary with a
    # CV of ~0.45, so 64 steps estimate an arm to ~6% -- enough to separate neighbouring arms
    # (~10% apart) -- while ~1 s of exploited steps still suffice to follow a regime change.
    window: int = 64
    # Exploration picks an arm with weight min(1, explore_gap / its extra time per token over the
    # best arm): an arm 2x slower is re-measured 10x less often than one within 10% (inf = uniform).
    explore_gap: float = 0.1
    median_of_goodput: bool = False  # True: the paper's estimator (see the module docstring)
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
            raise ValueError(f"TunerConfig.epsilon={self.epsilon!r} must be in [0, 1] (default 0.05)")
        if isinstance(self.explore_gap, bool) or not isinstance(self.explore_gap, (int, float)) \
                or not self.explore_gap > 0.0:
            raise ValueError(f"TunerConfig.explore_gap={self.explore_gap!r} must be > 0 (default 0.1; "
                             "float('inf') explores uniformly)")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"TunerConfig.window={self.window!r} must be an int >= 1 (default 64)")
        if not isinstance(self.median_of_goodput, bool):
            raise ValueError(f"TunerConfig.median_of_goodput={self.median_of_goodput!r} must be a bool")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"TunerConfig.seed={self.seed!r} must be an int")

    @classmethod
    def for_device(cls, device_type: str, *, proposers: tuple[str, ...] = ("",), **overrides: Any) -> TunerConfig:
        """The default for GPUs (memory-bound small batches); small chains on ``"cpu"``. ``proposers``:
        the engine's proposers by name ("" = the main, learned drafter; "suffix" = the model-free
        one, whose chains are added to every bucket)."""
        if "buckets" not in overrides:
            base = compute_bound_buckets() if device_type == "cpu" else _default_buckets()
            overrides["buckets"] = with_proposers(base, proposers)
        return cls(**overrides)

    @classmethod
    def default(cls, **overrides: Any) -> TunerConfig:
        """The shipped configuration (buckets <= 12, 24, 40, 64+; 4 arms each, ``off`` included)."""
        return cls(**overrides)


class BegMab:
    """Bucketed epsilon-greedy bandit over speculation arms; see the module docstring."""

    def __init__(self, config: TunerConfig | None = None) -> None:
        self.config = config if config is not None else TunerConfig.default()
        self._bounds = [mx for mx, _ in self.config.buckets]
        self._rng = random.Random(self.config.seed)
        self._reset_stats()

    def _reset_stats(self) -> None:
        w, buckets = self.config.window, self.config.buckets
        # per bucket index, per arm: last `window` steps as (committed tokens per request, seconds)
        self._steps: list[dict[Arm, collections.deque[tuple[float, float]]]] = [
            {a: collections.deque(maxlen=w) for a in arms} for _, arms in buckets]
        self._estimate: list[dict[Arm, float]] = [{} for _ in buckets]  # tokens/s per request
        self._count: list[dict[Arm, int]] = [dict.fromkeys(arms, 0) for _, arms in buckets]
        self._chosen: list[dict[Arm, int]] = [dict.fromkeys(arms, 0) for _, arms in buckets]
        self._cursor = [0] * len(buckets)  # round-robin position over untried arms
        self._exploited: list[Arm | None] = [None] * len(buckets)  # for the log only

    def bucket_index(self, batch_size: int) -> int:
        """Index of the first bucket whose max >= batch_size (the last bucket beyond the end)."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        return min(bisect.bisect_left(self._bounds, batch_size), len(self._bounds) - 1)

    def arms(self, batch_size: int) -> tuple[Arm, ...]:
        return self.config.buckets[self.bucket_index(batch_size)][1]

    def all_arms(self) -> tuple[Arm, ...]:
        """Every arm of every bucket, once each, in bucket order."""
        return tuple(dict.fromkeys(a for _, bucket in self.config.buckets for a in bucket))

    def choose(self, batch_size: int) -> Arm:
        """The arm for the next step of a running batch of ``batch_size`` requests."""
        b = self.bucket_index(batch_size)
        arms, est = self.config.buckets[b][1], self._estimate[b]
        k = len(arms)
        arm = None
        if len(est) < k:  # 1. untried arms first, round-robin (also across choices not yet recorded)
            for i in range(k):
                j = (self._cursor[b] + i) % k
                if arms[j] not in est:
                    self._cursor[b], arm = j + 1, arms[j]
                    break
        elif self._rng.random() < self.config.epsilon:  # 2. explore, cheaply
            arm = self._explore(arms, est)
        else:  # 3. exploit (ties: the first listed)
            arm = max(arms, key=est.__getitem__)
            if arm != self._exploited[b]:
                log.debug("bucket <= %d: exploiting %s (was %s)", self._bounds[b], arm, self._exploited[b])
                self._exploited[b] = arm
        self._chosen[b][arm] += 1
        return arm

    def _explore(self, arms: tuple[Arm, ...], est: dict[Arm, float]) -> Arm:
        """An arm to re-measure: each with weight ``min(1, explore_gap / cost)``, ``cost`` being the
        extra time per committed token it is estimated to take over the best arm (``best/est - 1``).
        Each non-best arm adds at most ``explore_gap`` of a step's time to an exploration step, so
        exploring costs at most ``epsilon * (k-1) * explore_gap`` of the rollout time however bad
        the arms are (1.5% at the defaults with 4 arms); ``explore_gap=inf`` is uniform."""
        g = self.config.explore_gap
        if g == math.inf:
            return arms[self._rng.randrange(len(arms))]
        top = max(est.values())
        weights = [min(1.0, g / max(1e-9, top / est[a] - 1.0)) if est[a] > 0 else g / 1e9 for a in arms]
        return self._rng.choices(arms, weights)[0]

    def record(self, batch_size: int, arm: Arm, accepted_tokens: int, step_time_s: float) -> None:
        """Feed one verify step: ``accepted_tokens`` = accepted draft tokens summed over the batch
        (0 for ``Arm.off()``), ``step_time_s`` = wall seconds of draft + verify. Host numbers only."""
        if not step_time_s > 0 or accepted_tokens < 0:
            raise ValueError(f"record: step_time_s={step_time_s} must be > 0 and "
                             f"accepted_tokens={accepted_tokens} >= 0")
        b = self.bucket_index(batch_size)
        window = self._steps[b].get(arm)
        if window is None:
            raise ValueError(f"record: arm {arm} is not offered in bucket <= {self._bounds[b]} "
                             f"(batch_size={batch_size}); offered: {[str(a) for a in self._steps[b]]}")
        if accepted_tokens > batch_size * arm.depth:  # an accepted path is at most `depth` long
            raise ValueError(f"record: accepted_tokens={accepted_tokens} exceeds batch_size x depth = "
                             f"{batch_size} x {arm.depth} for arm {arm}; pass accepted *draft* tokens "
                             "summed over the batch (bonus tokens excluded)")
        window.append(((accepted_tokens + batch_size) / batch_size, float(step_time_s)))
        self._estimate[b][arm] = self._estimate_of(window)
        self._count[b][arm] += 1

    def _estimate_of(self, window: Iterable[tuple[float, float]]) -> float:
        """Tokens committed per second per running request, from (tokens/request, seconds) steps."""
        if self.config.median_of_goodput:
            return statistics.median([tok / t for tok, t in window])
        toks, times = zip(*window)
        return sum(toks) / len(toks) / statistics.median(times)

    def forget(self, proposer: str) -> int:
        """Drop what was learned about ``proposer``'s arms (its drafter was swapped: a new drafter's
        acceptance is not the old one's); they are tried again first. Returns the arms reset."""
        n = 0
        for b, (_, arms) in enumerate(self.config.buckets):
            for a in arms:
                if not a.is_off and a.proposer == proposer:
                    self._steps[b][a].clear()
                    self._estimate[b].pop(a, None)
                    n += 1
        return n

    def best(self, batch_size: int) -> Arm | None:
        """The current exploitation choice (None while an arm of the bucket is untried)."""
        b = self.bucket_index(batch_size)
        arms = self.config.buckets[b][1]
        if len(self._estimate[b]) < len(arms):
            return None
        return max(arms, key=self._estimate[b].__getitem__)

    def stats(self) -> dict[str, dict[str, dict[str, Any]]]:
        """JSON-able per-rollout record: per bucket, per arm: steps recorded, times chosen, and the
        current reward estimate [tokens/s per running request] (None if never recorded)."""
        return {f"bs<={mx}": {str(a): {"count": self._count[b][a], "chosen": self._chosen[b][a],
                                        "reward": self._estimate[b].get(a)} for a in arms}
                for b, (mx, arms) in enumerate(self.config.buckets)}

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python, JSON-able state, to carry the tuner across engine restarts."""
        version, internal, gauss = self._rng.getstate()
        per = [(b, arms) for b, (_, arms) in enumerate(self.config.buckets)]
        return {
            "version": 1,
            "buckets": [[mx, [[a.depth, a.topk, a.tokens_to_verify] + ([a.proposer] if a.proposer else [])
                              for a in arms]] for mx, arms in self.config.buckets],
            "steps": [[[list(s) for s in self._steps[b][a]] for a in arms] for b, arms in per],
            "count": [[self._count[b][a] for a in arms] for b, arms in per],
            "chosen": [[self._chosen[b][a] for a in arms] for b, arms in per],
            "cursor": list(self._cursor),
            "rng": [version, list(internal), gauss],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; the buckets must match this tuner's config."""
        if state.get("version") != 1:
            raise ValueError(f"tuner state version {state.get('version')!r} is not supported (want 1)")
        if _as_lists(state.get("buckets")) != self.state_dict()["buckets"]:
            raise ValueError("tuner state was saved with different buckets; build the tuner with the "
                             "same TunerConfig.buckets or start from a fresh state")
        self._reset_stats()
        for b, (_, arms) in enumerate(self.config.buckets):
            for i, a in enumerate(arms):
                self._steps[b][a].extend((float(tok), float(t)) for tok, t in state["steps"][b][i])
                self._count[b][a] = int(state["count"][b][i])
                self._chosen[b][a] = int(state["chosen"][b][i])
                if self._steps[b][a]:
                    self._estimate[b][a] = self._estimate_of(self._steps[b][a])
        self._cursor = [int(c) for c in state["cursor"]]
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))


def _as_lists(x: Any) -> Any:
    return [_as_lists(v) for v in x] if isinstance(x, (list, tuple)) else x


def describe(buckets: Iterable[Bucket]) -> str:
    """One line for logs, e.g. ``bs<=2: d8k4v32 d6k4v16 off | bs<=8: ...``."""
    return " | ".join(f"bs<={mx}: " + " ".join(str(a) for a in arms) for mx, arms in buckets)
