"""CUDA-graph planning per batch-size bucket and a graph-memory model.

Owns which graphs the SD engine captures (:func:`plan_graphs`) and what they are estimated to cost
(:func:`estimate_bytes`, :meth:`GraphPlan.memory_report`). Capturing and replaying them on a GPU
is :mod:`rollout.graph_pool`. Nothing here decides strategies; the BEG-MAB tuner does, from the
same buckets.

Graph keys (both frozen, so identical shapes from different arms merge into one graph):

* ``TargetGraphKey(batch, query_tokens)``: one target forward over ``[batch, query_tokens]``;
  an arm verifies ``tokens_to_verify + 1`` tokens (its draft nodes plus the root token), and
  ``Arm.off()`` is the plain decode graph ``query_tokens=1``.
* ``DraftGraphKey(batch, topk)``: one drafter step over ``[batch, topk]`` tokens. An arm of
  depth ``d`` replays it ``d`` times (the first level has one valid token per row, the root; the
  other ``topk-1`` columns are masked padding), so arms that differ only in depth or
  tokens-to-verify share it. Keying by ``(batch, depth, topk)`` (one multi-step graph, as SGLang
  captures) would save ``d-1`` graph launches (~10 us each) per round but multiply the graph count
  and hold ``d`` levels of activations; per-step replay keeps one level's workspace.
  The drafter's catch-up forward over accepted tokens is not planned here.

Policies: ``naive`` captures every arm of every bucket at every captured batch size;
``bucketed`` captures, at captured size ``c``, only the arms of the buckets that runtime batch
sizes padded to ``c`` (``prev_c < bs <= c``) map to. A batch above the last bucket's max uses the
last bucket; a batch above the largest captured size has no graph (``padded_batch`` -> None: the
engine runs it eagerly). With ``speculate_max_batch`` (the elastic threshold) sizes that only
non-speculating batches pad to get the decode graph alone, in both policies.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence


from drafter.model_config import ModelConfig
from rollout.strategy import Arm
from rollout.tuner import TunerConfig

log = logging.getLogger(__name__)

POLICIES = ("bucketed", "naive")
DEFAULT_CAPTURE_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
# (max batch size, arms the tuner may pick there): the BEG-MAB tuner's own defaults, so the graphs
# always cover what the tuner can pick; pass the tuner's config.buckets when it is not the default.
DEFAULT_BUCKETS: tuple[tuple[int, tuple[Arm, ...]], ...] = TunerConfig().buckets


# --------------------------------------------------------------------------- keys and config
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
class DraftGraphKey:
    batch: int  # captured (padded) batch size
    topk: int  # tokens per row in one draft step

    @property
    def tokens(self) -> int:
        return self.batch * self.topk

    def __str__(self) -> str:
        return f"draft[b{self.batch} k{self.topk}]"


GraphKey = TargetGraphKey | DraftGraphKey


def arm_keys(batch: int, arm: Arm) -> tuple[TargetGraphKey, DraftGraphKey | None]:
    """The graphs one round of ``arm`` replays at captured size ``batch`` (no draft graph if off)."""
    if arm.is_off:
        return TargetGraphKey(batch=batch, query_tokens=1), None
    return (TargetGraphKey(batch=batch, query_tokens=arm.tokens_to_verify + 1),
            DraftGraphKey(batch=batch, topk=arm.topk))


@dataclasses.dataclass(frozen=True, kw_only=True)
class GraphPlanConfig:
    capture_batch_sizes: tuple[int, ...] = DEFAULT_CAPTURE_BATCH_SIZES
    buckets: tuple[tuple[int, tuple[Arm, ...]], ...] = DEFAULT_BUCKETS
    # Plain decode graph (query_tokens=1) at every captured size: the engine decodes without SD
    # above the elastic threshold. Off, decode graphs come only from buckets holding Arm.off().
    include_decode: bool = True
    # The engine's elastic threshold: a captured size that only batches above it pad to gets no SD
    # graphs (in both policies: SD never runs there). None = speculate at every captured size.
    speculate_max_batch: int | None = None

    def __post_init__(self) -> None:
        if self.speculate_max_batch is not None and (
                not isinstance(self.speculate_max_batch, int) or self.speculate_max_batch < 0):
            raise ValueError(f"speculate_max_batch={self.speculate_max_batch!r}: give the elastic "
                             "threshold (an int >= 0) or None to speculate at every captured size")
        sizes = tuple(self.capture_batch_sizes)
        if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"capture_batch_sizes={sizes}: give one or more batch sizes >= 1")
        if list(sizes) != sorted(set(sizes)):
            raise ValueError(f"capture_batch_sizes={sizes}: sort them ascending without repeats")
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
        if batch < 1:
            raise ValueError(f"batch={batch}: a batch has at least one request")
        return next((c for c in self.capture_batch_sizes if c >= batch), None)

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


# --------------------------------------------------------------------------- memory model
@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelDims:
    """Shapes the graph-memory model needs; drafter fields of 0 mean 'same as the target'."""

    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_layers: int  # not in the formula (intermediates are freed layer by layer); bounds aux_layers
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # bf16 activations
    logits_bytes: int = 4  # logits handed to sampling/verification (fp32)
    aux_layers: int = 0  # extra per-layer hidden states returned by verify (EAGLE-3: 3)
    draft_intermediate_size: int = 0
    draft_vocab_size: int = 0  # EAGLE-3 draft vocabulary; 0 = target vocab (EAGLE)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "vocab_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "dtype_bytes", "logits_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        for name in ("aux_layers", "draft_intermediate_size", "draft_vocab_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0 (0 = default)")
        if self.aux_layers > self.num_layers + 1:
            raise ValueError(f"aux_layers={self.aux_layers}: at most num_layers + 1 = {self.num_layers + 1}")

    @classmethod
    def from_config(cls, cfg: ModelConfig, **kw) -> ModelDims:
        return cls(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                   vocab_size=cfg.vocab_size, num_layers=cfg.num_hidden_layers,
                   num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                   head_dim=cfg.head_dim, **kw)


QWEN25_32B = ModelDims(hidden_size=5120, intermediate_size=27648, vocab_size=152064, num_layers=64,
                       num_heads=40, num_kv_heads=8, head_dim=128)


def estimate_parts(key: GraphKey, dims: ModelDims) -> tuple[int, int]:
    """(static output bytes, transient workspace bytes) of one captured graph.

    Per token, with H hidden, I intermediate, V vocab, A = heads*head_dim, K = kv_heads*head_dim,
    b = dtype bytes, f = logits bytes (attention scores are not materialised: flash/paged kernels):
      target  workspace = b*(2H + 2A + 2K + 3I + V)  residual + normed x, q + attention out, k + v,
                                                      gate + up + silu(gate)*up, logits before cast
              outputs   = b*H*(1 + aux_layers) + f*V  post-norm feature (+ EAGLE-3 layers), logits
      draft   workspace = b*(4H + 2A + 2K + 3I_d + V_d) + 4*V_d  [embed, feature] concat 2H, fc out
                                                      + normed, layer as above, logits + fp32 softmax
              outputs   = b*H + topk*(4 + 8)          next feature, top-k probs (fp32) + ids (int64)
    The transient part is freed layer by layer, so one layer's worth counts; multiply by tokens.
    """
    h, a, k, b = dims.hidden_size, dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim, dims.dtype_bytes
    if isinstance(key, TargetGraphKey):
        work = b * (2 * h + 2 * a + 2 * k + 3 * dims.intermediate_size + dims.vocab_size)
        out = b * h * (1 + dims.aux_layers) + dims.logits_bytes * dims.vocab_size
    elif isinstance(key, DraftGraphKey):
        inter = dims.draft_intermediate_size or dims.intermediate_size
        vd = dims.draft_vocab_size or dims.vocab_size
        work = b * (4 * h + 2 * a + 2 * k + 3 * inter + vd) + 4 * vd
        out = b * h + key.topk * (4 + 8)
    else:
        raise TypeError(f"not a graph key: {key!r}")
    return key.tokens * out, key.tokens * work


def estimate_bytes(key: GraphKey, dims: ModelDims) -> int:
    """Activation + workspace bytes of one graph captured into its own pool (see estimate_parts)."""
    return sum(estimate_parts(key, dims))


def _sum_bytes(keys: Iterable[GraphKey], dims: ModelDims) -> tuple[int, int]:
    """(private pools: sum of graphs, one shared pool: sum of outputs + largest workspace)."""
    parts = [estimate_parts(k, dims) for k in keys]
    return sum(o + w for o, w in parts), sum(o for o, _ in parts) + max((w for _, w in parts), default=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryReport:
    naive_bytes: int  # every arm at every captured size, each graph counted whole
    bucketed_bytes: int
    single_bytes: int  # the largest single arm at every captured size
    single_arm: str
    naive_shared_bytes: int  # same sets in one shared pool: outputs + the largest workspace
    bucketed_shared_bytes: int
    naive_graphs: int
    bucketed_graphs: int
    single_graphs: int

    @property
    def ratio(self) -> float:
        return self.naive_bytes / self.bucketed_bytes if self.bucketed_bytes else float("inf")

    @property
    def shared_ratio(self) -> float:
        return self.naive_shared_bytes / self.bucketed_shared_bytes if self.bucketed_shared_bytes else float("inf")

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "ratio": self.ratio, "shared_ratio": self.shared_ratio}

    def lines(self) -> list[str]:
        gb = 1e9
        return [
            f"  model naive    {self.naive_bytes / gb:7.2f} GB  ({self.naive_graphs} graphs)",
            f"  model bucketed {self.bucketed_bytes / gb:7.2f} GB  ({self.bucketed_graphs} graphs)",
            f"  model single   {self.single_bytes / gb:7.2f} GB  ({self.single_graphs} graphs, "
            f"largest arm {self.single_arm})",
            f"  naive / bucketed = {self.ratio:.2f}x (paper 30.39/10.69 = 2.84x); one shared pool: "
            f"{self.naive_shared_bytes / gb:.2f} / {self.bucketed_shared_bytes / gb:.2f} GB = "
            f"{self.shared_ratio:.2f}x",
        ]


# --------------------------------------------------------------------------- the plan
@dataclasses.dataclass(frozen=True, kw_only=True)
class GraphSet:
    target: tuple[TargetGraphKey, ...]
    draft: tuple[DraftGraphKey, ...]

    @classmethod
    def of(cls, keys: Iterable[GraphKey | None]) -> GraphSet:
        keys = {k for k in keys if k is not None}
        return cls(target=tuple(sorted(k for k in keys if isinstance(k, TargetGraphKey))),
                   draft=tuple(sorted(k for k in keys if isinstance(k, DraftGraphKey))))

    @property
    def keys(self) -> tuple[GraphKey, ...]:
        return self.target + self.draft

    def __len__(self) -> int:
        return len(self.target) + len(self.draft)

    def __contains__(self, key: object) -> bool:
        return key in self.target or key in self.draft


def _graphs_for(arms_by_batch: Mapping[int, Sequence[Arm]], include_decode: bool) -> GraphSet:
    keys: list[GraphKey | None] = []
    for c, arms in arms_by_batch.items():
        if include_decode:
            keys.append(TargetGraphKey(batch=c, query_tokens=1))
        for arm in arms:
            keys.extend(arm_keys(c, arm))
    return GraphSet.of(keys)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GraphPlan:
    config: GraphPlanConfig
    arms_by_batch: tuple[tuple[int, tuple[Arm, ...]], ...]  # captured size -> arms needed there
    bucketed: GraphSet
    naive: GraphSet

    def graphs(self, policy: str = "bucketed") -> GraphSet:
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: use one of {POLICIES}")
        return self.bucketed if policy == "bucketed" else self.naive

    def padded_batch(self, batch: int) -> int | None:
        return self.config.padded_batch(batch)

    def keys_for(self, batch: int, arm: Arm, policy: str = "bucketed") -> tuple[TargetGraphKey, DraftGraphKey | None]:
        """Graphs to replay for a runtime batch running ``arm``; KeyError if not captured."""
        padded = self.padded_batch(batch)
        if padded is None:
            raise KeyError(f"batch {batch} exceeds the largest captured size "
                           f"{self.config.capture_batch_sizes[-1]}: run it eagerly")
        keys = arm_keys(padded, arm)
        graphs = self.graphs(policy)
        missing = [str(k) for k in keys if k is not None and k not in graphs]
        if missing:
            raise KeyError(f"arm {arm} at batch {batch} (padded {padded}) needs {missing}, not in the "
                           f"{policy} plan; the tuner must pick arms from bucket "
                           f"{self.config.bucket_index(batch)}")
        return keys

    def memory_report(self, dims: ModelDims) -> MemoryReport:
        naive, naive_shared = _sum_bytes(self.naive.keys, dims)
        bucketed, bucketed_shared = _sum_bytes(self.bucketed.keys, dims)
        sizes, sd = self.config.capture_batch_sizes, self.config.speculative_sizes()
        best: tuple[int, str, int] = (-1, "off", 0)
        for arm in self.config.all_arms:
            single = _graphs_for({c: (arm,) if c in sd else () for c in sizes}, self.config.include_decode)
            total = _sum_bytes(single.keys, dims)[0]
            if total > best[0]:
                best = (total, str(arm), len(single))
        return MemoryReport(naive_bytes=naive, bucketed_bytes=bucketed, single_bytes=best[0],
                            single_arm=best[1], single_graphs=best[2],
                            naive_shared_bytes=naive_shared, bucketed_shared_bytes=bucketed_shared,
                            naive_graphs=len(self.naive), bucketed_graphs=len(self.bucketed))


def plan_graphs(cfg: GraphPlanConfig) -> GraphPlan:
    """Unique graph keys per policy; identical shapes from different arms are captured once."""
    sd, every = cfg.speculative_sizes(), cfg.all_arms
    arms_by_batch: dict[int, tuple[Arm, ...]] = {c: () for c in cfg.capture_batch_sizes}
    for c, (lo, hi) in sd.items():
        # speculating runtime batches lo..hi all replay at c: take every bucket they map to
        first, last = cfg.bucket_index(lo), cfg.bucket_index(hi)
        arms_by_batch[c] = tuple(sorted({a for i in range(first, last + 1) for a in cfg.buckets[i][1]}))
    plan = GraphPlan(config=cfg, arms_by_batch=tuple(arms_by_batch.items()),
                     bucketed=_graphs_for(arms_by_batch, cfg.include_decode),
                     naive=_graphs_for({c: every if c in sd else () for c in arms_by_batch}, cfg.include_decode))
    log.info("graph plan: %d captured sizes, %d arms -> bucketed %d graphs (%d target, %d draft), "
             "naive %d", len(cfg.capture_batch_sizes), len(every), len(plan.bucketed),
             len(plan.bucketed.target), len(plan.bucketed.draft), len(plan.naive))
    return plan
