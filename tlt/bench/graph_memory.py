"""The graph-memory model of the benches: estimated bytes of captured CUDA graphs.

Owns :class:`ModelDims` (shapes the model needs; :data:`QWEN25_32B` for the paper's Table 3),
:func:`estimate_parts` / :func:`estimate_bytes` per graph key and :func:`memory_report` for a
:class:`~tlt.bench.graph_plan.GraphPlan`. The engine never reads it: which graphs to capture is
:mod:`tlt.rollout.graphs`; ``tlt bench graphs`` and ``tlt bench sglang-tuner`` report these figures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from tlt.drafter.model_config import ModelConfig
from tlt.bench.graph_plan import DraftGraphKey, GraphKey, GraphPlan, graph_set
from tlt.rollout.graphs import DraftLoopGraphKey, TargetGraphKey


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
    A whole draft loop (per batch row; w = window, k = topk, d = depth, n = tokens_to_verify):
      workspace = max(w, k) * draft workspace         the widest forward (catch-up or a level)
                  + (d + 2k) * 4*V_d  if sampled     the shared noise of every level, one level's
                                                      log-probs and noisy scores (fp32)
                  + k * d * (b*H + 24)               each level's kept features, scores, ids, parents
      outputs   = n * 16                             the tree: tokens and parents (int64)
    """
    h, a, k, b = dims.hidden_size, dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim, dims.dtype_bytes
    if isinstance(key, DraftLoopGraphKey):
        inter = dims.draft_intermediate_size or dims.intermediate_size
        vd = dims.draft_vocab_size or dims.vocab_size
        step = b * (4 * h + 2 * a + 2 * k + 3 * inter + vd) + 4 * vd
        work = (max(key.window, key.topk) * step + key.topk * key.depth * (b * h + 24)
                + ((key.depth + 2 * key.topk) * 4 * vd if key.sampled else 0))
        return key.batch * key.tokens_to_verify * 16, key.batch * work
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


def memory_report(plan: GraphPlan, dims: ModelDims) -> MemoryReport:
    """Estimated bytes of the plan's graph sets (and of the largest single arm) under ``dims``."""
    naive, naive_shared = _sum_bytes(plan.naive.keys, dims)
    bucketed, bucketed_shared = _sum_bytes(plan.bucketed.keys, dims)
    sizes, sd = plan.config.capture_batch_sizes, plan.config.speculative_sizes()
    best: tuple[int, str, int] = (-1, "off", 0)
    for arm in plan.config.all_arms:
        single = graph_set({c: (arm,) if c in sd else () for c in sizes}, plan.config.include_decode,
                           plan.config.draft_graphs, plan.config.sampled)
        total = _sum_bytes(single.keys, dims)[0]
        if total > best[0]:
            best = (total, str(arm), len(single))
    return MemoryReport(naive_bytes=naive, bucketed_bytes=bucketed, single_bytes=best[0],
                        single_arm=best[1], single_graphs=best[2],
                        naive_shared_bytes=naive_shared, bucketed_shared_bytes=bucketed_shared,
                        naive_graphs=len(plan.naive), bucketed_graphs=len(plan.bucketed))
