"""The suffix drafter's matching rules, tree shape, lifetime, config, and the accept-length replay."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from tlt.rollout.draft_tree import DraftTree, ProposerInput
from tlt.rollout.suffix import SuffixConfig, SuffixProposer
from tests.rollout.suffix_eval import greedy_accept, measure_accept_length
from tlt.rollout.strategy import Arm

CHAIN3 = Arm(3, 1, 3)
P = [900, 901, 902]  # a prompt that matches nothing else


def nodes(tree: DraftTree, row: int = 0) -> list[tuple[int, int]]:
    """(token, parent) of the valid nodes of one row."""
    return [(int(t), int(p)) for t, p, v in zip(tree.tokens[row], tree.parents[row], tree.valid[row]) if v]


def chain(tree: DraftTree, row: int = 0) -> list[int]:
    got = nodes(tree, row)
    assert all(p == j - 1 for j, (_, p) in enumerate(got)), got
    return [t for t, _ in got]


def run(requests, arm: Arm = CHAIN3, ask: int = 0, **cfg) -> DraftTree:
    """requests: (rid, group, prompt, output) rows, started then accepted in order; proposes for `ask`."""
    prop = SuffixProposer(SuffixConfig(**cfg))
    for rid, gid, prompt, out in requests:
        prop.start([rid], [gid], [prompt])
        if out:
            prop.accept([rid], [out])
    return prop.draft([ask], arm)


# --- matching rules, table-driven: (name, requests, arm, config, expected chain) ---------------------

CHAIN_CASES = [
    # "1 2 3" -> 9 (n=3) beats the newer "2 3" -> 7 (n=2)
    ("longest_suffix_wins", [(0, 0, [1, 2, 3, 9, 5, 2, 3, 7, 0, 1, 2, 3], [])], Arm(1, 1, 1), {}, [9]),
    ("shorter_when_longer_missing", [(0, 0, [5, 2, 3, 7, 0, 8, 3], [])], Arm(1, 1, 1), {}, [7]),
    ("prompt_lookup", [(0, 0, [5, 6, 7, 8, 9, 5, 6], [])], CHAIN3, {}, [7, 8, 9]),
    ("prompt_lookup_off", [(0, 0, [5, 6, 7, 8, 9, 5, 6], [])], CHAIN3, {"use_prompt": False}, []),
    ("prompt_continuation_runs_into_output", [(0, 0, [5, 6, 7], [5, 6])], CHAIN3, {}, [7, 5, 6]),
    ("own_output_lookup", [(0, 0, P, [1, 2, 3, 4, 1, 2])], CHAIN3, {}, [3, 4, 1]),
    ("own_output_off", [(0, 0, P, [1, 2, 3, 4, 1, 2])], CHAIN3, {"use_own_output": False}, []),
    ("own_end_never_matches_itself", [(0, 0, P, [1, 2, 3])], CHAIN3, {}, []),
    ("repetition_matches_overlapping", [(0, 0, P, [4, 4, 4])], CHAIN3, {}, [4, 4]),  # "4 4"->4, then "4"->4 4
    ("sibling_lookup", [(1, 7, P, [10, 11, 12, 13]), (0, 7, P, [10, 11])], CHAIN3, {}, [12, 13]),
    ("sibling_from_prompt_end", [(1, 7, P, [10, 11, 12]), (0, 7, P, [])], CHAIN3, {}, [10, 11, 12]),
    ("sibling_off", [(1, 7, P, [10, 11, 12, 13]), (0, 7, P, [10, 11])], CHAIN3, {"use_siblings": False}, []),
    ("other_group_ignored", [(1, 8, P, [10, 11, 12, 13]), (0, 7, P, [10, 11])], CHAIN3, {}, []),
    ("sibling_prompt_not_double_counted",  # the shared prompt says 2 -> 3, one sibling's output 2 -> 5:
     [(1, 7, [1, 2, 3], [9, 2, 5]), (2, 7, [1, 2, 3], []), (3, 7, [1, 2, 3], []), (0, 7, [1, 2, 3], [7, 2])],
     Arm(1, 1, 1), {}, [5]),  # frequency 1 each (the prompt is not counted once per sibling): newer wins
    ("frequency_beats_recency",
     [(1, 7, P, [1, 2, 5]), (2, 7, P, [1, 2, 5]), (3, 7, P, [1, 2, 6]), (0, 7, P, [1, 2])], Arm(1, 1, 1), {}, [5]),
    ("recency_breaks_frequency_tie",
     [(1, 7, P, [1, 2, 5]), (2, 7, P, [1, 2, 6]), (0, 7, P, [1, 2])], Arm(1, 1, 1), {}, [6]),
    ("output_newer_than_prompt", [(0, 0, [2, 3], [2, 4, 2])], Arm(1, 1, 1), {}, [4]),
    ("prompt_newer_position_wins", [(0, 0, [2, 3, 2, 4, 2], [])], Arm(1, 1, 1), {}, [4]),
    ("max_n_limits_match",  # with max_n=1 only "3" is matched: newest 3 -> 8
     [(0, 0, [1, 2, 3, 9, 4, 3, 8, 1, 2, 3], [])], Arm(1, 1, 1), {"max_n": 1}, [8]),
    ("min_n_blocks_short_match", [(0, 0, [5, 2, 3, 7, 0, 8, 3], [])], Arm(1, 1, 1), {"min_n": 2}, []),
    ("no_match", [(0, 0, P, [1, 2, 3])], CHAIN3, {}, []),
]


@pytest.mark.parametrize("name,requests,arm,cfg,expected", CHAIN_CASES, ids=[c[0] for c in CHAIN_CASES])
def test_matching_rules(name, requests, arm, cfg, expected):
    tree = run(requests, arm, **cfg)
    assert chain(tree) == expected
    assert int(tree.valid[0].sum()) == len(expected)


# --- tree shape: (name, sibling outputs, arm, expected (token, parent) nodes) ---------------------------

# after "1 2": 5 6 7 twice (older), 5 8 9 once (newest) -> branch at node "5"
DIVERGE_DEEP = [[1, 2, 5, 6, 7], [1, 2, 5, 6, 7], [1, 2, 5, 8, 9]]
# after "1 2": 5 6 7 (twice) and 3 4 (once) -> branch at the root
DIVERGE_ROOT = [[1, 2, 5, 6, 7], [1, 2, 5, 6, 7], [1, 2, 3, 4]]
TREE_CASES = [
    ("branch_below_root_topk2", DIVERGE_DEEP, Arm(3, 2, 5), [(5, -1), (6, 0), (7, 1), (8, 0), (9, 3)]),
    ("branch_at_root_topk2", DIVERGE_ROOT, Arm(3, 2, 5), [(5, -1), (6, 0), (7, 1), (3, -1), (4, 3)]),
    ("chain_topk1", DIVERGE_DEEP, Arm(3, 1, 3), [(5, -1), (6, 0), (7, 1)]),
    ("depth_cap", DIVERGE_DEEP, Arm(2, 2, 6), [(5, -1), (6, 0), (8, 0)]),
    ("tokens_to_verify_cap", DIVERGE_DEEP, Arm(3, 2, 4), [(5, -1), (6, 0), (7, 1), (8, 0)]),
    ("tokens_to_verify_cuts_first_path", DIVERGE_DEEP, Arm(3, 2, 2), [(5, -1), (6, 0)]),
    ("topk_larger_than_candidates", DIVERGE_DEEP, Arm(3, 3, 9), [(5, -1), (6, 0), (7, 1), (8, 0), (9, 3)]),
]


@pytest.mark.parametrize("name,outputs,arm,expected", TREE_CASES, ids=[c[0] for c in TREE_CASES])
def test_tree_shape(name, outputs, arm, expected):
    requests = [(i + 1, 7, P, out) for i, out in enumerate(outputs)] + [(0, 7, P, [1, 2])]
    tree = run(requests, arm)
    assert nodes(tree) == expected
    assert tree.num_nodes == len(expected)


def test_longer_match_outranks_frequency_in_tree():
    # "0 1 2" -> 5 (one sibling, n=3) beats "1 2" -> 6 (three siblings, n=2); the n=2 path is the 2nd branch.
    outs = [[0, 1, 2, 5], [9, 1, 2, 6], [8, 1, 2, 6], [7, 1, 2, 6]]
    requests = [(i + 1, 7, P, out) for i, out in enumerate(outs)] + [(0, 7, P, [0, 1, 2])]
    assert nodes(run(requests, Arm(1, 2, 2))) == [(5, -1), (6, -1)]


def test_batch_padding_and_no_match_row():
    prop = SuffixProposer()
    prop.start([0, 1, 2], [0, 1, 2], [[5, 6, 7, 8, 5, 6], P, [1, 2, 1]])
    tree = prop.draft([0, 1, 2], Arm(3, 1, 3))
    assert tree.tokens.shape == (3, 3)  # padded to the largest tree in the batch
    assert chain(tree, 0) == [7, 8, 5] and chain(tree, 2) == [2, 1]
    assert not tree.valid[1].any()  # no match: no node at all, never a guess
    assert tree.valid.tolist() == [[True] * 3, [False] * 3, [True, True, False]]


def test_arm_off_gives_empty_tree():
    prop = SuffixProposer()
    prop.start([0, 1], [0, 0], [[5, 6, 5], [5, 6, 5]])
    tree = prop.draft([0, 1], Arm.off())
    assert tree.tokens.shape == (2, 0) and tree.valid.dtype == torch.bool


def test_propose_order_follows_rids():
    prop = SuffixProposer()
    prop.start([3, 4], [0, 1], [[1, 2, 1], [7, 8, 7]])
    tree = prop.draft([4, 3], Arm(1, 1, 1))
    assert chain(tree, 0) == [8] and chain(tree, 1) == [2]


# --- lifetime -----------------------------------------------------------------------------------------

def test_finish_keeps_sibling_data_until_group_done():
    prop = SuffixProposer()
    prop.start([0, 1], [7, 7], [P, P])
    prop.accept([1], [[10, 11, 12]])
    prop.finish([1])
    prop.accept([0], [[10]])
    assert chain(prop.draft([0], CHAIN3)) == [11, 12]
    with pytest.raises(ValueError, match="finished"):
        prop.accept([1], [[3]])
    prop.finish([0])  # last one of group 7: the group is dropped
    assert prop.num_requests == 0
    prop.start([2], [7], [P])  # same group id, fresh group
    prop.accept([2], [[10]])
    assert chain(prop.draft([2], CHAIN3)) == []


def test_keep_finished_groups_then_clear():
    prop = SuffixProposer(SuffixConfig(drop_finished_groups=False))
    prop.start([0], [7], [P])
    prop.accept([0], [[10, 11, 12]])
    prop.finish([0])
    prop.start([1], [7], [P])  # a late sibling still sees the finished one
    prop.accept([1], [[10]])
    assert chain(prop.draft([1], CHAIN3)) == [11, 12]
    prop.clear_group(7)
    assert prop.num_requests == 0
    with pytest.raises(ValueError, match="unknown request"):
        prop.draft([1], CHAIN3)
    with pytest.raises(ValueError, match="unknown group"):
        prop.clear_group(7)
    prop.start([0], [3], [P])
    prop.reset()
    assert prop.num_requests == 0


def test_accept_takes_tensors_and_ignores_features():
    prop = SuffixProposer()
    prop.start([0], [0], [torch.tensor(P)])
    prop.accept([0], [torch.tensor([1, 2, 3, 1])], features=[torch.zeros(2, 4)])
    assert chain(prop.draft([0], CHAIN3)) == [2, 3, 1]


def test_propose_follows_the_engine_input():
    """propose(ProposerInput) indexes what was committed since its last call, finishes requests that
    left the rows (their output still serves siblings) and starts over on a new generation."""
    prop = SuffixProposer()
    tokens = [P + [10, 11, 12], P + [10]]  # request 0 ran ahead of its sibling 1
    arm = CHAIN3
    assert prop.num_requests == 0
    tree = prop.propose(ProposerInput(1, (0, 1), tokens, [3, 3], [7, 7], None, arm))
    assert chain(tree, 1) == [11, 12]  # from the sibling's output
    tokens[0] += [13]
    tokens[1] += [11]
    tree = prop.propose(ProposerInput(1, (1,), tokens, [3, 3], [7, 7], None, arm))  # 0 finished
    assert chain(tree) == [12, 13]  # the finished sibling's last token was indexed
    assert prop.propose(ProposerInput(1, (1,), tokens, [3, 3], [7, 7], None, Arm.off())).num_nodes == 0
    tree = prop.propose(ProposerInput(2, (0,), [P + [10]], [3], [7], None, arm))  # new generation
    assert chain(tree) == [] and prop.num_requests == 1


@pytest.mark.parametrize("call,match", [
    (lambda p: p.start([0, 1], [0], [P, P]), "one entry per request"),
    (lambda p: p.start([5, 5], [0, 0], [P, P]), "duplicate"),
    (lambda p: p.start([0], [0], [P]), "already registered"),
    (lambda p: p.accept([9], [[1]]), "unknown request"),
    (lambda p: p.accept([0], [[1], [2]]), "token lists"),
    (lambda p: p.finish([9]), "unknown request"),
    (lambda p: p.draft([9], CHAIN3), "unknown request"),
])
def test_api_errors(call, match):
    prop = SuffixProposer()
    prop.start([0], [0], [P])
    with pytest.raises(ValueError, match=match):
        call(prop)


@pytest.mark.parametrize("kwargs,field", [
    ({"min_n": 0}, "min_n"),
    ({"min_n": 3, "max_n": 2}, "max_n"),
    ({"max_n": 33}, "max_n"),
    ({"max_occurrences": 0}, "max_occurrences"),
    ({"min_n": 1.5}, "min_n"),
    ({"use_prompt": 1}, "use_prompt"),
    ({"use_prompt": False, "use_own_output": False, "use_siblings": False}, "use_siblings"),
])
def test_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SuffixConfig(**kwargs)


def test_config_is_frozen_keyword_only():
    cfg = SuffixConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.min_n = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        SuffixConfig(1, 4)  # type: ignore[misc]


# --- invariants on random traffic ---------------------------------------------------------------------

def _is_sound(path: list[int], ctx: list[int], sources: list[list[int]], min_n: int) -> bool:
    """Some source position preceded by the context's last min_n tokens is followed by `path`."""
    tail = ctx[-min_n:]
    for src in sources:
        for p in range(min_n, len(src) - len(path) + 1):
            if src[p - min_n:p] == tail and src[p:p + len(path)] == path:
                return True
    return False


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_invariants(seed):
    rng = random.Random(seed)
    cfg = SuffixConfig(min_n=rng.choice([1, 2]), max_n=rng.choice([2, 3, 4]), max_occurrences=rng.choice([1, 4, 16]))
    prop = SuffixProposer(cfg)
    groups = {rid: rid % 3 for rid in range(9)}
    prompts = {g: [rng.randrange(6) for _ in range(rng.randrange(1, 8))] for g in range(3)}
    seqs = {rid: list(prompts[g]) for rid, g in groups.items()}
    prop.start(list(groups), list(groups.values()), [prompts[g] for g in groups.values()])
    for _ in range(25):
        rids = rng.sample(list(groups), 5)
        arm = Arm(d := rng.randint(1, 4), k := rng.randint(1, 3), rng.randint(1, k + (d - 1) * k * k))
        tree = prop.draft(rids, arm)
        assert tree.tokens.dtype == tree.parents.dtype == torch.long and tree.valid.dtype == torch.bool
        assert tree.tokens.device.type == "cpu" and tree.tokens.shape[0] == len(rids)
        idx = torch.arange(tree.num_nodes)
        assert (tree.parents < idx).all()  # topological order
        depth = tree.depths()
        for i, rid in enumerate(rids):
            got = nodes(tree, i)
            n = len(got)
            assert tree.valid[i, :n].all() and not tree.valid[i, n:].any()  # valid nodes come first
            assert n <= arm.tokens_to_verify and (depth[i, :n] < arm.depth).all()
            parents = [p for _, p in got]
            assert sum(j not in parents for j in range(n)) <= arm.topk  # leaves = distinct continuations
            kids = {}
            for j, (t, p) in enumerate(got):
                assert t not in kids.setdefault(p, set())  # sibling nodes carry distinct tokens
                kids[p].add(t)
                path = [t]
                while p >= 0:
                    path.insert(0, got[p][0])
                    p = got[p][1]
                sources = [seqs[rid]] + [seqs[r] for r in groups if r != rid and groups[r] == groups[rid]]
                assert _is_sound(path, seqs[rid], sources, cfg.min_n), (path, seqs[rid])
        new = [[rng.randrange(6) for _ in range(rng.randint(1, 3))] for _ in rids]
        prop.accept(rids, new)
        for rid, toks in zip(rids, new):
            seqs[rid].extend(toks)


@pytest.mark.parametrize("seed", range(4))
def test_chain_is_the_trees_first_path(seed):
    """A chain (built without a trie) is the greedy first path of the trie a tree arm builds, with
    history corpora among the sources; a broken vote (e.g. ranking by count before match length)
    fails it."""
    from tlt.rollout.history import HistoryConfig, ResponseHistory

    rng = random.Random(seed)
    cfg = SuffixConfig(max_occurrences=rng.choice([2, 8, 32]))
    hist = ResponseHistory(HistoryConfig(global_tokens=64), cfg)
    hist.add(0, [([1, 2], [rng.randrange(4) for _ in range(20)]) for _ in range(4)])
    prop = SuffixProposer(cfg, history=hist)
    prop.start(list(range(6)), [r % 2 for r in range(6)], [[1, 2]] * 6)
    checked = 0
    for _ in range(20):
        rids = rng.sample(range(6), 4)
        depth = rng.randint(1, 5)
        chains, tree = prop.draft(rids, Arm(depth, 1, depth)), prop.draft(rids, Arm(depth, 3, 3 * depth))
        for i in range(len(rids)):
            first = []
            for j, (t, p) in enumerate(nodes(tree, i)):
                if p != j - 1:
                    break
                first.append(t)
            assert chain(chains, i) == first
            checked += bool(first)
        prop.accept(rids, [[rng.randrange(4) for _ in range(rng.randint(1, 3))] for _ in rids])
    assert checked > 20  # most proposals drafted something


# --- accept-length replay -----------------------------------------------------------------------------

def test_greedy_accept_walks_the_tree():
    tree = DraftTree(torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[-1, 0, 1, 0, 3]]), torch.ones(1, 5, dtype=torch.bool))
    assert greedy_accept(tree.tokens[0], tree.parents[0], tree.valid[0], [5, 8, 9, 1]) == 3
    assert greedy_accept(tree.tokens[0], tree.parents[0], tree.valid[0], [5, 6, 0]) == 2
    assert greedy_accept(tree.tokens[0], tree.parents[0], tree.valid[0], [1]) == 0


def _rand(rng, n, vocab=1000):
    return [rng.randrange(vocab) for _ in range(n)]


def test_accept_length_identical_siblings_reach_one_plus_depth():
    rng = random.Random(0)
    arm = Arm(4, 1, 4)
    data = [(_rand(rng, 16), [resp] * 6) for resp in (_rand(rng, 200), _rand(rng, 200))]
    stats = measure_accept_length(data, arm, interleave=False)
    followers = [stats.response_accept_length(i) for i in range(12) if i % 6]
    assert min(followers) > 1 + arm.depth - 0.1  # every step but the last accepts the whole chain
    assert stats.response_accept_length(0) < 1.05  # the first sibling has nothing to copy from
    assert stats.tokens == 2 * 6 * 200 and stats.accepted + stats.steps >= stats.tokens
    # in lockstep, identical siblings are never ahead of each other: nothing to draft from
    assert measure_accept_length(data, arm).mean_accept_length < 1.05


def test_accept_length_random_siblings_is_about_one():
    rng = random.Random(1)
    data = {g: (_rand(rng, 16), [_rand(rng, 150) for _ in range(4)]) for g in range(2)}
    for interleave in (True, False):
        stats = measure_accept_length(data, Arm(4, 2, 8), interleave=interleave)
        assert stats.tokens == 2 * 4 * 150
        assert 1.0 <= stats.mean_accept_length < 1.05


def test_accept_length_sibling_ahead_in_lockstep():
    # sibling 0 writes the shared text from the start, sibling 1 after 100 tokens of its own
    rng = random.Random(2)
    body = _rand(rng, 200)
    data = [(_rand(rng, 16), [body, _rand(rng, 100) + body])]
    stats = measure_accept_length(data, Arm(4, 1, 4))
    assert stats.response_accept_length(0) < 1.05
    assert stats.response_accept_length(1) > 1.4  # it copies the body sibling 0 already wrote


def test_accept_length_rejects_empty_input():
    with pytest.raises(ValueError, match="no responses"):
        measure_accept_length([], CHAIN3)
