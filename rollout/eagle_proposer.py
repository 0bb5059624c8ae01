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

Proposal: from the last pair's output, expand the ``topk`` best tokens, then at each further level
expand the ``topk`` best candidates by cumulative draft log-prob; keep the ``tokens_to_verify``
best of all candidates (EAGLE-2). ``topk == 1`` is a plain chain.

Shared noise (coupled sampling, :mod:`tlt.rollout.sampling`): for a sampled request the draft scores
at the position a candidate would occupy are ``log_softmax(log q_T + G)``, with ``G`` the target's
own Gumbel noise for that request and position, so the first path is the drafter's guess of the
target's *sample* and the other candidates are the next-best under the same noise. Still exact:
what is committed depends only on the target's logits and the noise. Greedy requests (T = 0) draft
by ``log q`` as before.
"""

from __future__ import annotations

import torch

from tlt.drafter.eagle import Drafter
from tlt.rollout.draft_tree import DraftTree, ProposerInput, right_pad
from tlt.rollout.kv_cache import CachedBackend, StaticKVCache, compact_rows, prefill_mask, to_additive
from tlt.rollout.sampling import gumbel, token_hash
from tlt.rollout.timing import Span
from tlt.rollout.transfers import intended_sync


class EagleProposer:
    def __init__(self, drafter: Drafter, *, max_batch: int, max_len: int, catch_up_window: int = 16,
                 shared_noise: bool = True) -> None:
        if catch_up_window < 1:
            raise ValueError(f"catch_up_window={catch_up_window} must be >= 1")
        cfg = drafter.config.layer
        self.drafter = drafter.eval()
        self.device = drafter.embed_weight.device
        self.shared_noise = shared_noise
        # [Vd] hashed target ids of the draft vocabulary: the noise key's token word
        self._draft_hash = token_hash(drafter.draft_to_target(torch.arange(drafter.vocab_size, device=self.device)))
        self.feature_layers = drafter.feature_layers
        self.cache = StaticKVCache(1, max_batch, cfg.num_key_value_heads, max_len, cfg.head_dim,
                                   dtype=drafter.fc.weight.dtype, device=self.device)
        self.generation: int | None = None
        self.rows: list[int] = []  # request id per drafter cache row
        self.seen: dict[int, int] = {}  # pairs up to this position went through the drafter cache
        self.floor: dict[int, int] = {}  # positions below were skipped (never visible to the drafter)
        # [2, rows] the same by row: seen, floor (rows along dim 1, as in the cache: one compaction)
        self._pos = torch.zeros(2, max_batch, dtype=torch.long, device=self.device)
        self._seen, self._floor = self._pos[0], self._pos[1]  # views
        self.catch_up_window = catch_up_window
        self.pairs_processed = 0  # total catch-up work, for tests and metrics
        self._catch_up = Span(self.device)  # the last proposal's catch-up (CUDA events on CUDA)

    @torch.no_grad()
    def propose(self, inp: ProposerInput) -> DraftTree:
        b, arm = len(inp.rows), inp.arm
        if arm.is_off or b == 0:
            return DraftTree.empty(b, self.device)
        if inp.features is None:
            raise ValueError("EagleProposer needs the target features (ProposerInput.features)")
        self._follow_rows(inp)
        self._catch_up.start()
        root = self._catch_up_pairs(inp)  # [B, H] output of each request's last pair
        self._catch_up.stop()
        base, base_max = self._seen[:b], max(self.seen[r] for r in self.rows)  # [B]: the last pair's position
        above = self._above_floor(self._floor[:b], base_max + arm.depth * arm.topk)  # [B, largest span]
        k = arm.topk
        d = self.drafter
        scores_at = self._scorer(inp, base, arm.depth)
        logp = scores_at(d.logits(root)[:, None], 0)[:, 0]  # [B, Vd]
        score, idx = logp.topk(k, -1)  # level-1 candidates [B, k]
        tokens = [d.draft_to_target(idx)]
        scores = [score]
        parents = [torch.full((b, k), -1, dtype=torch.long, device=self.device)]
        feat_in = root[:, None].expand(b, k, -1)  # features paired with level-1 candidates
        anc = torch.zeros(b, k, 0, dtype=torch.bool, device=self.device)  # expanded-slot ancestry
        offset = k  # candidate index of the next level's first entry
        level_start = 0
        for level in range(1, arm.depth):
            # Expand the best k candidates of this level (all of them at level 1).
            lvl_scores = scores[-1]
            top = lvl_scores.topk(k, -1).indices if lvl_scores.shape[1] > k else \
                torch.arange(k, device=self.device).expand(b, k)
            exp_tok = tokens[-1].gather(1, top)
            exp_feat = feat_in.gather(1, top[..., None].expand(-1, -1, feat_in.shape[-1]))
            exp_anc = anc.gather(1, top[..., None].expand(-1, -1, anc.shape[-1]))  # [B, k, E]
            e = anc.shape[-1]
            own = torch.eye(k, dtype=torch.bool, device=self.device).expand(b, k, k)
            exp_anc = torch.cat([exp_anc, own], -1)  # [B, k, E + k]
            slots = base[:, None] + e + torch.arange(k, device=self.device)
            span = base_max + e + k  # the largest slot + 1, known on the host
            vis = (torch.arange(span, device=self.device)[None, None] < base[:, None, None]) & above[:, None, :span]
            tree_vis = torch.zeros(b, k, span, dtype=torch.bool, device=self.device)
            tree_vis.scatter_(2, (base[:, None, None] + torch.arange(e + k, device=self.device)).expand(b, k, -1),
                              exp_anc)
            pos = base[:, None] + level - 1 + torch.zeros(b, k, dtype=torch.long, device=self.device)
            out = d(exp_tok, exp_feat, pos, CachedBackend(self.cache, slots, to_additive(vis | tree_vis)))
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
        levels = torch.cat([torch.full_like(s, i) for i, s in enumerate(scores)], 1)
        n = min(arm.tokens_to_verify, all_scores.shape[1])
        # Scores never increase along a path; the tiny level penalty keeps ancestors first on ties.
        chosen = (all_scores - 1e-6 * levels).topk(n, -1).indices.sort(-1).values  # [B, n] topological
        all_tokens, all_parents = torch.cat(tokens, 1), torch.cat(parents, 1)
        remap = torch.full_like(all_scores, -1, dtype=torch.long)
        remap.scatter_(1, chosen, torch.arange(n, device=self.device).expand(b, n))
        par = all_parents.gather(1, chosen)
        par = torch.where(par >= 0, remap.gather(1, par.clamp(min=0)), par)
        return DraftTree(all_tokens.gather(1, chosen), par, torch.ones(b, n, dtype=torch.bool, device=self.device))

    # ---------------------------------------------------------------- internals
    def _scorer(self, inp: ProposerInput, base: torch.Tensor, depth: int):
        """scores(logits [B, N, Vd], level) -> [B, N, Vd] draft scores of candidates for position
        ``base + 1 + level`` (base: [B] position of each row's last committed token; level <
        ``depth``): log q, or log_softmax(log q_T + G) with the target's noise on sampled rows."""
        s = inp.sampling if self.shared_noise else None
        if s is None or not s.sampled:
            return lambda logits, level: logits.float().log_softmax(-1)
        if inp.state is not None:  # the engine's rows, in this order
            keys, temp = inp.state.sampling.keys, inp.state.sampling.temperature  # [B]
        else:
            rows = torch.tensor(self.rows, device=self.device)
            keys, temp = s.keys[rows], s.temperature[rows]
        sampled = (temp > 0)[:, None, None]
        t = torch.where(temp > 0, temp, torch.ones_like(temp))[:, None, None]
        # The noise depends on (key, position, token) only: every level's in one call.
        pos = base[:, None] + 1 + torch.arange(depth, device=self.device)  # [B, depth]
        noise = gumbel(keys, pos, self._draft_hash)  # [B, depth, Vd]

        def scores(logits: torch.Tensor, level: int) -> torch.Tensor:
            lp = (logits.float() / t).log_softmax(-1)
            noisy = (lp + noise[:, level, None]).log_softmax(-1)  # one position for the level's N candidates
            return torch.where(sampled, noisy, lp)
        return scores

    def _follow_rows(self, inp: ProposerInput) -> None:
        """Bring the drafter cache rows into the engine's order: a new generation starts empty;
        otherwise rows of finished requests are dropped by one compaction."""
        if inp.generation != self.generation:
            self.generation, self.rows = inp.generation, list(inp.rows)
            self.seen, self.floor = dict.fromkeys(inp.rows, 0), dict.fromkeys(inp.rows, 0)
            self._pos.zero_()
            return
        if list(inp.rows) == self.rows:
            return
        where = {r: i for i, r in enumerate(self.rows)}
        keep = [where[r] for r in inp.rows]  # KeyError = a request that was never started
        with intended_sync(self.device):  # leaving requests
            compact_rows((self.cache.k, self.cache.v, self._pos), keep, dim=1)  # one index upload
        self.rows = list(inp.rows)
        self.seen = {r: self.seen[r] for r in self.rows}
        self.floor = {r: self.floor[r] for r in self.rows}

    @property
    def catch_up_s(self) -> float:
        """Seconds the last proposal spent catching up (on CUDA: read after the step's sync)."""
        return self._catch_up.seconds()

    def _catch_up_pairs(self, inp: ProposerInput) -> torch.Tensor:
        """Run every pair not yet seen through the drafter; returns the last pair's output [B, H]."""
        b, w = len(self.rows), self.catch_up_window
        ends = [len(inp.tokens[r]) - 1 for r in self.rows]  # pairs available: positions < end
        for r, e in zip(self.rows, ends):  # a backlog beyond the window is skipped, not computed
            if e - self.seen[r] > w:
                self.seen[r] = self.floor[r] = e - w
        seen = [self.seen[r] for r in self.rows]
        lens_host = [e - s for s, e in zip(seen, ends)]
        assert min(lens_host) > 0, "every running request committed a token since its last proposal"
        m = max(lens_host)
        at = torch.arange(m, device=self.device)
        if inp.state is not None:  # the same rule on the device copies; tokens from the engine's state
            end = inp.state.lens - 1  # [B]
            skip = end - self._seen[:b] > w
            self._seen[:b] = torch.where(skip, end - w, self._seen[:b])
            self._floor[:b] = torch.where(skip, end - w, self._floor[:b])
            base = self._seen[:b]
            lens = end - base
            tok = inp.state.tokens
            ids = tok.gather(1, (base[:, None] + 1 + at).clamp(max=tok.shape[1] - 1))  # [B, m]
            ids = torch.where(at < lens[:, None], ids, 0)
        else:
            ids = right_pad([inp.tokens[r][s + 1: e + 1] for r, s, e in zip(self.rows, seen, ends)],
                            device=self.device)  # [B, m]
            lens = torch.tensor(lens_host, device=self.device)
            self._seen[:b] = torch.tensor(seen, device=self.device)
            self._floor[:b] = torch.tensor([self.floor[r] for r in self.rows], device=self.device)
            base = self._seen[:b]
        pos = base[:, None] + at  # [B, m]
        feats = inp.features  # [max_batch, S, F]
        x = feats[torch.arange(b, device=self.device)[:, None], pos.clamp(max=feats.shape[1] - 1)]
        span = max(ends)  # the largest position + 1
        visible = prefill_mask(lens, span, start=base, t=m) & self._above_floor(self._floor[:b], span)[:, None]
        out = self.drafter(ids, x.to(self.drafter.fc.weight.dtype), pos, CachedBackend(self.cache, pos, to_additive(visible)))
        self._seen[:b] = base + lens
        for r, e in zip(self.rows, ends):
            self.seen[r] = e
        self.pairs_processed += sum(lens_host)
        return out[torch.arange(b, device=self.device), lens - 1]

    def _above_floor(self, floor: torch.Tensor, span: int) -> torch.Tensor:
        """[B, span] bool: slots at or above each row's floor (skipped pairs stay invisible).
        floor: [B] long."""
        return torch.arange(span, device=self.device)[None] >= floor[:, None]
