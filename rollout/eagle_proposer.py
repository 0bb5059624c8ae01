"""EAGLE / EAGLE-3 drafting inside the rollout engine: lazy catch-up and EAGLE-2 dynamic trees.

Owns the drafter's own static KV cache (one row per running request, in the engine's row order)
and how far each request's (token, target feature) pairs went through it: on the device
(``_seen``, ``_floor``: what the drafter indexes with) and on the host (``seen``, ``floor``: what
sizes its shapes), kept equal by applying one rule to both. Inside an engine the committed tokens
come from its device :class:`~tlt.rollout.row_state.RowState`, so a proposal uploads nothing. Pairs follow the
training convention: the feature that predicted token ``x`` is paired with ``x``; the pair at
position ``t`` is ``(x_{t+1}, f_t)``. Nothing is fed while speculation is off: on each proposal
the pairs committed since the last one are read from the engine's token lists and feature buffer
(:class:`~tlt.rollout.draft_tree.ProposerInput`) and run through the drafter in one batched pass --
at most the last ``catch_up_window`` pairs per request: older ones are skipped and masked out of
the drafter's attention (a shorter draft context, still lossless), so switching on after a long
stretch of plain decoding, or a tuner's exploration step, costs a bounded drafter pass.

A request the proposer has not seen (a new generation's, or one that joined a running generation,
possibly with hundreds of tokens made elsewhere) takes a free drafter row and catches up up to
``start_window`` pairs at its first proposal: by default all of them, the drafter's prefill of the
request. Measured (``tlt bench lifecycle``, the demo's target and warm-up drafter, CPU): the whole
request gave accept length 3.24 / 3.25 / 3.16 against 3.19 / 3.24 / 3.10 from its last 16 pairs,
for requests joining with 0 / 32 / 96 tokens so far, for about one plain step's time (5-8 ms) more
on that first proposal; so the whole request it is.

Proposal: from the last pair's output, expand the ``topk`` best tokens, then at each further level
expand the ``topk`` best candidates by cumulative draft log-prob; keep the ``tokens_to_verify``
best of all candidates (EAGLE-2). ``topk == 1`` is a plain chain.

Static shapes (on CUDA by default, or ``static_shapes=True``): when every row's backlog fits the
arm's window (``depth + 1`` pairs: what one speculative step commits), the whole proposal --
catch-up over that fixed window, every draft level with attention over the whole drafter cache,
top-k and tree selection -- runs at fixed shapes for the batch padded to a captured size, and on
CUDA replays one CUDA graph per :class:`~tlt.rollout.graphs.DraftLoopGraphKey` (padded batch, arm,
window, sampled), captured at its ``capture_after``-th use (its first uses run the loop eagerly). A longer backlog (after plain steps or another proposer's)
runs eagerly at dynamic shapes. A new drafter is a new proposer with graphs of its own, so no graph
ever replays an old drafter's weights; a re-laid-out feature buffer drops the graphs.

Shared noise (coupled sampling, :mod:`tlt.rollout.sampling`): for a sampled request the draft scores
at the position a candidate would occupy are ``log_softmax(log q_T + G)``, with ``G`` the target's
own Gumbel noise for that request and position, so the first path is the drafter's guess of the
target's *sample* and the other candidates are the next-best under the same noise. Still exact:
what is committed depends only on the target's logits and the noise. Greedy requests (T = 0) draft
by ``log q`` as before.
"""

from __future__ import annotations

import logging
import time

import torch

from tlt.drafter.eagle import Drafter
from tlt.rollout.draft_tree import DraftTree, Proposer, ProposerInput, right_pad
from tlt.rollout.graph_pool import CaptureGate
from tlt.rollout.graphs import DEFAULT_CAPTURE_BATCH_SIZES, CaptureSizes, DraftLoopGraphKey
from tlt.rollout.attention import KERNELS, AttnMeta, default_splits, physical
from tlt.rollout.kv_cache import StaticKVCache, compact_rows
from tlt.rollout.sampling import gumbel, token_hash
from tlt.rollout.step_upload import StepUpload
from tlt.rollout.strategy import Arm
from tlt.rollout.timing import Span

log = logging.getLogger(__name__)


def kv_position_bytes(kv_heads: int, head_dim: int, element_size: int) -> int:
    """Bytes an EAGLE drafter's keys and values take per position (its one decoder layer)."""
    return 2 * kv_heads * head_dim * element_size


class EagleProposer(Proposer):
    packs_upload = True  # its rows' moves travel with the step's grown tables (flushed before it reads them)

    def __init__(self, drafter: Drafter, *, max_batch: int, max_len: int, catch_up_window: int = 16,
                 start_window: int | None = None, shared_noise: bool = True, static_shapes: bool | None = None,
                 cuda_graphs: bool = True, attention: str = "auto", capture_after: int = 2) -> None:
        if catch_up_window < 1:
            raise ValueError(f"catch_up_window={catch_up_window} must be >= 1")
        if start_window is not None and start_window < 1:
            raise ValueError(f"start_window={start_window} must be None (the whole request) or >= 1")
        if attention not in KERNELS:
            raise ValueError(f"attention={attention!r}: use one of {KERNELS}")
        self.gate = CaptureGate(capture_after)  # a loop shape's first uses run eagerly
        cfg = drafter.config.layer
        self.attention = attention  # the attention kernel (tlt.rollout.attention)
        self.drafter = drafter.eval()
        self.device = drafter.embed_weight.device
        self.shared_noise = shared_noise
        # [Vd] hashed target ids of the draft vocabulary: the noise key's token word
        self._draft_hash = token_hash(drafter.draft_to_target(torch.arange(drafter.vocab_size, device=self.device)))
        self.feature_layers = drafter.feature_layers
        # the drafter's KV: one row per running request (max_len slots), or, in an engine with a paged
        # cache, laid out by the engine's block ids (its tables in the proposal's RowState), chosen at
        # the first proposal that brings tables (_use_layout)
        self.cache = StaticKVCache(1, max_batch, cfg.num_key_value_heads, max_len, cfg.head_dim,
                                   dtype=drafter.fc.weight.dtype, device=self.device)
        self.cache.release()  # allocated at the first proposal (a paged engine's pool is sized before it)
        self._paged = False
        self._blocks: torch.Tensor | None = None  # [B, C] int32: this proposal's rows' tables (paged)
        self._forgotten: set[int] = set()  # requests whose drafter KV went with their blocks (an eviction)
        self.generation: int | None = None
        self.rows: list[int] = []  # request id per drafter cache row
        self.seen: dict[int, int] = {}  # pairs up to this position went through the drafter cache
        self.floor: dict[int, int] = {}  # positions below were skipped (never visible to the drafter)
        # [3, rows] the same by row: seen, floor, and the window of the next catch-up (rows along
        # dim 1, as in the cache: one compaction)
        self._pos = torch.zeros(3, max_batch, dtype=torch.long, device=self.device)
        self._seen, self._floor, self._window = self._pos[0], self._pos[1], self._pos[2]  # views
        self.catch_up_window = catch_up_window
        # a request's first catch-up (the drafter's prefill of it): None = every pair it has
        self.start_window = start_window if start_window is not None else max_len
        self._starting: set[int] = set()  # requests whose first catch-up is next
        self.pairs_processed = 0  # total catch-up work, for tests and metrics
        self.catch_up_tokens = 16384  # pairs per catch-up forward, over the rows: a longer one runs in chunks
        self._catch_up = Span(self.device)  # the last proposal's catch-up (CUDA events on CUDA)
        self.static = static_shapes if static_shapes is not None else self.device.type == "cuda"
        sizes = tuple(c for c in DEFAULT_CAPTURE_BATCH_SIZES if c < max_batch) + (max_batch,)
        self.sizes = CaptureSizes(sizes)
        self.pool = None
        if self.static and cuda_graphs and self.device.type == "cuda":
            if cfg.rope_parameters.get("rope_type") == "dynamic":
                log.warning("dynamic-NTK RoPE reads the largest position on the host: no drafter CUDA graphs")
            else:
                from tlt.rollout.graph_pool import CudaGraphPool

                self.pool = CudaGraphPool(self._make_step, device=self.device)
        self._features: torch.Tensor | None = None  # the feature buffer the graphs read (their address)
        self._capture_inputs: dict[str, torch.Tensor] | None = None  # the step being captured
        self.static_proposals = 0  # proposals at static shapes (a test and the bench read it)
        self.replays = 0  # of those, replayed from a CUDA graph
        self.capture_s = 0.0  # seconds spent capturing graphs, summed

    @torch.no_grad()
    def propose(self, inp: ProposerInput) -> DraftTree:
        b, arm = len(inp.rows), inp.arm
        if arm.is_off or b == 0:
            return DraftTree.empty(b, self.device)
        if inp.features is None:
            raise ValueError("EagleProposer needs the target features (ProposerInput.features)")
        self._use_layout(inp)
        self.cache.restore()
        self._follow_rows(inp)
        if inp.upload is not None:
            inp.upload.flush()  # the rows' moves and the engine's grown tables, before the tables are read
        window = arm.depth + 1
        ends, lens_host = self._host_catch_up(inp)
        padded = self.sizes.padded_batch(b) if self.static and inp.state is not None else None
        # padding rows: free drafter rows (paged: the scratch block)
        rows_free = self._pos.shape[1] if self._paged else min(self.cache.k.shape[1], inp.features.shape[0])
        self._blocks = inp.state.blocks if self._paged else None
        if padded is not None and max(lens_host) <= window and padded <= rows_free:
            self._catch_up = Span(self.device)  # inside the loop: no separate catch-up cost
            return self._propose_static(inp, arm, window, padded)
        self._catch_up.start()
        root = self._catch_up_pairs(inp, ends, lens_host)  # [B, H] output of each request's last pair
        self._catch_up.stop()
        keys, temp, sampled = self._noise_rows(inp)
        base, base_max, k = self._seen[:b], max(self.seen[r] for r in self.rows), arm.topk
        tokens, parents, depth, valid = self._draft(root, base, self._floor[:b], keys, temp, sampled, arm,
                                                    lambda e: base_max + e + k)  # the largest slot + 1, on the host
        return DraftTree(tokens, parents, valid, depth)

    @property
    def kv_position_bytes(self) -> int:
        """The drafter's keys and values of one position (one layer), laid out in the engine's blocks."""
        c = self.cache.k
        return kv_position_bytes(c.shape[2], c.shape[4], c.element_size())

    def forget(self, rids) -> None:
        """Requests the engine evicted: their drafter KV went with their blocks, so each starts over
        (a first catch-up of up to ``start_window`` pairs) when it next appears."""
        self._forgotten.update(rids)

    def close(self) -> None:
        """Drop the captured draft graphs and free the drafter's KV (the proposer is being replaced, or
        its engine releases its memory between rollouts: the next proposal allocates the KV again)."""
        if self.pool is not None:
            self.pool.close()
        self._features = None  # (the engine's feature buffer, which the graphs read)
        if not self.cache.released:
            self.cache.release()
        self.generation = None  # its rows start over with the KV

    # ---------------------------------------------------------------- static shapes
    def _propose_static(self, inp: ProposerInput, arm: Arm, window: int, padded: int) -> DraftTree:
        b, st = len(inp.rows), inp.state
        sampled = bool(self.shared_noise and inp.sampling is not None and inp.sampling.sampled)
        extra = padded - b  # padding rows: free cache rows, one pair each at position 0
        x = {"lens": torch.cat([st.lens, st.lens.new_ones(extra)]),
             "tokens": torch.cat([st.tokens, st.tokens.new_zeros(extra, st.tokens.shape[1])]),
             "keys": torch.cat([st.sampling.keys, st.sampling.keys.new_zeros(extra)]),
             "temp": torch.cat([st.sampling.temperature, st.sampling.temperature.new_zeros(extra)])}
        if st.blocks is not None:  # padding rows read the scratch block (the buffer's last)
            x["blocks"] = torch.cat([st.blocks, st.blocks.new_full((extra, st.blocks.shape[1]), inp.features.shape[0] - 1)])
        self.static_proposals += 1
        if self.pool is None:
            out = self._loop(x, inp.features, arm, window, sampled)
        else:
            self.pool.follow("the feature buffer", inp.features)  # the graphs read it
            self._features = inp.features
            key = DraftLoopGraphKey(batch=padded, depth=arm.depth, topk=arm.topk,
                                    tokens_to_verify=arm.tokens_to_verify, window=window, sampled=sampled)
            captured = self.pool.has(key)
            if not captured and self.gate.due(key):
                # The pool's warm-up runs execute the loop: on this step's inputs (the catch-up
                # rewrites the same pairs, the levels write scratch slots), with the positions restored.
                t0 = time.perf_counter()
                self._capture_inputs, pos = x, self._pos.clone()
                self.pool.capture([key])
                self._pos.copy_(pos)
                self._capture_inputs = None
                self.capture_s += time.perf_counter() - t0
                captured = True
            if captured:
                out = self.pool.replay(key, **x)
                self.replays += 1
            else:  # a shape's first uses: not worth a capture yet
                out = self._loop(x, inp.features, arm, window, sampled)
        tokens, parents, depth, valid = (out[name][:b].clone() for name in ("tokens", "parents", "depth", "valid"))
        return DraftTree(tokens, parents, valid, depth)

    def _make_step(self, key: DraftLoopGraphKey):
        """What the pool captures for ``key`` (a method, so the pool holds this proposer weakly)."""
        return self.loop_graph_step(key, self._features)

    def loop_graph_step(self, key: DraftLoopGraphKey, features: torch.Tensor):
        """Static input buffers for ``key`` and the function a :class:`CudaGraphPool` captures:
        this step's inputs while the proposer captures; for a bench, zeros (padding rows only).
        features: [max_batch, S, F] the buffer the graph reads."""
        if self._capture_inputs is not None:
            inputs = {name: t.clone() for name, t in self._capture_inputs.items()}
        else:
            z = torch.zeros(key.batch, dtype=torch.long, device=self.device)
            inputs = {"lens": z + 1, "tokens": torch.zeros(key.batch, features.shape[1], dtype=torch.long,
                                                           device=self.device),
                      "keys": z.clone(), "temp": torch.zeros(key.batch, device=self.device)}
        arm = Arm(key.depth, key.topk, key.tokens_to_verify)
        return inputs, lambda x: self._loop(x, features, arm, key.window, key.sampled)

    def _loop(self, x: dict[str, torch.Tensor], feats: torch.Tensor, arm: Arm, window: int,
              sampled: bool) -> dict[str, torch.Tensor]:
        """One whole proposal at fixed shapes: x lens [C], tokens [C, T], keys [C], temp [C] (and a paged
        engine's tables, blocks [C, W]) by (padded) row; feats: the engine's features by (row, position),
        or by block. Returns the tree's tokens, parents and depths [C, n]."""
        self._blocks = x.get("blocks")  # (while a graph captures: its static input)
        c, span = x["lens"].shape[0], self._slots
        end = x["lens"] - 1  # [C] pairs available: positions < end
        root = self._catch_up_device(end, x["tokens"], feats, c, window, span)
        tokens, parents, depth, valid = self._draft(root, self._seen[:c], self._floor[:c], x["keys"], x["temp"],
                                                    sampled, arm, lambda e: span)
        return {"tokens": tokens, "parents": parents, "depth": depth, "valid": valid}

    # ---------------------------------------------------------------- drafting
    def _draft(self, root: torch.Tensor, base: torch.Tensor, floor: torch.Tensor, keys: torch.Tensor | None,
               temp: torch.Tensor | None, sampled: bool, arm: Arm, span_of) -> tuple[torch.Tensor, ...]:
        """EAGLE-2 levels from root [B, H] (the last pair's output; base [B] its position, floor [B]
        the lowest visible slot): tokens, parents, depths and validity [B, n] of the chosen tree,
        topologically ordered. span_of(e): the attention span of a level after e tree slots."""
        b, k, d = root.shape[0], arm.topk, self.drafter
        scores_at = self._scorer(keys, temp, sampled, base, arm.depth)
        logp = scores_at(d.logits(root)[:, None], 0)[:, 0]  # [B, Vd]
        score, idx = logp.topk(k, -1)  # level-1 candidates [B, k]
        tokens = [d.draft_to_target(idx)]
        scores = [score]
        parents = [torch.full((b, k), -1, dtype=torch.long, device=self.device)]
        feat_in = root[:, None].expand(b, k, -1)  # features paired with level-1 candidates
        anc = torch.zeros(b, k, 0, dtype=torch.bool, device=self.device)  # expanded-slot ancestry
        offset = k  # candidate index of the next level's first entry
        level_start = 0
        own = torch.eye(k, dtype=torch.bool, device=self.device).expand(b, k, k)
        at_k = torch.arange(k, device=self.device)
        for level in range(1, arm.depth):
            # Expand the best k candidates of this level (all of them at level 1).
            lvl_scores = scores[-1]
            top = lvl_scores.topk(k, -1).indices if lvl_scores.shape[1] > k else at_k.expand(b, k)
            exp_tok = tokens[-1].gather(1, top)
            exp_feat = feat_in.gather(1, top[..., None].expand(-1, -1, feat_in.shape[-1]))
            exp_anc = anc.gather(1, top[..., None].expand(-1, -1, anc.shape[-1]))  # [B, k, E]
            e = anc.shape[-1]
            exp_anc = torch.cat([exp_anc, own], -1)  # [B, k, E + k]
            # the prefix [floor, base) unmasked; the expanded candidates' slots base .. base + e + k under
            # their ancestry; this level's k candidates are written at the last k of them
            meta = self._meta(base, e + k, floor, exp_anc, span_of(e), self._splits(b))
            pos = (base[:, None] + level - 1).expand(b, k)
            out = d(exp_tok, exp_feat, pos, self.cache.backend(meta))
            lp = scores_at(d.logits(out), level)  # [B, k, Vd]
            child_score, child_idx = lp.topk(k, -1)  # [B, k, k]
            child_score = child_score + lvl_scores.gather(1, top)[..., None]
            exp_cand = level_start + top  # candidate index of each expanded parent
            scores.append(child_score.flatten(1))
            tokens.append(d.draft_to_target(child_idx).flatten(1))
            parents.append(exp_cand[..., None].expand(b, k, k).flatten(1))
            feat_in = out[:, :, None].expand(b, k, k, out.shape[-1]).flatten(1, 2)
            anc = exp_anc[:, :, None].expand(b, k, k, e + k).flatten(1, 2)
            level_start, offset = offset, offset + k * k
        all_scores = torch.cat(scores, 1)  # [B, C]
        levels = torch.cat([torch.full_like(s, i, dtype=torch.long) for i, s in enumerate(scores)], 1)  # [B, C]
        n = min(arm.tokens_to_verify, all_scores.shape[1])
        # Scores never increase along a path; the level penalty, exact in float64 whatever the
        # scores' size, ranks every ancestor strictly above its descendants: the chosen set holds
        # each chosen node's parent.
        key = all_scores.double() - 1e-6 * levels
        chosen = key.topk(n, -1).indices.sort(-1).values  # [B, n] topological
        all_tokens, all_parents = torch.cat(tokens, 1), torch.cat(parents, 1)
        remap = torch.full_like(all_scores, -1, dtype=torch.long)
        remap.scatter_(1, chosen, torch.arange(n, device=self.device).expand(b, n))
        par = all_parents.gather(1, chosen)
        par = torch.where(par >= 0, remap.gather(1, par.clamp(min=0)), par)
        depth = levels.gather(1, chosen)
        # a guard: a node below level 0 without its parent would sit at the wrong position
        return all_tokens.gather(1, chosen), par, depth, (par >= 0) | (depth == 0)

    def _noise_rows(self, inp: ProposerInput) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
        """Each row's sampling key and temperature [B], and whether any row samples with shared noise."""
        s = inp.sampling if self.shared_noise else None
        if s is None or not s.sampled:
            return None, None, False
        return s.keys, s.temperature, True  # per running row

    def _scorer(self, keys: torch.Tensor | None, temp: torch.Tensor | None, sampled: bool, base: torch.Tensor,
                depth: int):
        """scores(logits [B, N, Vd], level) -> [B, N, Vd] draft scores of candidates for position
        ``base + 1 + level`` (base: [B] position of each row's last committed token; level <
        ``depth``): log q, or log_softmax(log q_T + G) with the target's noise on sampled rows."""
        if not sampled:
            return lambda logits, level: logits.float().log_softmax(-1)
        on = (temp > 0)[:, None, None]
        t = torch.where(temp > 0, temp, torch.ones_like(temp))[:, None, None]
        # The noise depends on (key, position, token) only: every level's in one call.
        pos = base[:, None] + 1 + torch.arange(depth, device=self.device)  # [B, depth]
        noise = gumbel(keys, pos, self._draft_hash)  # [B, depth, Vd]

        def scores(logits: torch.Tensor, level: int) -> torch.Tensor:
            lp = (logits.float() / t).log_softmax(-1)
            noisy = (lp + noise[:, level, None]).log_softmax(-1)  # one position for the level's N candidates
            return torch.where(on, noisy, lp)
        return scores

    # ---------------------------------------------------------------- rows and catch-up
    def _follow_rows(self, inp: ProposerInput) -> None:
        """Bring the drafter cache rows into the engine's order: a new generation starts empty;
        rows of requests that left are dropped and rows for joining requests taken from the free
        ones, by one compaction; a joining request starts with nothing seen (its first catch-up is
        the drafter's prefill of it, up to ``start_window`` pairs)."""
        if inp.generation != self.generation:
            self.generation, self.rows, self.seen, self.floor = inp.generation, [], {}, {}
            self._starting.clear()
        if list(inp.rows) == self.rows and not self._forgotten:
            return
        where = {r: i for i, r in enumerate(self.rows) if r not in self._forgotten}  # (forgotten: start over)
        self._forgotten.clear()
        taken = {where[r] for r in inp.rows if r in where}
        free = iter(i for i in range(self._pos.shape[1]) if i not in taken)
        keep = [where[r] if r in where else next(free) for r in inp.rows]
        new = [i for i, r in enumerate(inp.rows) if r not in where]
        # requests leaving and joining: the rows' indices in the step's one upload (with the engine's
        # grown tables), flushed in propose(); (paged: a row's KV stays in its blocks, only the
        # positions follow the rows)
        up = inp.upload if inp.upload is not None else StepUpload(self.device)
        compact_rows((self._pos,) if self._paged else (self.cache.k, self.cache.v, self._pos), keep, dim=1, upload=up)
        if new:
            up.add(new, (len(new),), self._start_rows)
        if inp.upload is None:
            up.flush()
        self.rows = list(inp.rows)
        fresh = {self.rows[i] for i in new}  # nothing seen: joined, or forgotten
        self.seen = {r: 0 if r in fresh else self.seen.get(r, 0) for r in self.rows}
        self.floor = {r: 0 if r in fresh else self.floor.get(r, 0) for r in self.rows}
        self._starting.update(self.rows[i] for i in new)

    def _start_rows(self, at: torch.Tensor) -> None:
        """Rows ``at`` [N] hold requests the drafter has not seen: nothing seen, the first window.
        (index_fill_, not an indexed assignment of a Python number: that copies the number to the
        device and waits for it.)"""
        self._pos[:2].index_fill_(1, at, 0)
        self._pos[2].index_fill_(0, at, self.start_window)

    @property
    def catch_up_s(self) -> float:
        """Seconds the last proposal spent catching up (on CUDA: read after the step's sync)."""
        return self._catch_up.seconds()

    def _host_catch_up(self, inp: ProposerInput) -> tuple[list[int], list[int]]:
        """The catch-up rule on the host copies (what sizes the shapes): a backlog beyond the window
        is skipped, not computed. Returns each row's end (pairs at positions < end exist) and the
        pairs it runs now; marks them seen."""
        ends = [len(inp.tokens[r]) - 1 for r in self.rows]
        for r, e in zip(self.rows, ends):
            w = self.start_window if r in self._starting else self.catch_up_window
            if e - self.seen[r] > w:
                self.seen[r] = self.floor[r] = e - w
        self._starting.clear()
        lens_host = [e - self.seen[r] for r, e in zip(self.rows, ends)]
        assert min(lens_host) > 0, "every running request committed a token since its last proposal"
        for r, e in zip(self.rows, ends):
            self.seen[r] = e
        self.pairs_processed += sum(lens_host)
        return ends, lens_host

    def _catch_up_pairs(self, inp: ProposerInput, ends: list[int], lens_host: list[int]) -> torch.Tensor:
        """Run every pair not yet seen through the drafter at dynamic shapes; returns the last
        pair's output [B, H]."""
        b = len(self.rows)
        if inp.state is not None:  # tokens from the engine's device state
            return self._catch_up_device(inp.state.lens - 1, inp.state.tokens, inp.features, b, max(lens_host),
                                         max(ends))
        # outside an engine: upload the pairs and the positions
        seen = [e - n for e, n in zip(ends, lens_host)]
        self._seen[:b] = torch.tensor(seen, device=self.device)
        self._floor[:b] = torch.tensor([self.floor[r] for r in self.rows], device=self.device)
        ids = right_pad([inp.tokens[r][s + 1: e + 1] for r, s, e in zip(self.rows, seen, ends)],
                        device=self.device)  # [B, m]
        return self._run_pairs(ids, torch.tensor(lens_host, device=self.device), inp.features, b, max(ends))

    def _catch_up_device(self, end: torch.Tensor, tok: torch.Tensor, feats: torch.Tensor, c: int, m: int,
                         span: int) -> torch.Tensor:
        """The catch-up rule on the device copies and the pairs' tokens gathered on the device.
        end: [C] pairs at positions < end exist; tok: [C, T] committed tokens by position; m: the
        longest backlog after the skip (pairs per row); span: attention span (>= the largest end)."""
        w = self._window[:c]
        skip = end - self._seen[:c] > w
        self._seen[:c] = torch.where(skip, end - w, self._seen[:c])
        self._floor[:c] = torch.where(skip, end - w, self._floor[:c])
        self._window[:c] = self.catch_up_window  # a joining request's first catch-up is done
        lens = end - self._seen[:c]  # [C]
        at = torch.arange(m, device=self.device)
        ids = tok.gather(1, (self._seen[:c, None] + 1 + at).clamp(0, tok.shape[1] - 1))  # [C, m]
        ids = torch.where(at < lens[:, None], ids, 0)
        return self._run_pairs(ids, lens, feats, c, span)

    def _run_pairs(self, ids: torch.Tensor, lens: torch.Tensor, feats: torch.Tensor, c: int, span: int) -> torch.Tensor:
        """ids: [C, m] pairs' tokens from each row's seen position (lens [C] of them); feats:
        [max_batch, S, F]. Runs them through the drafter cache; returns the last pair's output [C, H]."""
        m = ids.shape[1]
        base = self._seen[:c].clone()
        rows = torch.arange(c, device=self.device)
        last = None  # [C, H] the output of each row's last pair
        chunk = max(16, self.catch_up_tokens // c)
        for c0 in range(0, m, chunk):  # chunks: a long first catch-up in bounded memory
            part = ids[:, c0: c0 + chunk]  # [C, mc]
            mc = part.shape[1]
            pos = base[:, None] + c0 + torch.arange(mc, device=self.device)  # [C, mc]
            if self._blocks is None:  # the engine's features by (row, position)
                x = feats[rows[:, None], pos.clamp(0, feats.shape[1] - 1)]
            else:  # by the rows' block tables (feats [blocks, block_size, F], the last block scratch)
                x = feats[physical(self._blocks[:c], feats.shape[1], pos, feats.shape[0] - 1)]
            # the floor .. the chunk unmasked (skipped pairs stay invisible), the chunk causally
            meta = self._meta(base + c0, mc, self._floor[:c], None, span,
                              self._splits(c) if mc <= 64 else 1)  # (many queries fill the device)
            out = self.drafter(part, x.to(self.drafter.fc.weight.dtype), pos, self.cache.backend(meta))
            here = (lens - 1 - c0).clamp(0, mc - 1)
            inside = ((lens - 1 >= c0) & (lens - 1 < c0 + mc))[:, None]
            last = out[rows, here] if last is None else torch.where(inside, out[rows, here], last)
        self._seen[:c] = base + lens
        return last

    def _splits(self, b: int) -> int:
        return default_splits(b, self.cache.k.shape[2], self._slots, self.device, self.attention,
                              head_dim=self.cache.k.shape[-1])

    @property
    def _slots(self) -> int:
        """Positions a row's attention may span: a row's slots, or its table's."""
        return self._blocks.shape[1] * self.cache.max_len if self._blocks is not None else self.cache.max_len

    def _meta(self, ctx: torch.Tensor, width: int, start: torch.Tensor, tail: torch.Tensor | None, span: int,
              splits: int) -> AttnMeta:
        """The drafter cache's attention layout for rows [0, B): by row, or by the engine's tables."""
        if self._blocks is None:
            return AttnMeta.rows(ctx, width, self.cache.max_len, start=start, tail=tail, span=span, splits=splits,
                                 kernel=self.attention)
        return AttnMeta(self._blocks[: ctx.shape[0]], self.cache.max_len, start, ctx, width, tail, span, splits,
                        scratch=self.cache.k.shape[1] - 1, kernel=self.attention)

    def _use_layout(self, inp: ProposerInput) -> None:
        """At the first proposal of an engine with a paged cache: the drafter's KV moves to the engine's
        block layout ([blocks, block_size], the features buffer's), its graphs and rows start over."""
        if self._paged:
            if inp.state is None or inp.state.blocks is None:
                raise ValueError("this EagleProposer drafts for an engine with a paged cache (its KV is laid out "
                                 "by that engine's blocks): give another engine a proposer of its own")
            return
        if inp.state is None or inp.state.blocks is None:
            return
        n, bs = inp.features.shape[:2]
        c = self.cache
        self.cache = StaticKVCache(1, n, c.k.shape[2], bs, c.k.shape[4], dtype=c.k.dtype, device=self.device)
        self._paged, self.generation = True, None
        if self.pool is not None:
            self.pool.close()
