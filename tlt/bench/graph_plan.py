"""CUDA-graph planning per batch-size bucket: which graphs an engine would capture, by scheme.

Owns :func:`plan_graphs` and what it returns (:class:`GraphPlan`, :class:`GraphSet`), the planner's
configuration (:class:`GraphPlanConfig`: captured sizes, the tuner's buckets, the elastic
threshold) and the per-step drafter key :class:`DraftGraphKey`. The engine does not plan: it
captures each :mod:`tlt.rollout.graphs` key on its first uses (so only the shapes the tuner really
picks are captured, a subset of the bucketed plan); ``tlt bench graphs`` and ``tlt bench
sglang-tuner`` plan, capture and price whole plans (:mod:`tlt.bench.graph_memory`).

Graph keys (both frozen, so identical shapes from different arms merge into one graph):

* ``TargetGraphKey(batch, query_tokens)``: one target forward over ``[batch, query_tokens]``;
  an arm verifies ``tokens_to_verify + 1`` tokens (its draft nodes plus the root token), and
  ``Arm.off()`` is the plain decode graph ``query_tokens=1``.
* ``DraftLoopGraphKey(batch, arm, window, sampled)`` (``draft_graphs="loop"``, what the engine's
  EAGLE proposer captures): one whole proposal -- catch-up over ``window = depth + 1`` pairs, every
  draft level, top-k and tree selection -- per padded batch and arm, as SGLang's draft runner
  captures its multi-step draft. One launch per proposal; arms share a graph only when equal.
* ``DraftGraphKey(batch, topk)`` (``draft_graphs="step"``, a model of per-step capture): one
  drafter step over ``[batch, topk]`` tokens replayed ``d`` times, so arms that differ only in depth
  or tokens-to-verify share it, and the catch-up is not planned. ``tlt bench sglang-tuner`` uses
  it for SGLang's per-step graphs.
Arms of a model-free proposer (``arm.proposer`` set) have no drafter graph.

Schemes: ``naive`` captures every arm of every bucket at every captured batch size;
``bucketed`` captures, at captured size ``c``, only the arms of the buckets that runtime batch
sizes padded to ``c`` (``prev_c < bs <= c``) map to. A batch above the last bucket's max uses the
last bucket; a batch above the largest captured size has no graph (``padded_batch`` -> None: the
engine runs it eagerly). With ``speculate_max_batch`` (the elastic threshold) sizes that only
non-speculating batches pad to get the decode graph alone, in both schemes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence

from tlt.rollout.graph_pool import SCHEMES
from tlt.rollout.graphs import DEFAULT_CAPTURE_BATCH_SIZES, CaptureSizes, DraftLoopGraphKey, TargetGraphKey
from tlt.rollout.strategy import Arm
from tlt.rollout.tuner import TunerConfig

log = logging.getLogger(__name__)

# (max batch size, arms the tuner may pick there): the BEG-MAB tuner's own defaults, so the graphs
# always cover what the tuner can pick; pass the tuner's config.buckets when it is not the default.
DEFAULT_BUCKETS: tuple[tuple[int, tuple[Arm, ...]], ...] = TunerConfig().buckets


@dataclasses.dataclass(frozen=True, order=True, kw_only=True)
class DraftGraphKey:
    batch: int  # captured (padded) batch size
    topk: int  # tokens per row in one draft step

    @property
    def tokens(self) -> int:
        return self.batch * self.topk

    def __str__(self) -> str:
        return f"draft[b{self.batch} k{self.topk}]"



GraphKey = TargetGraphKey | DraftGraphKey | DraftLoopGraphKey


DRAFT_GRAPHS = ("loop", "step")


def arm_keys(batch: int, arm: Arm, draft_graphs: str = "loop",
             sampled: bool = True) -> tuple[TargetGraphKey, DraftGraphKey | DraftLoopGraphKey | None]:
    """The graphs one round of ``arm`` replays at captured size ``batch`` (no draft graph if off or
    model-free)."""
    if arm.is_off:
        return TargetGraphKey(batch=batch, query_tokens=1), None
    target = TargetGraphKey(batch=batch, query_tokens=arm.tokens_to_verify + 1)
    if arm.proposer:
        return target, None
    if draft_graphs == "step":
        return target, DraftGraphKey(batch=batch, topk=arm.topk)
    return target, DraftLoopGraphKey(batch=batch, depth=arm.depth, topk=arm.topk,
                                     tokens_to_verify=arm.tokens_to_verify, window=arm.depth + 1, sampled=sampled)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GraphPlanConfig:
    capture_batch_sizes: tuple[int, ...] = DEFAULT_CAPTURE_BATCH_SIZES
    buckets: tuple[tuple[int, tuple[Arm, ...]], ...] = DEFAULT_BUCKETS
    # Plain decode graph (query_tokens=1) at every captured size: the engine decodes without SD
    # above the elastic threshold. Off, decode graphs come only from buckets holding Arm.off().
    include_decode: bool = True
    # The engine's elastic threshold: a captured size that only batches above it pad to gets no SD
    # graphs (in both schemes: SD never runs there). None = speculate at every captured size.
    speculate_max_batch: int | None = None
    draft_graphs: str = "loop"  # "loop": a whole proposal per (batch, arm); "step": a drafter step per (batch, topk)
    sampled: bool = True  # loop graphs build the shared-noise scores (RL rollouts sample)

    def __post_init__(self) -> None:
        if self.draft_graphs not in DRAFT_GRAPHS:
            raise ValueError(f"draft_graphs={self.draft_graphs!r}: use one of {DRAFT_GRAPHS}")
        if self.speculate_max_batch is not None and (
                not isinstance(self.speculate_max_batch, int) or self.speculate_max_batch < 0):
            raise ValueError(f"speculate_max_batch={self.speculate_max_batch!r}: give the elastic "
                             "threshold (an int >= 0) or None to speculate at every captured size")
        sizes = CaptureSizes(self.capture_batch_sizes).capture_batch_sizes  # (validated there)
        if not self.buckets:
            raise ValueError("buckets is empty: give at least one (max_batch_size, arms) bucket")
        prev, buckets = 0, []
        for i, bucket in enumerate(self.buckets):
            if not (isinstance(bucket, (tuple, list)) and len(bucket) == 2
                    and isinstance(bucket[1], (tuple, list))):
                raise ValueError(f"buckets[{i}]={bucket!r}: each bucket is (max_batch_size, (Arm, ...))")
            top, arms = bucket[0], tuple(bucket[1])
            if not isinstance(top, int) or top <= prev:
                raise ValueError(f"buckets[{i}] max_batch_size={top!r}: bucket maxima must be ints "
                                 f"strictly ascending (previous {prev})")
            if not arms or not all(isinstance(a, Arm) for a in arms):
                raise ValueError(f"buckets[{i}] arms={arms!r}: give a non-empty tuple of Arm")
            if len(set(arms)) != len(arms):
                raise ValueError(f"buckets[{i}] arms={tuple(map(str, arms))}: remove the repeated arm")
            prev = top
            buckets.append((top, arms))
        object.__setattr__(self, "capture_batch_sizes", sizes)
        object.__setattr__(self, "buckets", tuple(buckets))

    def bucket_index(self, batch: int) -> int:
        """The bucket a runtime batch maps to: the first with ``batch <= max``, else the last."""
        if batch < 1:
            raise ValueError(f"batch={batch}: a batch has at least one request")
        return next((i for i, (top, _) in enumerate(self.buckets) if batch <= top), len(self.buckets) - 1)

    def padded_batch(self, batch: int) -> int | None:
        """The captured size a runtime batch is padded up to; None above the largest (eager)."""
        return CaptureSizes(self.capture_batch_sizes).padded_batch(batch)

    def speculative_sizes(self) -> dict[int, tuple[int, int]]:
        """Captured size -> (lo, hi): the speculating runtime batches lo..hi padded to it."""
        out, prev, cap = {}, 0, self.speculate_max_batch
        for c in self.capture_batch_sizes:
            hi = c if cap is None else min(c, cap)
            if hi > prev:
                out[c] = (prev + 1, hi)
            prev = c
        return out

    @property
    def all_arms(self) -> tuple[Arm, ...]:
        return tuple(sorted({a for _, arms in self.buckets for a in arms}))


# --------------------------------------------------------------------------- the plan
@dataclasses.dataclass(frozen=True, kw_only=True)
class GraphSet:
    target: tuple[TargetGraphKey, ...]
    draft: tuple[DraftGraphKey | DraftLoopGraphKey, ...]

    @classmethod
    def of(cls, keys: Iterable[GraphKey | None]) -> GraphSet:
        keys = {k for k in keys if k is not None}
        return cls(target=tuple(sorted(k for k in keys if isinstance(k, TargetGraphKey))),
                   draft=tuple(sorted((k for k in keys if not isinstance(k, TargetGraphKey)),
                                      key=lambda k: (type(k).__name__, k))))

    @property
    def keys(self) -> tuple[GraphKey, ...]:
        return self.target + self.draft

    def __len__(self) -> int:
        return len(self.target) + len(self.draft)

    def __contains__(self, key: object) -> bool:
        return key in self.target or key in self.draft


def graph_set(arms_by_batch: Mapping[int, Sequence[Arm]], include_decode: bool, draft_graphs: str = "loop",
              sampled: bool = True) -> GraphSet:
    keys: list[GraphKey | None] = []
    for c, arms in arms_by_batch.items():
        if include_decode:
            keys.append(TargetGraphKey(batch=c, query_tokens=1))
        for arm in arms:
            keys.extend(arm_keys(c, arm, draft_graphs, sampled))
    return GraphSet.of(keys)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GraphPlan:
    config: GraphPlanConfig
    arms_by_batch: tuple[tuple[int, tuple[Arm, ...]], ...]  # captured size -> arms needed there
    bucketed: GraphSet
    naive: GraphSet

    def graphs(self, scheme: str = "bucketed") -> GraphSet:
        if scheme not in SCHEMES:
            raise ValueError(f"scheme={scheme!r}: use one of {SCHEMES}")
        return self.bucketed if scheme == "bucketed" else self.naive

    def padded_batch(self, batch: int) -> int | None:
        return self.config.padded_batch(batch)

    def keys_for(self, batch: int, arm: Arm, scheme: str = "bucketed") -> tuple[TargetGraphKey, GraphKey | None]:
        """Graphs to replay for a runtime batch running ``arm``; KeyError if not captured."""
        padded = self.padded_batch(batch)
        if padded is None:
            raise KeyError(f"batch {batch} exceeds the largest captured size "
                           f"{self.config.capture_batch_sizes[-1]}: run it eagerly")
        keys = arm_keys(padded, arm, self.config.draft_graphs, self.config.sampled)
        graphs = self.graphs(scheme)
        missing = [str(k) for k in keys if k is not None and k not in graphs]
        if missing:
            raise KeyError(f"arm {arm} at batch {batch} (padded {padded}) needs {missing}, not in the "
                           f"{scheme} plan; the tuner must pick arms from bucket "
                           f"{self.config.bucket_index(batch)}")
        return keys

def plan_graphs(cfg: GraphPlanConfig) -> GraphPlan:
    """Unique graph keys per scheme; identical shapes from different arms are captured once."""
    sd, every = cfg.speculative_sizes(), cfg.all_arms
    arms_by_batch: dict[int, tuple[Arm, ...]] = {c: () for c in cfg.capture_batch_sizes}
    for c, (lo, hi) in sd.items():
        # speculating runtime batches lo..hi all replay at c: take every bucket they map to
        first, last = cfg.bucket_index(lo), cfg.bucket_index(hi)
        arms_by_batch[c] = tuple(sorted({a for i in range(first, last + 1) for a in cfg.buckets[i][1]}))
    plan = GraphPlan(config=cfg, arms_by_batch=tuple(arms_by_batch.items()),
                     bucketed=graph_set(arms_by_batch, cfg.include_decode, cfg.draft_graphs, cfg.sampled),
                     naive=graph_set({c: every if c in sd else () for c in arms_by_batch}, cfg.include_decode,
                                     cfg.draft_graphs, cfg.sampled))
    log.info("graph plan: %d captured sizes, %d arms -> bucketed %d graphs (%d target, %d draft), "
             "naive %d", len(cfg.capture_batch_sizes), len(every), len(plan.bucketed),
             len(plan.bucketed.target), len(plan.bucketed.draft), len(plan.naive))
    return plan
