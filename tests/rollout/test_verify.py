"""The verifier's device walk: its rules (first node wins on duplicate tokens, a stop token ends the
walk, the depth bound) on hand-built trees, and the pointer-jumping tree depths and ancestor masks
against a per-node reference."""

from __future__ import annotations

import random

import pytest
import torch

from tlt.rollout.draft_tree import DraftTree, tree_depths
from tlt.rollout.generate import SamplingParams
from tlt.rollout.attention import AttnMeta
from tlt.rollout.kv_cache import tree_ancestors
from tlt.rollout.sampling import RowSampling
from tlt.rollout.verify import verify

V = 16


def _logits(draws: list[int]) -> torch.Tensor:
    """[1, len(draws), V] logits whose greedy draw at row j is draws[j]."""
    x = torch.zeros(1, len(draws), V)
    x[0, torch.arange(len(draws)), torch.tensor(draws)] = 5.0
    return x


def _verify(tree_tokens, tree_parents, draws, stops=(), depth=None):
    tree = DraftTree(torch.tensor([tree_tokens]), torch.tensor([tree_parents]), torch.ones(1, len(tree_tokens), dtype=torch.bool))
    s = RowSampling.build([SamplingParams()], [0])
    pos = torch.arange(1, len(draws) + 1)[None]
    return verify(_logits(draws), tree, s, pos, [tuple(stops)], depth=depth)


def test_the_walk_takes_the_first_of_duplicate_children():
    # root -> {node 0: 5, node 1: 5 (duplicate), node 2: 7 under node 0, node 3: 9 under node 1}
    # draws: root 5, node 0 -> 7, node 1 -> 9, node 2 -> 3, node 3 -> 4
    res = _verify([5, 5, 7, 9], [-1, -1, 0, 1], [5, 7, 9, 3, 4])
    assert res.nodes == [[0, 2]] and res.tokens == [[5, 7, 3]]
    assert res.path.tolist() == [[0, 2, -1, -1]] and res.count.tolist() == [3]
    assert res.drafted == 4


def test_a_stop_token_ends_the_walk_after_committing_it():
    res = _verify([5, 7, 8], [-1, 0, 1], [5, 7, 8, 2], stops=(7,))
    assert res.tokens == [[5, 7]] and res.nodes == [[0]]
    res = _verify([5, 7, 8], [-1, 0, 1], [5, 7, 8, 2], stops=(5,))
    assert res.tokens == [[5]] and res.nodes == [[]]


def test_the_depth_bound_only_commits_fewer_tokens():
    full = _verify([5, 7, 8], [-1, 0, 1], [5, 7, 8, 2])
    cut = _verify([5, 7, 8], [-1, 0, 1], [5, 7, 8, 2], depth=1)
    assert full.tokens == [[5, 7, 8, 2]] and cut.tokens == [[5, 7]]  # a prefix of the same draws


def test_a_rejected_root_commits_the_bonus_only():
    res = _verify([6, 7], [-1, 0], [5, 7, 8])
    assert res.tokens == [[5]] and res.nodes == [[]] and res.path.tolist() == [[-1, -1]]


def _random_parents(rng: random.Random, b: int, t: int) -> torch.Tensor:
    return torch.tensor([[rng.randrange(-1, j) for j in range(t)] for _ in range(b)])


def _ref_depth(par: list[int], j: int) -> int:
    return 0 if par[j] < 0 else 1 + _ref_depth(par, par[j])


@pytest.mark.parametrize("t", [0, 1, 2, 5, 16, 33])
def test_depths_and_masks_match_a_per_node_reference(t):
    rng = random.Random(t)
    parents = _random_parents(rng, 3, t)
    if t:
        parents[0] = torch.arange(t) - 1  # one chain: the deepest tree of t nodes
    assert tree_depths(parents).tolist() == [[_ref_depth(p, j) for j in range(t)] for p in parents.tolist()]
    prefix_host = [2, 0, 5]
    prefix = torch.tensor(prefix_host)
    span = 5 + t + 1
    mask = AttnMeta.rows(prefix, t, span, tail=tree_ancestors(parents)).visible(t)  # [B, T, S]
    for i, par in enumerate(parents.tolist()):
        for j in range(t):
            anc = {j}
            k = j
            while par[k] >= 0:
                k = par[k]
                anc.add(k)
            want = [s < prefix_host[i] or (s - prefix_host[i]) in anc for s in range(span)]
            assert mask[i, j].tolist() == want
