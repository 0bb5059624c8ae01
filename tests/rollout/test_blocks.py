"""The block pool's bookkeeping: growth by positions, release, the scratch block, exhaustion without
side effects, and a random workload whose blocks are never shared or lost."""

from __future__ import annotations

import dataclasses
import random

import pytest

from tlt.rollout.blocks import BlockPool, PoolExhausted


def test_grow_release_and_table():
    pool = BlockPool(6, 4)  # 5 usable blocks, block 5 is scratch
    assert (pool.capacity, pool.free, pool.scratch) == (5, 5, 5)
    assert pool.grow("a", 5) == [0, 1] and pool.grow("a", 8) == [] and pool.grow("a", 9) == [2]
    assert pool.grow("b", 1) == [3]
    assert pool.table(["b", "a"], 4) == [[3, 5, 5, 5], [0, 1, 2, 5]]
    assert pool.shortfall({"a": 12, "b": 8}) == 0 and pool.shortfall({"a": 16, "b": 8}) == 1
    assert pool.release("a") == 3 and pool.free == 4 and pool.peak == 4
    assert pool.grow("c", 4) == [0]  # freed blocks come back lowest first


def test_exhaustion_takes_nothing():
    pool = BlockPool(4, 2)
    pool.grow("a", 4)
    with pytest.raises(PoolExhausted, match="needs 2 more blocks"):
        pool.grow("b", 3)
    assert pool.held("b") == [] and pool.free == 1
    with pytest.raises(ValueError, match="2 blocks, the table has 1"):
        pool.table(["a"], 1)


@pytest.mark.parametrize("bad", [dict(num_blocks=1, block_size=4), dict(num_blocks=4, block_size=0)])
def test_refuses_a_pool_that_cannot_hold_anything(bad):
    with pytest.raises(ValueError):
        BlockPool(**bad)


def test_a_random_workload_never_shares_or_loses_a_block():
    rng = random.Random(0)
    pool, lengths = BlockPool(64, 16), {}
    for step in range(2000):
        r = rng.randrange(12)
        if r in lengths and rng.random() < 0.1:
            pool.release(r)
            del lengths[r]
            continue
        want = lengths.get(r, 0) + rng.randrange(1, 40)
        try:
            pool.grow(r, want)
            lengths[r] = want
        except PoolExhausted:
            pass
        held = [b for q in lengths for b in pool.held(q)]
        assert len(held) == len(set(held)) and pool.scratch not in held
        assert len(held) + pool.free == pool.capacity
        assert all(len(pool.held(q)) == pool.blocks_for(n) for q, n in lengths.items())


def test_victims_by_rule_cover_the_shortfall_and_spare_the_last_request():
    from tlt.rollout.eviction import Candidate, choose_victims

    run = [Candidate(1, blocks=4, tokens=60, admitted=0), Candidate(2, blocks=1, tokens=10, admitted=1),
           Candidate(3, blocks=2, tokens=30, admitted=2)]
    assert choose_victims(run, 2, "youngest") == [3]
    assert choose_victims(run, 2, "fewest-tokens") == [2, 3]
    assert choose_victims(run, 2, "most-tokens") == [1]
    assert choose_victims(run, 100, "youngest") == [3, 2]  # never all three
    assert choose_victims(run[:1], 5, "youngest") == [] and choose_victims(run, 0, "youngest") == []
    with pytest.raises(ValueError, match="eviction rule"):
        choose_victims(run, 1, "oldest")


def test_a_forgotten_request_starts_over_in_the_drafter():
    """An eviction frees the blocks that held a request's drafter KV: after ``forget`` the EAGLE
    proposer catches the request up from its first pair again, as for a request it never saw."""
    import torch

    from tlt.rollout.draft_tree import ProposerInput
    from tlt.rollout.eagle_proposer import EagleProposer
    from tlt.rollout.strategy import Arm
    from tests.rollout.test_transfers import _models

    target, drafter = _models()
    prop = EagleProposer(drafter, max_batch=4, max_len=64)
    tokens = {0: list(range(1, 11)), 1: list(range(2, 14))}
    feats = torch.randn(4, 64, 32)

    def propose():
        return prop.propose(ProposerInput(1, (0, 1), tokens, {0: 4, 1: 4}, {0: 0, 1: 1}, feats, Arm(3, 1, 3)))

    propose()
    assert prop.seen == {0: 9, 1: 11}
    tokens[0].append(20), tokens[1].append(21)
    before = prop.pairs_processed
    propose()
    assert prop.pairs_processed - before == 2  # one new pair each
    tokens[0].append(22), tokens[1].append(23)
    prop.forget([1])
    before = prop.pairs_processed
    propose()
    assert prop.pairs_processed - before == 1 + 13  # request 0: one pair; request 1: all of its pairs again


def test_a_paged_engine_refuses_an_arm_whose_drafter_reaches_past_its_tables():
    from tlt.rollout.engine import EngineConfig, RolloutEngine
    from tlt.rollout.suffix import SuffixProposer
    from tlt.rollout.strategy import Arm
    from tests.rollout.test_transfers import _models

    target, _ = _models()
    # the rows layout: a drafter's levels use its own cache; paged: the engine's tables
    RolloutEngine(target, EngineConfig(max_len=64, max_draft_tokens=8, arm=Arm(4, 4, 8)), proposer=SuffixProposer())
    with pytest.raises(ValueError, match="drafter writes 12 positions"):  # (4 - 1) levels x 4 candidates
        RolloutEngine(target, EngineConfig(max_len=64, max_draft_tokens=8, arm=Arm(4, 4, 8), block_size=4),
                      proposer=SuffixProposer())


def test_a_pool_sized_by_memory_counts_the_drafters_kv():
    """kv_bytes buys blocks of the target's KV, the features and the EAGLE drafter's KV: with an
    EAGLE proposer a block costs one drafter layer's keys and values more, so fewer fit."""
    from tlt.rollout.eagle_proposer import EagleProposer
    from tlt.rollout.engine import EngineConfig, RolloutEngine
    from tlt.rollout.strategy import Arm
    from tests.rollout.test_transfers import _models

    target, drafter = _models()
    cfg = EngineConfig(max_batch=4, max_len=64, block_size=8, kv_bytes=1 << 20, arm=Arm(3, 1, 3))
    plain = RolloutEngine(target, EngineConfig(max_batch=4, max_len=64, block_size=8, kv_bytes=1 << 20))
    prop = EagleProposer(drafter, max_batch=4, max_len=128)
    assert prop.cache.released  # nothing allocated before its first proposal, in the layout it then learns
    eagle = RolloutEngine(target, cfg, proposer=prop)
    layer = drafter.config.layer
    per_position = 2 * layer.num_key_value_heads * layer.head_dim * drafter.fc.weight.element_size()
    assert prop.kv_position_bytes == per_position
    hidden = target.config.hidden_size * target.embed_weight.element_size()  # EAGLE keeps the last hidden state
    assert eagle.block_bytes() - plain.block_bytes() == 8 * (per_position + hidden)
    assert eagle.pool.capacity == (1 << 20) // eagle.block_bytes() < plain.pool.capacity


def test_a_drafter_set_later_fits_the_memory_kept_for_it_or_is_refused():
    """A pool sized by memory before its first drafter (a spot-trained one arrives later) keeps
    ``draft_position_bytes`` per position for it: without that room the drafter is refused, naming
    the room it needs, and the engine keeps its proposers; with it, the pool holds as many blocks as
    one built with the drafter from the start."""
    from tlt.rollout.eagle_proposer import EagleProposer
    from tlt.rollout.engine import EngineConfig, RolloutEngine
    from tlt.rollout.strategy import Arm
    from tests.rollout.test_transfers import _models

    target, drafter = _models()
    cfg = EngineConfig(max_batch=4, max_len=64, block_size=8, kv_bytes=1 << 20, arm=Arm(3, 1, 3))
    from_start = RolloutEngine(target, cfg, proposer=EagleProposer(drafter, max_batch=4, max_len=128))
    plain = RolloutEngine(target, cfg)
    need = (from_start.block_bytes() - plain.block_bytes()) // 8  # the drafter's KV and the hidden state it reads
    with pytest.raises(ValueError, match=f"draft_position_bytes >= {need}"):
        plain.set_proposers({"": EagleProposer(drafter, max_batch=4, max_len=128)}, None)
    assert plain.proposers == {} and plain.block_bytes() * plain.pool.capacity <= 1 << 20
    later = RolloutEngine(target, dataclasses.replace(cfg, draft_position_bytes=need))
    assert later.pool.capacity == from_start.pool.capacity < plain.pool.capacity
    later.set_proposers({"": EagleProposer(drafter, max_batch=4, max_len=128)}, None)
    assert later.block_bytes() * later.pool.capacity <= 1 << 20
    with pytest.raises(ValueError, match="draft_position_bytes=-1"):
        EngineConfig(block_size=8, kv_bytes=1 << 20, draft_position_bytes=-1)


@pytest.mark.parametrize("sizing", [{"kv_blocks": 14}, {"kv_bytes": 60_000}])
def test_a_request_the_pool_cannot_hold_is_told_the_key_that_sized_it(sizing):
    """The refusal names the key the pool was sized by (kv_blocks, kv_bytes or kv_fraction: only one
    may be given, so 'raise kv_blocks' misled a pool sized by bytes) and the draft reserve."""
    from tlt.rollout.engine import EngineConfig, RolloutEngine
    from tlt.rollout.generate import SamplingParams
    from tlt.rollout.request import RequestState
    from tests.rollout.test_transfers import _models

    target, _ = _models()
    eng = RolloutEngine(target, EngineConfig(max_batch=4, max_len=512, block_size=16, **sizing))
    st = RequestState(tuple(range(1, 60)) * 4, SamplingParams(max_new_tokens=60), 0)
    key = next(iter(sizing))
    with pytest.raises(ValueError, match=rf"the pool holds \d+ \(raise EngineConfig\.{key}, or lower max_draft_tokens\)"):
        eng.add([st])
