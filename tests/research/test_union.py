"""One verify pass over the union of EAGLE's and the suffix drafter's trees (an experiment)."""

from __future__ import annotations

import torch

from tlt.drafter.eagle import Drafter
from tlt.rollout.draft_tree import DraftTree
from tlt.rollout.eagle_proposer import EagleProposer
from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.generate import SamplingParams
from tlt.rollout.history import ResponseHistory
from tlt.rollout.suffix import SuffixProposer
from tlt.rollout.strategy import Arm
from union import UnionProposer, merge
from tests.rollout.test_history import setup  # noqa: F401  (fixture)


def test_merge_shares_common_prefixes_and_keeps_the_limit():
    a = DraftTree(torch.tensor([[5, 6, 7], [1, 0, 0]]), torch.tensor([[-1, 0, 1], [-1, -1, -1]]),
                  torch.tensor([[True, True, True], [True, False, False]]))
    b = DraftTree(torch.tensor([[5, 6, 9], [2, 3, 4]]), torch.tensor([[-1, 0, 1], [-1, 0, 1]]),
                  torch.tensor([[True, True, True], [True, True, True]]))
    m = merge(a, b, 8)
    assert m.tokens[0].tolist() == [5, 6, 7, 9] and m.parents[0].tolist() == [-1, 0, 1, 1]
    assert m.tokens[1][m.valid[1]].tolist() == [1, 2, 3, 4] and m.parents[1][m.valid[1]].tolist() == [-1, -1, 1, 2]
    cut = merge(a, b, 2)  # b's nodes past the limit go, and so do their children
    assert cut.tokens[1][cut.valid[1]].tolist() == [1, 2] and cut.parents[1][cut.valid[1]].tolist() == [-1, -1]


def test_the_union_is_lossless(setup, warm_drafters):  # noqa: F811
    model, prompts, params = setup
    seeds, groups = list(range(300, 308)), [i // 2 for i in range(8)]
    drafter = Drafter.load(warm_drafters["eagle"], model.embed_weight, model.lm_head.weight)
    for p in (params, SamplingParams(max_new_tokens=40, stop_ids=params.stop_ids)):  # sampled, greedy
        ref = RolloutEngine(model, EngineConfig(max_batch=8, max_len=200)).generate(prompts, p, seeds=seeds)
        union = UnionProposer(EagleProposer(drafter, max_batch=8, max_len=260), SuffixProposer(history=ResponseHistory()))
        eng = RolloutEngine(model, EngineConfig(max_batch=8, max_len=200, arm=Arm(4, 2, 8)), proposers={"": union})
        res = eng.generate(prompts, p, groups, seeds)
        assert res.outputs == ref.outputs and any(a > 1 for a in res.accept_lengths)
