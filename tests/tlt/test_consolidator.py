"""Moves without Ray: the batcher lets named requests leave and publishes its load, the router
pins a moved request to its destination, verl's client (wrapped) returns one answer across hops,
and the driver's view of the replicas feeds consolidation. The whole path through Ray actors,
with kills, is tests/integrations/test_verl_moves.py."""

from __future__ import annotations

import asyncio

import pytest

from tlt.integrations.verl.batcher import RequestBatcher
from tlt.integrations.verl.moves import MOVED, MOVED_KEY, MovingClient, moved_in
from tlt.integrations.verl.consolidator import remaining_tokens, replica_loads
from tlt.rollout.generate import SamplingParams
from tlt.rollout.request import RequestState
from tests.tlt.test_replica_parts import _batcher_engine, _state, _until


def test_batcher_leave_hands_each_request_its_state_and_it_goes_on_elsewhere():
    """Two requests decode; one leaves at a step boundary with its tokens so far, joins another
    engine and ends token for token as if it never moved. A request waiting in the engine's queue leaves
with nothing generated. The
    published load lists the running requests with their progress and the step cost by batch."""
    eng, other = _batcher_engine(2), _batcher_engine(2)
    ref = _batcher_engine().generate([_state(i, 60).prompt for i in range(3)], [_state(i, 60).params for i in range(3)],
                                     seeds=[_state(i).seed for i in range(3)]).outputs

    async def main():
        b = RequestBatcher(lambda: eng, window_s=0.01, max_batch=2, track_load=True)
        c = RequestBatcher(lambda: other, window_s=0.01, max_batch=2)
        calls = [asyncio.ensure_future(b.submit(_state(i, 60), f"r{i}")) for i in range(3)]  # r2 waits for a row
        await _until(lambda: len(eng.steps) >= 4)
        load = b.load()
        assert sorted(k for k, *_ in load.requests) == ["r0", "r1"]
        assert all(0 < have < 60 and budget == 60 for _, have, _, budget in load.requests)
        assert load.step_s and all(s > 0 for s in load.step_s.values()) and load.tokens_per_step >= 1
        assert b.leave(["r1", "r2", "nobody"]) == ["r1", "r2"]
        moved, queued = await calls[1], await calls[2]
        assert moved.reason == "left" and 0 < len(moved.state.output) < 60
        assert queued.reason == "left" and queued.state.output == ()
        on = await asyncio.gather(c.submit(moved.state, "r1"), c.submit(queued.state, "r2"))
        assert [list(f.state.output) for f in on] == ref[1:]
        assert list((await calls[0]).state.output) == ref[0]
        await _until(lambda: b.idle and not b.load().requests)

    asyncio.run(asyncio.wait_for(main(), 120))
    assert eng.lifecycle["left"] == 2 and other.lifecycle["joined"] == 0


def test_router_pins_a_moved_request_and_counts_follow_it():
    pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'tlt-rollout[verl]')")
    from tlt.integrations.verl.router import GroupRouter

    router = GroupRouter({"a": "ha", "b": "hb"})
    assert "tlt_to" in router.require_acquire_fields()
    sid, _ = router.acquire_server("q", prompt_ids=[1, 2])
    other = "b" if sid == "a" else "a"
    router.release_server(sid, request_id="q")  # the source answered (moved)
    assert router.acquire_server("q", prompt_ids=[1, 2], tlt_to=other) == (other, {"a": "ha", "b": "hb"}[other])
    assert router.get_status()["servers"] == {sid: 0, other: 1}
    router.release_server(other, request_id="q")
    assert router.get_total_inflight() == 0
    assert router.acquire_server("r", prompt_ids=[3], tlt_to="gone")[0] in ("a", "b")  # unknown: routed by load


class _Inner:
    """verl's client as seen from the wrapper: answers from a script of (tokens, moved-to) hops."""

    def __init__(self, hops):
        self.hops, self.calls = list(hops), []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
        from verl.workers.rollout.replica import TokenOutput

        self.calls.append(kw)
        toks, to, state = self.hops.pop(0)
        extra = {"global_steps": 3}
        if to is not None:
            extra[MOVED_KEY] = {"to": to, "state": state}
        return TokenOutput(token_ids=toks, log_probs=[-1.0] * len(toks), stop_reason=MOVED if to else "length",
                           extra_fields=extra)


def test_moving_client_returns_one_answer_across_hops():
    pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'tlt-rollout[verl]')")
    p = SamplingParams(max_new_tokens=8)
    s1 = RequestState((1, 2), p, 5, output=(7, 8), logprobs=(-1.0, -1.0))
    s2 = RequestState((1, 2), p, 5, output=(7, 8, 9), logprobs=(-1.0,) * 3)
    inner = _Inner([([7, 8], "b", s1), ([9], "a", s2), ([4, 4, 4], None, None)])
    out = asyncio.run(MovingClient(inner).generate("q", prompt_ids=[1, 2], sampling_params={}))
    assert out.token_ids == [7, 8, 9, 4, 4, 4] and len(out.log_probs) == 6 and out.stop_reason == "length"
    assert out.extra_fields["tlt_hops"] == 2 and MOVED_KEY not in out.extra_fields
    assert [c.get("tlt_to") for c in inner.calls] == [None, "b", "a"]
    assert inner.calls[1]["tlt_state"] is s1 and inner.calls[2]["tlt_state"] is s2
    plain = _Inner([([3], None, None)])
    assert asyncio.run(MovingClient(plain).generate("q", prompt_ids=[1], sampling_params={})).token_ids == [3]
    wrong = _Inner([([7], "b", s1)])  # the state's tokens are not the ones answered: refused, not merged
    with pytest.raises(RuntimeError, match="not the 1 the client received"):
        asyncio.run(MovingClient(wrong).generate("q", prompt_ids=[1, 2], sampling_params={}))


def test_a_moved_state_must_match_its_prompt():
    st = RequestState((1, 2), SamplingParams(max_new_tokens=4), 0)
    assert moved_in(st, [1, 2]) is st
    with pytest.raises(ValueError, match="prompt differs"):
        moved_in(st, [1, 3])
    with pytest.raises(ValueError, match="must be a RequestState"):
        moved_in({"prompt": [1, 2]}, [1, 2])


def test_remaining_tokens_from_the_last_steps_lengths():
    assert remaining_tokens(10, 64, [5, 20, 40]) == pytest.approx(((20 - 10) + (40 - 10)) / 2)
    assert remaining_tokens(50, 64, [5, 20, 40]) == 14  # longer than every earlier one: its budget left
    assert remaining_tokens(10, 64, []) == 54
    assert remaining_tokens(60, 64, [200]) == 4  # never past the budget


def test_replica_loads_pool_the_step_costs_and_wait_for_a_measurement():
    loads = [{"rank": 0, "requests": [("q0", 10, 4, 64)], "step_s": {1: 0.010, 2: 0.012}, "join_s": None,
              "tokens_per_step": 2.0, "training": False},
             {"rank": 1, "requests": [], "step_s": {1: 0.014}, "join_s": 0.03, "tokens_per_step": 1.0,
              "training": True}]
    view = replica_loads(loads, [30])
    assert [r.rank for r in view] == [0, 1] and view[1].training and not view[0].training
    assert view[0].curve.cost(1) == pytest.approx(0.012) and view[0].curve.cost(2) == pytest.approx(0.012)
    assert view[0].requests[0].remaining == 20 and view[0].tokens_per_step == 2.0
    assert replica_loads([{**loads[1], "step_s": {}}], []) is None


def test_move_config_is_validated_and_needs_the_tlt_backend_router_and_agent_loop():
    pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'tlt-rollout[verl]')")
    from omegaconf import OmegaConf

    from tlt.integrations.verl.config import TLTConfig
    from tlt.integrations.verl.verl_checks import _check_moves

    on = TLTConfig.from_mapping({"tail": {"consolidate": {"mode": "auto"}}})
    assert on.tail.consolidate.rules(16).max_batch == 16
    assert TLTConfig.from_mapping({"tail": {"consolidate": {"mode": False}}}).tail.consolidate.mode == "off"
    for bad, msg in [({"train_value": -1}, "train_value=-1.0"), ({"knee": 0}, "knee=0.0"),
                     ({"move_s": -0.1}, "move_s=-0.1"), ({"remaining_share": 2}, "remaining_share=2.0")]:
        with pytest.raises(ValueError, match=f"tlt.tail.consolidate.{msg}"):
            TLTConfig.from_mapping({"tail": {"consolidate": bad}})

    def cfg(**ro):
        base = {"name": "tlt", "agent": {"default_agent_loop": "tlt_agent"}}
        return OmegaConf.create({"actor_rollout_ref": {"rollout": {**base, **ro}}})

    _check_moves(cfg(), on)
    _check_moves(cfg(router_config_path="/x/tlt_router.yaml"), on)
    for ro, msg in [({"name": "sglang"}, "engine only"), ({"router_config_path": "/mine.yaml"}, "TLT's router"),
                    ({"agent": {"default_agent_loop": "single_turn_agent"}}, "agent loop")]:
        with pytest.raises(ValueError, match=msg):
            _check_moves(cfg(**ro), on)
    with pytest.raises(ValueError, match="TLT's router"):
        _check_moves(cfg(), TLTConfig.from_mapping({"route_groups": False, "tail": {"consolidate": {"mode": "auto"}}}))


def test_a_replica_reserved_as_a_destination_sends_no_idle_and_one_that_sent_idle_refuses():
    """The replica side of a move (``ReplicaMoves``): the reservation and the IDLE decision are
    ordered, so a session never starts where a request is on its way, and never gets one."""
    import time

    from tlt.integrations.verl.moves import ReplicaMoves

    m = ReplicaMoves()
    assert m.reserve(2, 5.0, training=False)
    send, expected = m.decide_idle(True)
    assert not send and expected is not None and not m.idle_sent  # two arrivals expected: no IDLE
    m.arrived()
    assert m.decide_idle(True)[0] is False  # one still expected
    m.arrived()
    assert m.decide_idle(True) == (True, None) and m.idle_sent
    assert not m.reserve(1, 5.0, training=False)  # told its agent it is idle: never a destination
    m.serving()  # a generation ran: a later idle period decides again
    assert not m.reserve(1, 5.0, training=True)  # a spot session runs here
    assert m.reserve(1, 0.05, training=False)
    time.sleep(0.1)
    assert m.decide_idle(True) == (True, None)  # a reservation that ran out holds nothing back
    assert m.decide_idle(False) == (False, None)


def test_a_leaving_request_is_counted_once_it_left_and_forgotten_if_it_finished_first():
    from tlt.integrations.verl.moves import ReplicaMoves

    m = ReplicaMoves()
    assert m.leave(["a", "b", "c"], "server-1", lambda keys: [k for k in keys if k != "c"]) == ["a", "b"]
    assert m.leave(["a"], "server-2", lambda keys: keys) == []  # already leaving: asked once
    assert m.departed("a", left=True) == "server-1" and m.moved_out == 1
    assert m.departed("b", left=False) == "server-1" and m.moved_out == 1  # finished before it moved
    assert m.departed("c", left=False) is None


def test_the_load_meter_separates_plain_steps_from_joins_and_skips_re_prefills():
    from types import SimpleNamespace as NS

    from tlt.integrations.verl.replica_load import LoadMeter

    m = LoadMeter()
    step = lambda batch, committed=None, evicted=0, recomputed=0: NS(batch=batch, committed=committed or batch,  # noqa: E731
                                                                     evicted=evicted, recomputed=recomputed)
    m.measure(step(2), 0.010, joined=1)  # a join before any plain step at batch 2: nothing to compare with
    m.measure(step(2, committed=4), 0.010, joined=0)
    m.measure(step(2, committed=4), 0.020, joined=0)
    m.measure(step(2), 0.045, joined=1)  # 0.030 over the curve at 2 (mean 0.015), one joiner
    m.measure(step(2, evicted=1), 9.0, joined=0)  # a re-prefill: no plain step, no join
    m.publish([("r0", 5, 1, 60)])
    load = m.load()
    assert load.step_s == {2: pytest.approx(0.015)} and load.join_s == pytest.approx(0.030)
    assert load.tokens_per_step == pytest.approx(0.81 * 1.0 + 0.19 * 2.0)  # two updates of 0.1 toward 2 tokens
    assert load.requests == (("r0", 5, 1, 60),)
    m.clear()
    assert m.load().requests == () and m.load().step_s == {2: pytest.approx(0.015)}
