"""The verify step of the engine at static shapes, replayed from CUDA graphs on CUDA.

Owns :class:`StaticTargetStep`. A step is padded to a captured shape: the batch up to the planned
captured size (:meth:`tlt.rollout.graphs.CaptureSizes.padded_batch`), the query to the arm's
``tokens_to_verify + 1`` (the engine pads the draft tree with invalid nodes); each row's context
length and tree mask are device inputs (:class:`~tlt.rollout.attention.AttnMeta`: the prefix read
unmasked, the tree mask on the step's own tokens only, the context split ``splits`` ways for the
padded batch), so one graph serves every length. The whole step -- the target
forward, the write of its features into the engine's buffer (EAGLE-3's layers too), the coupled
draws, the acceptance walk and the packed verdict -- then runs from one graph of a
:class:`~tlt.rollout.graph_pool.CudaGraphPool`, captured on first use of its :class:`VerifyGraphKey`
(padded batch, query, walk depth, stop-table width, and the sampling flags that decide on the host
whether the full-vocabulary sort and the noise run) at its ``capture_after``-th use -- so only the
shapes the tuner really picks are ever captured, a subset of the bucketed plan, and an arm it tries
once costs an eager step, not a capture -- or eagerly (CPU, or a batch above the largest
captured size). The host then makes the step's one read. Padding rows are free cache rows (no running request
holds them): context 0, each node seeing itself, greedy draws; padded tree nodes are invalid, so
the walk never takes them. The dynamic-shape and static-shape engines are token-identical
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
from tlt.rollout.graph_pool import CaptureGate
from tlt.rollout.graphs import CaptureSizes, TargetGraphKey
from tlt.rollout.attention import AttnMeta, default_splits
from tlt.rollout.kv_cache import StaticKVCache
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
    def __init__(self, target: TargetModel, cache: StaticKVCache, sizes: CaptureSizes,
                 capture: tuple[int, ...], features: Callable[[TargetOutput], torch.Tensor | None], *,
                 cuda_graphs: bool, attention: str = "auto", capture_after: int = 2,
                 paged: tuple[int, int, int] | None = None) -> None:
        # sizes: the captured batch sizes; features: the engine's feature extraction (None: none);
        # attention: the kernel (tlt.rollout.attention.KERNELS); capture_after: a shape's first uses run
        # eagerly, and its graph is captured at this one (the tuner's exploration costs no capture)
        self.target, self.cache, self.sizes, self.attention = target, cache, sizes, attention
        self.gate = CaptureGate(capture_after)
        # a paged cache: (block size, table width, scratch block); the rows' tables are a step input
        self.paged = paged
        self.capture, self.features = capture, features
        self.rows = cache.k.shape[1]  # rows layout: padding rows are free cache rows
        self.pool = None
        if cuda_graphs and target.config.rope_parameters.get("rope_type") == "dynamic":
            log.warning("dynamic-NTK RoPE reads the largest position on the host: no CUDA graphs")
        elif cuda_graphs and cache.k.device.type == "cuda":
            from tlt.rollout.graph_pool import CudaGraphPool

            self.pool = CudaGraphPool(self._make_step, device=cache.k.device)
        self._buffer: torch.Tensor | None = None  # the feature buffer the graphs write (their address)
        self.replays = 0  # graph replays (a test and the bench read it)
        self.capture_s = 0.0  # seconds spent capturing graphs, summed (kept out of tuner rewards)

    def verify(self, ids: torch.Tensor, pos: torch.Tensor, ctx: torch.Tensor, tail: torch.Tensor, tree: DraftTree,
               sampling: RowSampling, stops: torch.Tensor, depth: int, buffer: torch.Tensor | None,
               blocks: torch.Tensor | None = None) -> VerifyResult:
        """ids, pos: [B, Q] long; ctx: [B] long cached tokens before the step's (the tree's root
        slot); tail: [B, Q, Q] bool what each node sees of the tree; tree: [B, Q - 1] nodes;
        sampling, stops [B, K]: by row; depth: walk steps; buffer: the engine's features laid out like
        the cache (None: none kept); blocks: [B, C] int32 the rows' tables (a paged cache)."""
        b, q = ids.shape
        padded = self.sizes.padded_batch(b)
        flags = (sampling.masked, sampling.sampled)
        if padded is None or (self.paged is None and padded > self.rows):  # (paged: padding rows use the scratch block)
            x = self._inputs(ids, pos, ctx, tail, tree, sampling, stops, blocks)
            return read_verdict(self._step(x, buffer, depth, *flags))
        width = 1 << max(stops.shape[1] - 1, 0).bit_length()  # a power of two: few graph keys
        x = self._inputs(ids, pos, ctx, tail, tree, sampling, stops, blocks, pad_rows=padded - b,
                         pad_stops=width - stops.shape[1])
        if self.pool is None:
            return read_verdict(self._step(x, buffer, depth, *flags), b)
        self.pool.follow("the feature buffer", buffer)  # the graphs write it
        self._buffer = buffer
        key = VerifyGraphKey(batch=padded, query_tokens=q, depth=depth, stops=width, masked=flags[0], sampled=flags[1])
        if not self.pool.has(key):
            if not self.gate.due(key):  # a shape's first uses run eagerly
                return read_verdict(self._step(x, buffer, depth, *flags), b)
            t0 = time.perf_counter()
            self.pool.capture([key])
            self.capture_s += time.perf_counter() - t0
        out = self.pool.replay(key, **x)
        self.replays += 1
        return read_verdict(out, b)

    def close(self) -> None:
        """Drop the captured graphs and give their memory back (the step is being replaced, or its
        engine releases its memory), with the reference to the feature buffer they wrote."""
        if self.pool is not None:
            self.pool.close()
        self._buffer = None

    def _inputs(self, ids, pos, ctx, tail, tree: DraftTree, s: RowSampling, stops, blocks, *, pad_rows: int = 0,
                pad_stops: int = 0) -> dict[str, torch.Tensor]:
        """The step's tensors by name, with ``pad_rows`` padding rows (free cache rows, or a paged
        cache's scratch block: context 0, each node seeing itself, no valid node, greedy) and the stop
        table widened by ``pad_stops``."""
        q, e = ids.shape[1], pad_rows
        x = {"ids": ids, "pos": pos, "ctx": ctx, "tail": tail, "tokens": tree.tokens, "parents": tree.parents,
             "valid": tree.valid, "keys": s.keys, "temp": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
             "stops": torch.nn.functional.pad(stops, (0, pad_stops), value=-1) if pad_stops else stops}
        if self.paged is not None:
            x["blocks"] = blocks
        if e:
            own = torch.eye(q, dtype=torch.bool, device=ids.device).expand(e, q, q)
            fill = {"tail": own, "parents": -1, "top_p": 1.0, "stops": -1,
                    "blocks": self.paged[2] if self.paged is not None else 0}
            for name, t in x.items():
                f = fill.get(name, 0)
                x[name] = torch.cat([t, f if isinstance(f, torch.Tensor) else t.new_full((e, *t.shape[1:]), f)])
        return x

    def _splits(self, batch: int) -> int:
        slots = self.cache.max_len if self.paged is None else self.paged[0] * self.paged[1]  # a row's reach
        return default_splits(batch, self.cache.k.shape[2], slots, self.cache.k.device, self.attention,
                              head_dim=self.cache.k.shape[-1])

    def _step(self, x: dict[str, torch.Tensor], buffer: torch.Tensor | None, depth: int, masked: bool,
              sampled: bool) -> dict[str, torch.Tensor]:
        """The whole verify step on the device (what a graph captures)."""
        b, q = x["ids"].shape
        if self.paged is None:
            meta = AttnMeta.rows(x["ctx"], q, self.cache.max_len, tail=x["tail"], splits=self._splits(b),
                                 kernel=self.attention)
        else:
            meta = AttnMeta(x["blocks"], self.paged[0], torch.zeros_like(x["ctx"]), x["ctx"], q, x["tail"],
                            splits=self._splits(b), scratch=self.paged[2], kernel=self.attention)
        out = self.target(x["ids"], x["pos"], self.cache.backend(meta), capture=self.capture)
        feats = self.features(out)
        if feats is not None and buffer is not None:  # laid out like the KV cache: meta addresses both
            buffer[meta.physical(x["ctx"][:, None] + torch.arange(q, device=x["ids"].device))] = feats
        tree = DraftTree(x["tokens"], x["parents"], x["valid"])
        s = RowSampling(x["keys"], x["temp"], x["top_k"], x["top_p"], masked, sampled)
        return verify_on_device(out.logits, tree, s, x["pos"] + 1, x["stops"], depth)

    def _make_step(self, key: VerifyGraphKey):
        """Static input buffers for ``key`` and the function the pool captures. The warm-up and capture
        runs happen between two steps of live rows: they write each row's last ``Q`` slots (of the
        cache and the feature buffer), which never hold a committed token (a request's tokens end
        ``max_draft_tokens`` slots before them; tree nodes there are written by the step that reads them)."""
        dev, b, q, n = self.cache.k.device, key.batch, key.query_tokens, key.query_tokens - 1
        z = torch.zeros(b, dtype=torch.long, device=dev)
        inputs = {"ids": torch.zeros(b, q, dtype=torch.long, device=dev),
                  "pos": torch.zeros(b, q, dtype=torch.long, device=dev), "ctx": z + self.cache.max_len - q,
                  "tail": torch.eye(q, dtype=torch.bool, device=dev).repeat(b, 1, 1),
                  "tokens": torch.zeros(b, n, dtype=torch.long, device=dev),
                  "parents": torch.full((b, n), -1, dtype=torch.long, device=dev),
                  "valid": torch.zeros(b, n, dtype=torch.bool, device=dev),
                  "keys": z.clone(), "temp": torch.zeros(b, device=dev), "top_k": z.clone(),
                  "top_p": torch.ones(b, device=dev),
                  "stops": torch.full((b, key.stops), -1, dtype=torch.long, device=dev)}
        if self.paged is not None:  # a paged cache: the warm-up and capture runs write the scratch block
            inputs["blocks"] = torch.full((b, self.paged[1]), self.paged[2], dtype=torch.int32, device=dev)
            inputs["ctx"] = z.clone()
        buffer = self._buffer
        return inputs, lambda x: self._step(x, buffer, key.depth, key.masked, key.sampled)
