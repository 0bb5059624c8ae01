"""BEG-MAB as SGLang's adaptive speculative policy (TLT's tuner there): step counts chosen per batch-size slot.

Owns the translation between SGLang's adaptive-speculation protocol and TLT's tuner
(:class:`tlt.rollout.tuner.BegMab`). SGLang's EAGLE worker only switches the draft *step count* at run
time (topk 1, ``num_draft_tokens = steps + 1``), so an arm here is a chain ``Arm(s, 1, s)``, and
``steps = 0`` (0.5.23 only) is ``Arm.off()``: plain decoding on the same KV cache, no re-prefill —
the elastic switch. Pure Python: SGLang is not imported here (the hooks module installs it).

Slots use SGLang's own adaptive-config format (``--speculative-adaptive-config FILE``):
``{"1": {"candidate_steps": [0, 1, 3, 5, 7]}, "4": {...}, ...}``; a key is the smallest batch
size of its slot, a batch routes to the largest key <= its size padded to a captured CUDA-graph
batch size (SGLang's routing, so the graph for the chosen step always exists). Without a file
TLT's :data:`DEFAULT_SLOTS` apply (every slot offers 0, so speculation is a learned decision at
every batch size).

Reward: committed tokens per second per running request between consecutive verify calls,
from host-side ``time.monotonic`` stamps (SGLang calls the tuner after the accept lengths are on
the host; no GPU sync is added). With SGLang's overlap scheduler the next batch is launched
before the previous result is processed, so choices wait in a FIFO until their verify result
arrives; a result that cannot be matched (batch size differs, or more accepted drafts than the
queued step count allows) is not learned from.

Two protocol shapes, one core (:class:`StepTuner`):

* 0.5.23 (:class:`AdaptiveTuner`): ``candidate_steps``, ``set_cuda_graph_bs``,
  ``get_steps_for_batch`` (called before every decode batch), ``on_verify_complete(accepts,
  batch_size)``, ``cuda_graph_bs_for_step`` (bucketed graph capture: a step count is captured
  only at the graph batch sizes whose slot offers it).
* 0.5.12 (:class:`EmaCompatTuner`): constructed by SGLang's ``AdaptiveController`` as
  ``(initial_steps, config)``; ``update(accepts) -> bool`` after each verify, ``current_steps``.
  No batch size is passed (it is ``len(accepts)``), no ``steps=0``, no pruned capture, and the
  switch applies from the batch after the verify.
"""

from __future__ import annotations

import bisect
import collections
import functools
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tlt.rollout.strategy import Arm
from tlt.rollout.tuner import BegMab, TunerConfig

# Every slot offers 0 (off): speculating is a learned decision at every batch size. Deep chains
# only while few requests run; at larger batches verified tokens cost compute, so only short chains
# are offered there (and only those graphs are captured: `tlt bench sglang-tuner`, ~4x less graph
# memory than every step count at every size).
DEFAULT_SLOTS: dict[str, dict[str, list[int]]] = {
    "1": {"candidate_steps": [0, 1, 2, 3, 5, 7]},
    "4": {"candidate_steps": [0, 1, 2, 3]},
    "12": {"candidate_steps": [0, 1, 2]},
    "32": {"candidate_steps": [0, 1]},
}
SlotsConfig = Mapping[str, Mapping[str, Any]]  # SGLang's adaptive-config JSON as a dict
MAX_GAP_S = 2.0  # a longer pause between verify calls is idle time, not a step


@functools.cache  # called per verify in SGLang's scheduler: build each arm once
def arm_of(steps: int) -> Arm:
    """SGLang's step count as a tuner arm: a chain of ``steps`` drafts, or off for 0."""
    return Arm.off() if steps == 0 else Arm(steps, 1, steps)


def describe(config: str | SlotsConfig | None) -> str:
    """One line, e.g. ``bs>=1: 0,1,3 | bs>=4: 0,1``."""
    return " | ".join(f"bs>={k}: " + ",".join(map(str, v)) for k, v in load_slots(config).items())


def load_slots(config: str | SlotsConfig | None, *, allow_zero: bool = True) -> dict[int, tuple[int, ...]]:
    """``{slot min batch size: candidate steps}`` from an adaptive-config path, dict or None."""
    if config is None:
        raw: Mapping[str, Any] = DEFAULT_SLOTS
    elif isinstance(config, str):
        with open(config) as f:
            raw = json.load(f)
    else:
        raw = config
    if not isinstance(raw, Mapping):
        raise ValueError(f"speculative adaptive config must be a JSON object, got {type(raw).__name__}")
    slots: dict[int, tuple[int, ...]] = {}
    for key, entry in raw.items():
        if not str(key).isdigit():
            continue  # SGLang allows global keys (ema_alpha, ...) beside the slots
        steps = entry.get("candidate_steps") if isinstance(entry, Mapping) else None
        if (not isinstance(steps, list) or not steps
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps)):
            raise ValueError(f"adaptive config slot {key!r}: candidate_steps must be a non-empty "
                             f"list of ints >= 0, got {steps!r}")
        if not allow_zero and 0 in steps:
            raise ValueError(f"adaptive config slot {key!r}: candidate_steps {steps} holds 0, which "
                             "this SGLang version cannot run (no plain-decode step); remove it")
        if int(key) < 1:
            raise ValueError(f"adaptive config slot {key!r}: a slot key is a batch size >= 1")
        slots[int(key)] = tuple(sorted(set(steps)))
    if not slots:
        raise ValueError('speculative adaptive config has no batch-size slot; give e.g. '
                         '{"1": {"candidate_steps": [0, 1, 3]}}')
    return dict(sorted(slots.items()))


class StepTuner:
    """BEG-MAB over step counts, per SGLang slot; shared by both protocol shapes."""

    def __init__(self, slots: Mapping[int, Sequence[int]], initial_steps: int, *, seed: int = 0,
                 clock: Callable[[], float] = time.monotonic, max_gap_s: float = MAX_GAP_S,
                 tuner: TunerConfig | None = None) -> None:
        self.slot_keys = sorted(slots)
        self.slots = {k: tuple(slots[k]) for k in self.slot_keys}
        # Uniform exploration here: a slot offers only step counts whose costs are close (0.5.12
        # has no off arm); on the recorded trace the tuner's cost weighting measured 96.5% of the
        # per-batch-size oracle against 97.2% uniform (tlt bench sglang-tuner).
        self._base = tuner or TunerConfig(seed=seed, explore_gap=math.inf)
        self._cuda_graph_bs: list[int] | None = None
        self.tuner = self._build_tuner()
        self.candidate_steps_all = sorted({s for v in self.slots.values() for s in v})
        self.current_steps = initial_steps if initial_steps in self.candidate_steps_all \
            else self.candidate_steps_all[len(self.candidate_steps_all) // 2]
        self._pending: collections.deque[tuple[int, int]] = collections.deque(maxlen=8)
        self._clock, self._max_gap = clock, max_gap_s
        self._last_verify: float | None = None
        self.verifies = 0
        self.learned = 0

    # --- routing (SGLang's: pad to a captured graph batch size, then the closest slot below)
    def set_cuda_graph_bs(self, cuda_graph_bs: Sequence[int] | None) -> None:
        """SGLang calls this once, before capture; the tuner's buckets follow the routing."""
        self._cuda_graph_bs = sorted(cuda_graph_bs) if cuda_graph_bs else None
        self.tuner = self._build_tuner()

    def slot_of(self, batch_size: int) -> int:
        padded = batch_size
        if self._cuda_graph_bs is not None:
            i = bisect.bisect_left(self._cuda_graph_bs, batch_size)
            padded = self._cuda_graph_bs[i] if i < len(self._cuda_graph_bs) else batch_size
        i = bisect.bisect_right(self.slot_keys, padded) - 1
        return self.slot_keys[max(0, i)]

    def _build_tuner(self) -> BegMab:
        """One tuner bucket per reachable slot, bounded by the largest batch routed to it."""
        buckets: list[tuple[int, tuple[Arm, ...]]] = []
        for i, key in enumerate(self.slot_keys):
            if i + 1 < len(self.slot_keys):  # routing is monotone: find where the next slot starts
                nxt = self.slot_keys[i + 1]
                hi = next(b for b in range(1, nxt + 1) if self.slot_of(b) >= nxt) - 1
            else:
                hi = max(key, buckets[-1][0] + 1 if buckets else 1)
            if hi >= 1 and (not buckets or hi > buckets[-1][0]):  # else no batch reaches this slot
                buckets.append((hi, tuple(arm_of(s) for s in self.slots[key])))
        b = self._base
        return BegMab(TunerConfig(buckets=tuple(buckets), epsilon=b.epsilon, explore_gap=b.explore_gap,
                                  window=b.window, median_of_goodput=b.median_of_goodput, seed=b.seed))

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        """Captured batch sizes at which ``step`` can run (bucketed capture)."""
        if self._cuda_graph_bs is None:
            return None
        return [b for b in self._cuda_graph_bs if step in self.slots[self.slot_of(b)]]

    # --- decisions and rewards
    def choose(self, batch_size: int) -> int:
        """Step count for the next decode batch of ``batch_size`` requests (queued for its result)."""
        steps = self.tuner.choose(batch_size).depth
        self._pending.append((batch_size, steps))
        self.current_steps = steps
        return steps

    def observe(self, accepts: Sequence[int], batch_size: int) -> None:
        """One verify result: accepted drafts per request, host-side only."""
        now = self._clock()
        prev, self._last_verify = self._last_verify, now
        self.verifies += 1
        steps = self._match(batch_size, max(accepts, default=0))
        if steps is None or prev is None or not accepts or arm_of(steps) not in self.tuner.arms(batch_size):
            return
        dt = now - prev
        if not 0 < dt <= self._max_gap:
            return
        self.tuner.record(batch_size, arm_of(steps), sum(accepts), dt)
        self.learned += 1

    def _match(self, batch_size: int, max_accepted: int) -> int | None:
        while self._pending:
            bs, steps = self._pending.popleft()
            if bs == batch_size and max_accepted <= steps:
                return steps
        return None

    def stats(self) -> dict[str, Any]:
        return {"verifies": self.verifies, "learned": self.learned, "tuner": self.tuner.stats()}


class AdaptiveTuner(StepTuner):
    """SGLang 0.5.23's ``AdaptiveSpecPolicy`` (replaces ``AdaptiveSpeculativeParams``)."""

    def __init__(self, initial_steps: int, cfg_path: str | SlotsConfig | None = None, **kw: Any) -> None:
        super().__init__(load_slots(cfg_path), initial_steps, **kw)

    @property
    def candidate_steps(self) -> list[int]:
        return list(self.candidate_steps_all)

    def get_steps_for_batch(self, batch_size: int) -> int:
        return self.choose(batch_size)

    def on_verify_complete(self, num_correct_drafts_per_req: list[int], batch_size: int) -> int | None:
        self.observe(num_correct_drafts_per_req, batch_size or len(num_correct_drafts_per_req))
        return None  # the next get_steps_for_batch decides


class EmaCompatTuner(StepTuner):
    """SGLang 0.5.12's ``AdaptiveSpeculativeParams`` shape: decide after each verify."""

    def __init__(self, initial_steps: int, config: Mapping[str, Any] | None = None, **kw: Any) -> None:
        cfg = dict(config or {})
        slots_cfg = {k: v for k, v in cfg.items() if str(k).isdigit()}
        if "candidate_steps" in cfg and not slots_cfg:  # 0.5.12's flat format: one slot
            slots_cfg = {"1": {"candidate_steps": cfg["candidate_steps"]}}
        slots = load_slots(slots_cfg or _positive(DEFAULT_SLOTS), allow_zero=False)
        if initial_steps not in {s for v in slots.values() for s in v}:
            slots = {k: tuple(sorted({*v, initial_steps})) for k, v in slots.items()}
        super().__init__(slots, initial_steps, **kw)
        self.candidate_steps = list(self.candidate_steps_all)

    def update(self, num_correct_drafts_per_req: list[int]) -> bool:
        bs = len(num_correct_drafts_per_req)
        if not bs:
            return False
        if not self._pending:  # the first verify ran with the step count SGLang started with
            self._pending.append((bs, self.current_steps))
        old = self.current_steps
        self.observe(num_correct_drafts_per_req, bs)
        return self.choose(bs) != old


def _positive(slots: Mapping[str, Any]) -> dict[str, Any]:
    return {k: {"candidate_steps": [s for s in v["candidate_steps"] if s > 0]} for k, v in slots.items()}
