"""The verify step of the engine at static shapes, replayed from CUDA graphs on CUDA.

Owns :class:`StaticTargetStep`. A step is padded to a captured shape: the batch up to the planned
captured size (:meth:`tlt.rollout.graphs.GraphPlanConfig.padded_batch`), the query to the arm's
``tokens_to_verify + 1`` (the engine pads the draft tree with invalid nodes), and the attention
span to the whole cache (no data-dependent span, as in gpt-fast). The whole step -- the target
forward, the write of its features into the engine's buffer (EAGLE-3's layers too), the coupled
draws, the acceptance walk and the packed verdict -- then runs from one graph of a
:class:`~tlt.rollout.graph_pool.CudaGraphPool`, captured on first use of its :class:`VerifyGraphKey`
(padded batch, query, walk depth, stop-table width, and the sampling flags that decide on the host
whether the full-vocabulary sort and the noise run) -- so only the shapes the tuner really picks
are ever captured, a subset of the bucketed plan -- or eagerly (CPU, or a batch above the largest
captured size). The host then makes the step's one read. Padding rows (cache rows no running
request holds) and the warm-up and capture runs write only the last ``Q`` slots of the cache and
of the feature buffer, which never hold a committed token (requests end ``max_draft_tokens`` slots
before them), see only slot 0 and draw greedily; padded tree nodes are invalid, so the walk never
takes them. The dynamic-shape and static-shape engines are token-identical
(tests/rollout/test_static_step.py). A feature buffer laid out anew drops the graphs (they hold its
address).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from tlt.rollout.draft_tree import DraftTree
from tlt.rollout.graphs import GraphPlanConfig, TargetGraphKey
from tlt.rollout.kv_cache import CachedBackend, StaticKVCache
from tlt.rollout.sampling import RowSampling
from tlt.rollout.target import TargetModel, TargetOutput
from tlt.rollout.verify import VerifyResult, read_verdict, verify_on_device

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, order=True, kw_only=True)
class VerifyGraphKey(TargetGraphKey):
    depth: int  # walk steps (the arm's depth; 0 for a plain step)
    stops: int  # stop-table width (a power of two)
    masked: bool  # some row uses top-k / top-p: the sort runs
    sampled: bool  # some row samples: the noise runs

    def __str__(self) -> str:
        flags = "".join(f" {n}" for n, on in (("masked", self.masked), ("sampled", self.sampled)) if on)
        return f"verify[b{self.batch} q{self.query_tokens} d{self.depth} s{self.stops}{flags}]"


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
        self._buffer: torch.Tensor | None = None  # the feature buffer the graphs write (their address)
        self.replays = 0  # graph replays (a test and the bench read it)
        self.capture_s = 0.0  # seconds spent capturing graphs, summed (kept out of tuner rewards)

    def verify(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor, tree: DraftTree,
               sampling: RowSampling, stops: torch.Tensor, depth: int, buffer: torch.Tensor | None) -> VerifyResult:
        """ids, pos, slots: [B, Q] long; mask: [B, 1, Q, S] additive over the whole cache (S =
        cache.max_len); tree: [B, Q - 1] nodes; sampling, stops [B, K]: by row; depth: walk steps;
        buffer: [max_batch, S, F] the engine's features by row and slot (None: none kept)."""
        b, q = ids.shape
        padded = self.sizes.padded_batch(b)
        flags = (sampling.masked, sampling.sampled)
        if padded is None or padded > self.rows:
            return read_verdict(self._step(self._inputs(ids, pos, slots, mask, tree, sampling, stops),
                                           buffer, depth, *flags))
        width = 1 << max(stops.shape[1] - 1, 0).bit_length()  # a power of two: few graph keys
        x = self._inputs(ids, pos, slots, mask, tree, sampling, stops, pad_rows=padded - b,
                         pad_stops=width - stops.shape[1])
        if self.pool is None:
            return read_verdict(self._step(x, buffer, depth, *flags), b)
        if self._buffer is not None and buffer is not None and (self._buffer.data_ptr(), self._buffer.shape) != \
                (buffer.data_ptr(), buffer.shape):
            self.pool.close()  # the engine laid its feature buffer out anew: graphs write the old one
            log.info("verify graphs dropped: the feature buffer moved")
        self._buffer = buffer
        key = VerifyGraphKey(batch=padded, query_tokens=q, depth=depth, stops=width, masked=flags[0], sampled=flags[1])
        if not self.pool.has(key):
            t0 = time.perf_counter()
            self.pool.capture([key])
            self.capture_s += time.perf_counter() - t0
        out = self.pool.replay(key, **x)
        self.replays += 1
        return read_verdict(out, b)

    def close(self) -> None:
        """Drop the captured graphs and give their memory back (the step is being replaced)."""
        if self.pool is not None:
            self.pool.close()

    def _inputs(self, ids, pos, slots, mask, tree: DraftTree, s: RowSampling, stops, *, pad_rows: int = 0,
                pad_stops: int = 0) -> dict[str, torch.Tensor]:
        """The step's tensors by name, with ``pad_rows`` padding rows (free cache rows: scratch
        slots, slot 0 visible, no valid node, greedy) and the stop table widened by ``pad_stops``."""
        q, e = ids.shape[1], pad_rows
        x = {"ids": ids, "pos": pos, "slots": slots, "mask": mask, "tokens": tree.tokens, "parents": tree.parents,
             "valid": tree.valid, "keys": s.keys, "temp": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
             "stops": torch.nn.functional.pad(stops, (0, pad_stops), value=-1) if pad_stops else stops}
        if e:
            pad_mask = torch.full((e, 1, q, mask.shape[-1]), torch.finfo(mask.dtype).min, dtype=mask.dtype,
                                  device=mask.device)
            pad_mask[..., 0] = 0.0
            fill = {"slots": self._scratch(q).expand(e, q), "mask": pad_mask, "parents": -1, "top_p": 1.0, "stops": -1}
            for name, t in x.items():
                f = fill.get(name, 0)
                x[name] = torch.cat([t, f if isinstance(f, torch.Tensor) else t.new_full((e, *t.shape[1:]), f)])
        return x

    def _step(self, x: dict[str, torch.Tensor], buffer: torch.Tensor | None, depth: int, masked: bool,
              sampled: bool) -> dict[str, torch.Tensor]:
        """The whole verify step on the device (what a graph captures)."""
        out = self.target(x["ids"], x["pos"], CachedBackend(self.cache, x["slots"], x["mask"]), capture=self.capture)
        feats = self.features(out)
        if feats is not None and buffer is not None:  # laid out like the KV cache: row, slot
            rows = torch.arange(x["ids"].shape[0], device=x["ids"].device)[:, None]
            buffer[rows, x["slots"]] = feats
        tree = DraftTree(x["tokens"], x["parents"], x["valid"])
        s = RowSampling(x["keys"], x["temp"], x["top_k"], x["top_p"], masked, sampled)
        return verify_on_device(out.logits, tree, s, x["pos"] + 1, x["stops"], depth)

    def _scratch(self, q: int) -> torch.Tensor:
        """[q] the cache's last q slots: never a committed token's (see the module docstring)."""
        return torch.arange(self.cache.max_len - q, self.cache.max_len, device=self.cache.k.device)

    def _make_step(self, key: VerifyGraphKey):
        """Static input buffers for ``key`` (a padding batch: scratch slots only) and the function the
        pool captures."""
        dev, b, q, n = self.cache.k.device, key.batch, key.query_tokens, key.query_tokens - 1
        mask = torch.full((b, 1, q, self.cache.max_len), torch.finfo(torch.float32).min, device=dev)
        mask[..., 0] = 0.0
        z = torch.zeros(b, dtype=torch.long, device=dev)
        inputs = {"ids": torch.zeros(b, q, dtype=torch.long, device=dev),
                  "pos": torch.zeros(b, q, dtype=torch.long, device=dev),
                  "slots": self._scratch(q).repeat(b, 1), "mask": mask,
                  "tokens": torch.zeros(b, n, dtype=torch.long, device=dev),
                  "parents": torch.full((b, n), -1, dtype=torch.long, device=dev),
                  "valid": torch.zeros(b, n, dtype=torch.bool, device=dev),
                  "keys": z.clone(), "temp": torch.zeros(b, device=dev), "top_k": z.clone(),
                  "top_p": torch.ones(b, device=dev),
                  "stops": torch.full((b, key.stops), -1, dtype=torch.long, device=dev)}
        buffer = self._buffer
        return inputs, lambda x: self._step(x, buffer, key.depth, key.masked, key.sampled)
