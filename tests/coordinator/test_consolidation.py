"""Consolidation on hand-computed cases (not its own cost model): RLHFSpec's reallocation
invariants, RLHFuse's receiver count, a replica in a spot session never receives, and the choice
between moving and not: no move when the measured step cost grows with the batch, moves when it is
flat."""

from __future__ import annotations

import pytest

from tlt.coordinator.consolidation import (
    ReplicaLoad,
    RequestLoad,
    StepCurve,
    ConsolidationConfig,
    consolidate,
    decide,
    drain_s,
    reallocate,
    receivers_needed,
)

FLAT = StepCurve(((1, 1.0), (64, 1.0)))  # a GPU's small batches: a step costs the same
STEEP = StepCurve(((1, 1.0), (64, 64.0)))  # a compute-bound CPU: cost grows with the batch
KNEE4 = StepCurve(((1, 1.0), (4, 1.0), (8, 2.0)))  # flat to 4, then linear: throughput peaks at 4


def _replica(rank, n, curve, remaining=10.0, training=False, first_generated=0):
    reqs = tuple(RequestLoad(f"{rank}-{i}", first_generated + i, i % 2, remaining) for i in range(n))
    return ReplicaLoad(rank, reqs, curve, training=training)


def test_step_curve_and_drain_time():
    assert KNEE4.cost(2) == 1.0 and KNEE4.cost(6) == 1.5 and KNEE4.cost(12) == 3.0  # extended past the end
    assert KNEE4.theta(0.9, 64) == 4  # throughput b / cost: 1, 2, 3, 4, 4, 4, ...
    assert STEEP.theta(0.9, 64) == 1 and FLAT.theta(0.9, 64) == 58  # ceil(0.9 * 64)
    # remaining 2 and 5 tokens, cost(b) = b: 2 steps at batch 2 (2 s each), then 3 at batch 1
    assert drain_s([5, 2], StepCurve(((1, 1.0), (2, 2.0))), 1.0) == pytest.approx(7.0)
    assert drain_s([5, 2], StepCurve(((1, 1.0), (2, 2.0))), 2.0, start_s=1.0) == pytest.approx(4.5)
    with pytest.raises(ValueError, match="StepCurve"):
        StepCurve(((0, 1.0),))


def test_reallocation_keeps_rlhfspec_invariants():
    reps = [_replica(0, 9, KNEE4), _replica(1, 1, KNEE4), _replica(2, 6, KNEE4), _replica(3, 3, KNEE4)]
    moves = reallocate(reps, ConsolidationConfig(max_batch=8))
    # theta 4: pairs (9, 1) and (6, 3) move min(9-4, 4-1) = 3 and min(6-4, 4-3) = 1
    assert [(m.source, m.destination) for m in moves] == [(0, 1)] * 3 + [(2, 3)]
    after = {r.rank: len(r.requests) for r in reps}
    for m in moves:
        after[m.source] -= 1
        after[m.destination] += 1
    assert after == {0: 6, 1: 4, 2: 5, 3: 4}  # sources keep >= theta, destinations end <= theta
    pairs = {(m.source, m.destination) for m in moves}
    ranks = [r for p in pairs for r in p]
    assert len(ranks) == len(set(ranks))  # each replica in at most one move per decision
    assert [m.rid for m in moves[:3]] == ["0-0", "0-1", "0-2"]  # the source's shortest first


def test_rlhfuse_receivers_and_consolidation():
    assert receivers_needed(10, ConsolidationConfig(max_batch=4)) == 3  # ceil(10 / 4)
    assert receivers_needed(10, ConsolidationConfig(max_batch=4, kv_request_bytes=1 << 30, kv_capacity_bytes=2 << 30)) == 5
    assert receivers_needed(0, ConsolidationConfig()) == 0
    reps = [_replica(0, 2, FLAT), _replica(1, 3, FLAT), _replica(2, 1, FLAT)]
    cfg = ConsolidationConfig(max_batch=4)
    assert consolidate(reps, step_requests=20, cfg=cfg) == []  # 6 left > 0.2 x 20: not the tail yet
    moves = consolidate(reps, step_requests=40, cfg=cfg)  # 6 <= 8: onto ceil(6 / 4) = 2 replicas
    # replicas 1 (3 requests) and 0 (2) stay; replica 2's request goes to the less loaded of them
    assert [(m.rid, m.source, m.destination) for m in moves] == [("2-0", 2, 0)]


def test_a_training_replica_never_receives():
    reps = [_replica(0, 1, FLAT), _replica(1, 3, FLAT, training=True)]
    moves = consolidate(reps, step_requests=40, cfg=ConsolidationConfig())
    assert moves and all(m.destination == 0 for m in moves)  # the training one's requests leave it
    assert all(m.destination != 1 for m in reallocate([_replica(0, 9, KNEE4), _replica(1, 0, KNEE4, training=True)],
                                                      ConsolidationConfig(max_batch=8)))


def test_no_move_when_the_step_cost_grows_with_the_batch_moves_when_it_is_flat():
    cfg = ConsolidationConfig(max_batch=64, train_value=0.5)
    # A: 3 requests, B: 1, 10 tokens left each; 4 left of a 32-request step: the tail
    flat = decide([_replica(0, 3, FLAT), _replica(1, 1, FLAT)], 32, cfg)
    # flat: A drains in 10 s with 3 or 4 requests; moving B's frees B for 10 s: 0.5 x 10 - 2 x 0 = 5
    assert flat.kind == "consolidate" and [(m.source, m.destination) for m in flat.moves] == [(1, 0)]
    assert flat.score == pytest.approx(5.0) and flat.tail_s == pytest.approx(10.0)
    steep = decide([_replica(0, 3, STEEP), _replica(1, 1, STEEP)], 32, cfg)
    # steep: A 10 steps x 3 s = 30 s, B 10 s; moved: A 10 x 4 = 40 s. 0.5 x (40 - 20) - 2 x 10 = -10 < 0
    assert steep.kind == "none" and not steep.moves
    assert steep.scores["consolidate"] == pytest.approx(-10.0)
    # a move's re-prefill counts: 12 s for B's request turns the flat case's gain into a loss
    costly = decide([_replica(0, 3, FLAT), _replica(1, 1, FLAT)], 32, ConsolidationConfig(move_s=12.0, train_value=0.5))
    assert costly.kind == "none"  # 0.5 x (22 - 0) - 2 x 12 = -13
    assert decide([_replica(0, 3, FLAT), _replica(1, 1, FLAT)], 32, ConsolidationConfig(mode="off")).moves == ()


def test_auto_consolidates_before_rlhfuses_trigger_when_it_pays():
    """12 of a 32-request step still run (37%: above RLHFuse's 20% trigger). On a flat curve,
    moving B's 2 requests (5 tokens left) onto A (10 requests, 20 tokens left) costs nothing
    and frees B for A's 20 s: auto moves them, the fixed rule waits."""
    a, b = _replica(0, 10, FLAT, remaining=20.0), _replica(1, 2, FLAT, remaining=5.0)
    auto = decide([a, b], 32, ConsolidationConfig(mode="auto", train_value=0.5))
    # none: A 20 s, B 5 s, idle 15; moved: A 20 s, B idle 20: 0.5 x (20 - 15) - 2 x 0 = 2.5
    assert auto.kind == "consolidate" and auto.score == pytest.approx(2.5) and len(auto.moves) == 2
    assert decide([a, b], 32, ConsolidationConfig(mode="consolidate")).moves == ()  # 12 > 0.2 x 32


def test_a_batch_no_replica_ran_is_not_assumed_cheap():
    """Both replicas ran 16 requests (the only batch measured): piling 32 onto one costs twice
    per step, so auto keeps them apart; once measured flat up to 32 it consolidates."""
    one = StepCurve(((16, 0.05),))
    assert one.cost(32) == pytest.approx(0.10) and one.cost(4) == pytest.approx(0.05)
    assert StepCurve(((1, 1.0), (4, 2.0))).cost(8) == pytest.approx(4.0)  # proportional past the last
    a, b = _replica(0, 16, one, remaining=100.0), _replica(1, 16, one, remaining=100.0)
    assert decide([a, b], 32, ConsolidationConfig(mode="auto", max_batch=64)).kind == "none"
    flat = StepCurve(((16, 0.05), (32, 0.05)))
    a, b = _replica(0, 16, flat, remaining=100.0), _replica(1, 16, flat, remaining=100.0)
    assert decide([a, b], 32, ConsolidationConfig(mode="auto", max_batch=64)).kind == "consolidate"


def test_config_errors_name_the_key():
    for kw, key in [({"mode": "x"}, "mode"), ({"knee": 0}, "knee"), ({"remaining_share": 2}, "remaining_share"),
                    ({"max_batch": 0}, "max_batch"), ({"kv_request_bytes": 1}, "kv_request_bytes"),
                    ({"move_s": -1}, "move_s"), ({"train_value": -1}, "train_value")]:
        with pytest.raises(ValueError, match=key):
            ConsolidationConfig(**kw)
