"""The engine's queue on its own (:class:`tlt.rollout.scheduler.Scheduler`): admission by rows and
by free blocks, evicted requests back at the front, the lifecycle counts, removal."""

from __future__ import annotations

import pytest

from tlt.rollout.blocks import BlockPool
from tlt.rollout.generate import SamplingParams
from tlt.rollout.request import Finished, RequestState
from tlt.rollout.scheduler import Scheduler


def _req(prompt_len: int, out: int = 0) -> RequestState:
    return RequestState(tuple(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=64), seed=0,
                        output=tuple(range(out)), logprobs=(0.0,) * out)


def test_rows_bound_admission_and_ids_follow_arrival():
    s = Scheduler(max_batch=3, pool=None, eviction="youngest")
    assert s.add([_req(4), _req(4)]) == [0, 1] and s.add([_req(4), _req(4)]) == [2, 3]
    assert s.admissible(0) == 3 and s.admissible(2) == 1 and s.admissible(3) == 0
    assert [rid for rid, _ in s.take(3, 0)] == [0, 1, 2]
    assert s.lifecycle["joined"] == 0  # a generation's first batch joins nothing
    assert [rid for rid, _ in s.take(1, 3)] == [3] and s.lifecycle["joined"] == 1


def test_free_blocks_bound_admission_sparing_each_running_row_a_block():
    pool = BlockPool(11, 4)  # 10 blocks of 4 positions (and the scratch block)
    s = Scheduler(max_batch=8, pool=pool, eviction="youngest")
    s.add([_req(7), _req(7), _req(7)])  # 7 prompt + 1 pending = 2 blocks, + 1 spare each
    assert s.admissible(0) == 3  # 3 x 3 = 9 of 10
    assert s.admissible(2) == 2  # 2 spared for the running rows: 8 left, 2 x 3 fit
    pool.grow("x", 40)  # the pool full
    assert s.admissible(0) == 1 and s.admissible(1) == 0  # an idle pool still takes one (the engine checked it fits)


def test_evicted_requests_wait_at_the_front_and_count_their_recompute():
    pool = BlockPool(64, 4)
    s = Scheduler(max_batch=4, pool=pool, eviction="youngest")
    s.add([_req(5), _req(5), _req(5)])
    running = [rid for rid, _ in s.take(3, 0)]
    for rid in running:
        pool.grow(rid, 8)
    s.add([_req(5)])
    victims = s.victims(running, {rid: 8 for rid in running}, short=2)
    assert victims == [2]  # the youngest admitted frees its 2 blocks
    left = _req(5, out=3)
    for rid in victims:
        pool.release(rid)
        s.left_row(rid)
    s.evicted([Finished(2, left, "evicted")])
    assert [rid for rid, _ in s.queue] == [2, 3] and s.holds_evicted
    assert s.step_counts() == (1, 0) and s.step_counts() == (0, 0)
    assert [rid for rid, _ in s.take(2, 2)] == [2, 3]
    assert s.step_counts() == (0, 5 + 3 - 1)  # its prompt and tokens, but the pending one, prefilled again
    assert s.lifecycle == {"evicted": 1, "joined": 1} and not s.holds_evicted
    s.evicted([Finished(3, _req(5, out=1), "evicted")])
    assert s.holds_evicted and s.remove([3], running=[0, 1, 2], reason="aborted")[0].rid == 3
    assert not s.holds_evicted  # an evicted request aborted while it waits no longer holds its generation


def test_removal_names_running_or_waiting_requests_once():
    s = Scheduler(max_batch=1, pool=None, eviction="youngest")
    s.add([_req(3), _req(3), _req(3)])
    s.take(1, 0)
    out = s.remove([1, 0], running=[0], reason="aborted")
    assert [f.rid for f in out] == [1] and [rid for rid, _ in s.queue] == [2]  # the engine retires row 0
    assert s.lifecycle["aborted"] == 2
    with pytest.raises(ValueError, match="not running or waiting here"):
        s.remove([7], running=[0], reason="left")
    with pytest.raises(ValueError, match="given twice"):
        s.remove([2, 2], running=[], reason="left")

