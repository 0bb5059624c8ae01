"""EAGLE / EAGLE-3 drafting inside the rollout engine: catch-up and EAGLE-2 dynamic trees.

Owns the drafter's own static KV cache (one row per running request, in the engine's row order)
and the per-request queue of (token, target feature) pairs the drafter has not seen yet. Pairs
follow the training convention: the feature that predicted token ``x`` is paired with ``x``; the
pair at position ``t`` is ``(x_{t+1}, f_t)``. Pairs are queued even while speculation is off and
are processed lazily, once, right before the next proposal (the elastic switch only costs the
drafter what it missed). Proposal: from the last pair's output, expand the ``topk`` best tokens,
then at each further level expand the ``topk`` best candidates by cumulative draft log-prob; keep
the ``tokens_to_verify`` best of all candidates (EAGLE-2). ``topk == 1`` is a plain chain.
"""

from __future__ import annotations

from typing import Sequence

import torch

from drafter.eagle import Drafter
from rollout.draft_tree import DraftTree
from rollout.kv_cache import CachedBackend, StaticKVCache, prefill_mask, swap_remove, to_additive
from rollout.strategy import Arm


class EagleProposer:
    def __init__(self, drafter: Drafter, *, max_batch: int, max_len: int) -> None:
        cfg = drafter.config.layer
        self.drafter = drafter.eval()
        self.device = drafter.embed_weight.device
        self.feature_layers = drafter.config.aux_layers if drafter.config.method == "eagle3" else ()
        self.cache = StaticKVCache(1, max_batch, cfg.num_key_value_heads, max_len, cfg.head_dim,
                                   dtype=drafter.fc.weight.dtype, device=self.device)
        self.rows: list[int] = []
        self.seen: dict[int, int] = {}  # pairs in the drafter cache per request
        self.queue_tokens: dict[int, list[int]] = {}
        self.queue_feats: dict[int, list[torch.Tensor]] = {}
        self.pairs_processed = 0  # total catch-up work, for tests and metrics

    # ---------------------------------------------------------------- Proposer protocol
    def start(self, rids: Sequence[int], groups: Sequence[int], prompts: Sequence[Sequence[int]],
              features: Sequence[torch.Tensor] | None = None) -> None:
        if features is None:
            raise ValueError("EagleProposer needs target features (engine passes them)")
        for rid, prompt, feat in zip(rids, prompts, features):
            self.rows.append(rid)
            self.seen[rid] = 0
            self.queue_tokens[rid] = list(prompt[1:])
            self.queue_feats[rid] = [feat]

    def accept(self, rids: Sequence[int], tokens: Sequence[Sequence[int]],
               features: Sequence[torch.Tensor] | None = None) -> None:
        assert features is not None, "EAGLE pairs need the target features of committed tokens"
        for rid, toks, feat in zip(rids, tokens, features):
            self.queue_tokens[rid] += list(toks)
            self.queue_feats[rid].append(feat[: len(toks)])

    def finish(self, rids: Sequence[int]) -> None:
        gone = set(rids)
        keep = swap_remove(len(self.rows), {k for k, r in enumerate(self.rows) if r in gone})
        self.cache.compact_rows(keep)  # the engine's row order (rollout.kv_cache.swap_remove)
        self.rows = [self.rows[k] for k in keep]
        for r in gone:
            for d in (self.seen, self.queue_tokens, self.queue_feats):
                d.pop(r, None)

    @torch.no_grad()
    def propose(self, rids: Sequence[int], arm: Arm) -> DraftTree:
        if list(rids) != self.rows:
            raise ValueError("propose() rows differ from the started/finished order")
        b = len(self.rows)
        if arm.is_off or b == 0:
            return DraftTree.empty(b, self.device)
        root = self._catch_up()  # [B, H] output of each request's last pair
        base_host = [self.seen[r] for r in self.rows]
        base, base_max = torch.tensor(base_host, device=self.device), max(base_host)  # [B]
        k = arm.topk
        d = self.drafter
        logp = d.logits(root).float().log_softmax(-1)  # [B, Vd]
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
            own = torch.zeros(b, k, k, dtype=torch.bool, device=self.device)
            own[:, torch.arange(k), torch.arange(k)] = True
            exp_anc = torch.cat([exp_anc, own], -1)  # [B, k, E + k]
            slots = base[:, None] + e + torch.arange(k, device=self.device)
            span = base_max + e + k  # the largest slot + 1, known on the host
            vis = torch.arange(span, device=self.device)[None, None] < base[:, None, None]
            tree_vis = torch.zeros(b, k, span, dtype=torch.bool, device=self.device)
            tree_vis.scatter_(2, (base[:, None, None] + torch.arange(e + k, device=self.device)).expand(b, k, -1),
                              exp_anc)
            pos = base[:, None] + level - 1 + torch.zeros(b, k, dtype=torch.long, device=self.device)
            out = d(exp_tok, exp_feat, pos, CachedBackend(self.cache, slots, to_additive(vis | tree_vis)))
            lp = d.logits(out).float().log_softmax(-1)  # [B, k, Vd]
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
    def _catch_up(self) -> torch.Tensor:
        """Run every queued pair through the drafter; returns the last pair's output [B, H]."""
        b = len(self.rows)
        lens_host = [len(self.queue_tokens[r]) for r in self.rows]
        assert min(lens_host) > 0, "every running request has at least its last committed token"
        seen = [self.seen[r] for r in self.rows]
        lens = torch.tensor(lens_host, device=self.device)
        base = torch.tensor(seen, device=self.device)
        m = max(lens_host)
        feats = [torch.cat(self.queue_feats[r]) for r in self.rows]
        ids = torch.zeros(b, m, dtype=torch.long, device=self.device)
        x = torch.zeros(b, m, feats[0].shape[-1], dtype=self.drafter.fc.weight.dtype, device=self.device)
        for i, r in enumerate(self.rows):
            n = len(self.queue_tokens[r])
            ids[i, :n] = torch.tensor(self.queue_tokens[r], device=self.device)
            x[i, :n] = feats[i][:n]
        pos = base[:, None] + torch.arange(m, device=self.device)
        span = max(s + n for s, n in zip(seen, lens_host))  # the largest position + 1
        mask = to_additive(prefill_mask(lens, span, start=base, t=m))
        out = self.drafter(ids, x, pos, CachedBackend(self.cache, pos, mask))
        for r, n in zip(self.rows, lens_host):
            self.seen[r] += n
            self.queue_tokens[r], self.queue_feats[r] = [], []
        self.pairs_processed += sum(lens_host)
        return out[torch.arange(b, device=self.device), lens - 1]
