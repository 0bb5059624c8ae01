"""The target forward of one engine step at static shapes, replayed from CUDA graphs on CUDA.

Owns :class:`StaticTargetStep`. A step is padded to a captured shape: the batch up to the planned
captured size (:meth:`tlt.rollout.graphs.GraphPlanConfig.padded_batch`), the query to the arm's
``tokens_to_verify + 1`` (the engine pads the draft tree with invalid nodes), and the attention
span to the whole cache (no data-dependent span, as in gpt-fast). It then runs from a graph of a
:class:`~tlt.rollout.graph_pool.CudaGraphPool`, captured on first use of its
:class:`~tlt.rollout.graphs.TargetGraphKey` -- so only the (batch size, arm) shapes the tuner really
picks are ever captured, a subset of the bucketed plan -- or eagerly (CPU, or a batch above the
largest captured size). Padding rows (cache rows no running request holds) and the warm-up and
capture runs write only the last ``Q`` slots of the cache, which never hold a committed token
(requests end ``max_draft_tokens`` slots before them), and see only slot 0; padded tree nodes are
invalid, so the verifier never reads them. The dynamic-shape and static-shape engines are
token-identical (tests/rollout/test_static_step.py).
The drafter's forward stays eager (its catch-up has a variable length).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from tlt.rollout.graphs import GraphPlanConfig, TargetGraphKey
from tlt.rollout.kv_cache import CachedBackend, StaticKVCache
from tlt.rollout.target import TargetModel, TargetOutput

log = logging.getLogger(__name__)


class StaticTargetStep:
    def __init__(self, target: TargetModel, cache: StaticKVCache, sizes: GraphPlanConfig,
                 capture: tuple[int, ...], features: Callable[[TargetOutput], torch.Tensor | None], *,
                 cuda_graphs: bool) -> None:
        # sizes: the captured batch sizes; features: the engine's feature extraction (None: none)
        self.target, self.cache, self.sizes = target, cache, sizes
        self.capture, self.features = capture, features
        self.rows = cache.k.shape[1]
        self.pool = None
        if cuda_graphs and target.config.rope_parameters.get("rope_type") == "dynamic":
            log.warning("dynamic-NTK RoPE reads the largest position on the host: no CUDA graphs")
        elif cuda_graphs and cache.k.device.type == "cuda":
            from tlt.rollout.graph_pool import CudaGraphPool

            self.pool = CudaGraphPool(self._make_step, device=cache.k.device)
        self.replays = 0  # graph replays (a test and the bench read it)
        self.capture_s = 0.0  # seconds spent capturing graphs, summed (kept out of tuner rewards)

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                 mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids, pos, slots: [B, Q] long; mask: [B, 1, Q, S] additive over the whole cache (S =
        cache.max_len). Returns logits [B, Q, V] and features [B, Q, F] (None unless wanted)."""
        b, q = ids.shape
        padded = self.sizes.padded_batch(b)
        if padded is None or padded > self.rows:
            out = self._forward(ids, pos, slots, mask)
            return out["logits"], out.get("features")
        if padded > b:  # free rows b..padded-1: scratch slots, slot 0 visible
            extra = padded - b
            ids = torch.cat([ids, ids.new_zeros(extra, q)])
            pos = torch.cat([pos, pos.new_zeros(extra, q)])
            slots = torch.cat([slots, self._scratch(q).expand(extra, q)])
            pad_mask = torch.full((extra, 1, q, mask.shape[-1]), torch.finfo(mask.dtype).min,
                                  dtype=mask.dtype, device=mask.device)
            pad_mask[..., 0] = 0.0
            mask = torch.cat([mask, pad_mask])
        inputs = {"ids": ids, "pos": pos, "slots": slots, "mask": mask}
        if self.pool is None:
            out = self._forward(**inputs)
        else:
            key = TargetGraphKey(batch=padded, query_tokens=q)
            if not self.pool.has(key):
                t0 = time.perf_counter()
                self.pool.capture([key])
                self.capture_s += time.perf_counter() - t0
            out = self.pool.replay(key, **inputs)
            self.replays += 1
        feats = out.get("features")
        return out["logits"][:b], None if feats is None else feats[:b]

    def _forward(self, ids, pos, slots, mask) -> dict[str, torch.Tensor]:
        out = self.target(ids, pos, CachedBackend(self.cache, slots, mask), capture=self.capture)
        feats = self.features(out)
        return {"logits": out.logits} if feats is None else {"logits": out.logits, "features": feats}

    def _scratch(self, q: int) -> torch.Tensor:
        """[q] the cache's last q slots: never a committed token's (see the module docstring)."""
        return torch.arange(self.cache.max_len - q, self.cache.max_len, device=self.cache.k.device)

    def _make_step(self, key: TargetGraphKey):
        """Static input buffers for ``key`` and the function the pool captures."""
        dev, b, q = self.cache.k.device, key.batch, key.query_tokens
        inputs = {"ids": torch.zeros(b, q, dtype=torch.long, device=dev),
                  "pos": torch.zeros(b, q, dtype=torch.long, device=dev),
                  "slots": self._scratch(q).repeat(b, 1),
                  "mask": torch.zeros(b, 1, q, self.cache.max_len, dtype=torch.float32, device=dev)}
        return inputs, lambda x: self._forward(x["ids"], x["pos"], x["slots"], x["mask"])
