"""The replica's parts without Ray: the request batcher (continuous batching, abort and resume), the
serving lock around a generation, the policy copy, the drift probe and the step statistics."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import types

import pytest
import torch

from tlt.drafter.model_config import ModelConfig
from tlt.rollout.generate import SamplingParams
from tlt.rollout.target import TargetModel
from tlt.integrations.verl.batcher import Generation, RequestBatcher
from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.request import RequestState
from tlt.integrations.verl.step_stats import StepStats, replica_fields
from tlt.integrations.verl.weight_sync import DriftProbe, copy_policy

P = SamplingParams(temperature=0.0, max_new_tokens=4)


def _target(seed: int = 0) -> TargetModel:
    torch.manual_seed(seed)
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return TargetModel(cfg).eval()


def _batcher_engine(max_batch: int = 4, **paged):
    return RolloutEngine(_target(0), EngineConfig(max_batch=max_batch, max_len=256, **paged))


def _serving(on_open=lambda: None, on_close=lambda gen: None):
    """A ``serving()`` for the batcher: ``on_open()`` entering, ``on_close(generation)`` leaving."""
    @contextlib.contextmanager
    def serving():
        on_open()
        done = []
        yield done.append
        for gen in done:
            on_close(gen)
    return serving


def _state(i: int, n: int = 40) -> RequestState:
    return RequestState((1 + i, 2, 3), SamplingParams(temperature=1.0, max_new_tokens=n), seed=100 + i, group=i)


async def _until(cond, timeout_s: float = 30.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, "timed out"
        await asyncio.sleep(0.001)


def test_batcher_joins_running_generations_and_reports_idle():
    """Requests arriving together start one generation; one arriving while it runs joins it at a
    step boundary; more than max_batch wait for a free row. Every result equals an uninterrupted
    run's (the same seeds); on_idle fires once per drain, opens and closes pair up."""
    eng, idle, events = _batcher_engine(), [], []
    ref = _batcher_engine().generate([_state(i).prompt for i in range(6)], [_state(i).params for i in range(6)],
                                     seeds=[_state(i).seed for i in range(6)]).outputs

    async def main():
        b = RequestBatcher(lambda: eng, window_s=0.02, max_batch=4, on_idle=lambda: idle.append(len(eng.steps)),
                           serving=_serving(lambda: events.append("open"), lambda g: events.append(len(g.finished))))
        first = [asyncio.ensure_future(b.submit(_state(i), f"r{i}")) for i in range(2)]
        await _until(lambda: len(eng.steps) >= 3)
        later = [asyncio.ensure_future(b.submit(_state(i), f"r{i}")) for i in range(2, 6)]  # 2 join, 2 wait
        outs = await asyncio.gather(*first, *later)
        assert [list(f.state.output) for f in outs] == ref
        assert all(f.reason == "length" for f in outs) and b.idle
        with pytest.raises(ValueError, match="max_len"):  # refused alone, before any generation
            await b.submit(RequestState((1,) * 250, SamplingParams(max_new_tokens=8), 0), "bad")
        await _until(lambda: len(idle) == 1)  # the drain ends just after its last answer
        again = await b.submit(_state(0), "r0")
        assert list(again.state.output) == ref[0]
        await _until(lambda: len(idle) == 2)

    asyncio.run(asyncio.wait_for(main(), 120))  # a lost answer fails, never hangs
    assert eng.lifecycle["joined"] >= 2
    assert events == ["open", 6, "open", 1] and len(idle) == 2


def test_batcher_admits_by_free_blocks_and_evicted_requests_come_back_identical():
    """A paged engine whose pool holds about two of the six requests: the batcher hands every request
    to the engine, whose queue admits them as blocks free up and evicts when the running ones outgrow
    the pool; every answer is the uninterrupted run's, under one request id each, and the
    generation's record counts the evictions."""
    paged = dict(block_size=8, kv_blocks=14)  # a request needs up to ceil((3 + 40 + 1 + 8 draft) / 8) = 7
    eng, gens = _batcher_engine(8, **paged, max_draft_tokens=8), []
    ref = _batcher_engine().generate([_state(i).prompt for i in range(6)], [_state(i).params for i in range(6)],
                                     seeds=[_state(i).seed for i in range(6)]).outputs

    async def main():
        b = RequestBatcher(lambda: eng, window_s=0.02, max_batch=8, serving=_serving(on_close=gens.append))
        outs = await asyncio.gather(*(b.submit(_state(i), f"r{i}") for i in range(6)))
        assert [list(f.state.output) for f in outs] == ref
        assert all(f.reason == "length" for f in outs) and len({f.rid for f in outs}) == 6

    asyncio.run(asyncio.wait_for(main(), 120))
    assert gens[0].lifecycle["evicted"] > 0 and sum(s.evicted for s in gens[0].steps) == gens[0].lifecycle["evicted"]
    assert eng.pool.free == eng.pool.capacity
    stats = StepStats()  # what verl's metrics read: evictions and the tokens prefilled again
    g = gens[0]
    stats.batch(g)
    fields = replica_fields([stats.snapshot()], g.started, g.started + g.seconds)
    assert fields["replica_evicted"] == [g.lifecycle["evicted"]]
    assert fields["replica_recomputed"] == [sum(s.recomputed for s in g.steps)] and fields["replica_recomputed"][0] > 0


def test_a_moved_requests_tokens_are_counted_once_over_the_two_replicas():
    """A request leaves one replica's generation after some tokens and finishes on another's: the
    step statistics (the denominator of ``tlt/sd_token_share``) count each token where it was made."""
    stats = [StepStats(), StepStats()]
    engines = [_batcher_engine(), _batcher_engine()]
    a, b = (RequestBatcher(lambda e=e: e, window_s=0.01, max_batch=4, serving=_serving(on_close=s.batch))
            for e, s in zip(engines, stats))

    async def main():
        fut = asyncio.ensure_future(a.submit(_state(0, 120), "r0"))
        await _until(lambda: max(engines[0].progress().values(), default=0) >= 30)
        a.leave(["r0"])
        left = await fut
        assert left.reason == "left" and 30 <= len(left.state.output) < 120
        return left, await b.submit(left.state, "r0")

    left, fin = asyncio.run(asyncio.wait_for(main(), 120))
    assert len(fin.state.output) == 120 and fin.state.output[:len(left.state.output)] == left.state.output
    made_there = len(left.state.output)
    assert [s.snapshot()["tokens"] for s in stats] == [made_there, 120 - made_there]


def test_batcher_abort_returns_partial_outputs_holds_requests_until_resume_and_rejects():
    eng = _batcher_engine()
    ref = _batcher_engine().generate([_state(i, 120).prompt for i in range(3)], [_state(i, 120).params for i in range(3)],
                                     seeds=[_state(i).seed for i in range(3)]).outputs

    async def main():
        b = RequestBatcher(lambda: eng, window_s=0.01, max_batch=4)
        running = [asyncio.ensure_future(b.submit(_state(i, 120), f"r{i}")) for i in range(2)]
        await _until(lambda: len(eng.steps) >= 5)
        assert await b.abort("r1")  # one request: the other keeps decoding
        one = await running[1]
        assert one.reason == "aborted" and 0 < len(one.state.output) < 120
        assert not await b.abort("nobody")
        keys = await b.abort_all()
        part = await running[0]
        assert keys == ["r0"] and part.reason == "aborted" and 0 < len(part.state.output) < 120
        held = asyncio.ensure_future(b.submit(_state(2, 120), "r2"))  # arrives while aborted: waits
        await asyncio.sleep(0.1)
        assert not held.done() and not eng.active
        b.resume()
        assert list((await held).state.output) == ref[2]
        resumed = await asyncio.gather(b.submit(part.state, "r0"), b.submit(one.state, "r1"))  # going on
        assert [list(f.state.output) for f in resumed] == ref[:2]  # as if never aborted
        await b.abort_all(reject=True)
        rejected = await b.submit(_state(2, 120), "r2")
        assert rejected.reason == "aborted" and rejected.state.output == ()
        b.resume()

    asyncio.run(asyncio.wait_for(main(), 120))  # a lost answer fails, never hangs
    assert eng.lifecycle["aborted"] == 2


def test_a_generation_that_cannot_start_or_fails_fails_its_requests_and_serving_goes_on():
    eng = _batcher_engine()
    opens = []

    def on_open():
        opens.append(1)
        if len(opens) == 1:
            raise RuntimeError("the spot agent did not stop")

    real = eng.step
    fail = [True]

    def step():
        if fail[0] and eng.running:
            fail[0] = False
            raise RuntimeError("a step broke")
        return real()

    eng.step = step

    async def main():
        b = RequestBatcher(lambda: eng, window_s=0.01, max_batch=4, serving=_serving(on_open))
        with pytest.raises(RuntimeError, match="did not stop"):
            await b.submit(_state(0), "a")
        with pytest.raises(RuntimeError, match="a step broke"):
            await b.submit(_state(1), "b")
        assert not eng.active  # the failed generation's requests left the engine
        done = await b.submit(_state(2), "c")
        assert done.reason == "length" and b.idle

    asyncio.run(asyncio.wait_for(main(), 120))  # a lost answer fails, never hangs


@pytest.mark.parametrize("where", ["add", "abort"])
def test_a_generation_that_fails_adding_or_aborting_answers_every_request_and_abort(where):
    """An engine error other than a refusal (e.g. out of memory restoring a released cache in
    ``add``, or the sink failing as ``abort`` hands requests over) fails the requests being added
    with the ones running, and an abort-all taken in that step returns: nobody waits forever."""
    eng = _batcher_engine()
    real = getattr(eng, where)
    broken = [True]

    def fail_once(*args, **kwargs):
        if broken[0] and (where == "add" or eng.running):
            broken[0] = False
            raise RuntimeError(f"{where} broke")
        return real(*args, **kwargs)

    setattr(eng, where, fail_once)

    async def main():
        b = RequestBatcher(lambda: eng, window_s=0.05, max_batch=4)
        reqs = [asyncio.ensure_future(b.submit(_state(i, 120), f"r{i}")) for i in range(2)]  # one window
        if where == "abort":
            await _until(lambda: len(eng.steps) >= 3)
            assert sorted(await b.abort_all()) == ["r0", "r1"]
            b.resume()
        for r in reqs:
            with pytest.raises(RuntimeError, match=f"{where} broke"):
                await r
        assert b.idle and not eng.active
        done = await b.submit(_state(2, 4), "r2")  # serving goes on
        assert done.reason == "length" and b.idle

    asyncio.run(asyncio.wait_for(main(), 120))  # a lost answer fails, never hangs
    assert not broken[0]


def test_policy_copy_checks_every_tensor_before_writing():
    model, new = _target(0), _target(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = dict(new.state_dict())
    bad = {**state, "model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}
    with pytest.raises(ValueError, match="up_proj.weight.*shape"):
        copy_policy(model, bad)
    with pytest.raises(ValueError, match="not a tensor of the rollout target"):
        copy_policy(model, {**state, "model.extra.weight": torch.zeros(1)})
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing written
    ptr = model.embed_weight.data_ptr()
    assert copy_policy(model, state) == len(state)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items()) and model.embed_weight.data_ptr() == ptr


def test_drift_probe_compares_the_policies_around_a_push():
    model, lock = _target(0), threading.Lock()
    probe = DriftProbe(model, lock)
    probe.record([[1, 2, 3, 4, 5, 6], [7, 8, 9]])
    probe.before()
    probe.after()  # same weights
    assert probe.top1 == 1.0
    probe.before()
    copy_policy(model, _target(1).state_dict())
    probe.after()
    assert probe.top1 < 0.9
    probe.after()  # no idle forward since the last push: nothing to compare, the figure stays
    assert probe.top1 < 0.9


def test_step_stats_count_eagle_verifies_apart_and_keep_heldout_figures():
    """The push guard's inputs: verifies drafted by the EAGLE proposer (suffix arms excluded) and
    each spot session's held-out accept length with its checkpoint step."""
    import types

    from tlt.drafter.session import SessionResult
    from tlt.rollout.engine import StepRecord
    from tlt.integrations.verl.step_stats import StepStats

    st = StepStats()
    steps = [StepRecord(batch=4, arm="3,1,3", sd=True, accepted=6, committed=10, seconds=0.1),
             StepRecord(batch=2, arm="3,1,3@suffix", sd=True, accepted=4, committed=6, seconds=0.1),
             StepRecord(batch=4, arm="off", sd=False, accepted=0, committed=4, seconds=0.1)]
    st.batch(Generation(finished=[], steps=steps, started=0.0, seconds=0.3, tokens=20))
    res = dict(session_id="s", world_size=1, start_step=0, end_step=2, losses=(1.0, 0.9),
               stop_reason="preempted", preempt_latency_s=None, stop_latency_s=None, checkpoint_step=2,
               check_interval_s=(), checkpoint_stall_s=())
    st.session(types.SimpleNamespace(result=SessionResult(rank=0, heldout_accept_length=2.5, **res)))
    st.session(types.SimpleNamespace(result=SessionResult(rank=1, heldout_accept_length=2.5, **res)))
    snap = st.snapshot()
    assert (snap["verifies"], snap["committed"]) == (6, 16)
    assert (snap["eagle_verifies"], snap["eagle_committed"]) == (4, 10)
    # per arm: the summary compares drafters at the same strategy
    assert snap["arm_verifies"] == {"3,1,3": 4, "3,1,3@suffix": 2}
    assert snap["arm_committed"] == {"3,1,3": 10, "3,1,3@suffix": 6}
    assert snap["heldout"] == [(2, 2.5)]  # once per session (rank 0 reports it)


def test_step_stats_time_the_replicas_decoding_span():
    """The first batch's start and the last batch's end: the trainer reports the rollout's time
    outside the replicas' decoding (before the first batch, after the last)."""
    import types

    from tlt.integrations.verl.step_stats import StepStats, replica_fields

    st = StepStats()
    assert (st.snapshot()["first_at"], st.snapshot()["done_at"]) == (None, None)
    for started, gen_s, counts in ((10.0, 2.0, {"left": 2, "joined": 1}), (12.5, 1.0, {"aborted": 1, "left": 1})):
        st.batch(Generation(finished=[], steps=[], started=started, seconds=gen_s, tokens=1, lifecycle=counts))
    st.session(types.SimpleNamespace(result=types.SimpleNamespace(
        tokens_per_s=None, preempt_latency_s=None, phase_s=(0.1, 0.2, 1.5, 0.0), rank=1)))  # 1.5 s training
    snap = st.snapshot()
    assert (snap["first_at"], snap["done_at"], snap["batches"]) == (10.0, 13.5, 2)
    idle = StepStats().snapshot()  # a replica that decoded nothing this step
    fields = replica_fields([snap, idle], began=9.5, ended=14.0)
    assert fields["replica_lead_s"] == [0.5, None] and fields["replica_trail_s"] == [0.5, None]
    assert fields["replica_gen_s"] == [3.0, 0.0] and fields["replica_batches"] == [2, 0]
    assert fields["replica_train_s"] == [1.5, 0.0]
    assert fields["replica_moved"] == [3, 0] and fields["replica_aborted"] == [1, 0]
    st.reset()
    assert st.snapshot()["first_at"] is None


def test_captured_features_feed_the_buffer():
    from tlt.drafter.buffer import BufferConfig, DataBuffer
    from tlt.integrations.verl.config import TLTConfig
    from tlt.integrations.verl.replica_core import ReplicaCore
    from tlt.integrations.verl.server import TLTServer
    from tlt.integrations.verl.spot_wiring import add_captured

    buf = DataBuffer(BufferConfig(dtype="float32", max_bytes=1 << 20))
    ids, mask = torch.arange(6), torch.tensor([0, 0, 1, 1, 1, 1], dtype=torch.bool)
    assert add_captured(buf, 3, [(ids, mask, torch.randn(6, 8), None)] * 2) == 2
    with pytest.raises(ValueError, match="captured sample 0: .* got 3 fields"):
        add_captured(buf, 3, [(ids, mask, torch.randn(6, 8))])
    server = object.__new__(TLTServer)  # its add_samples is the replica core's (SGLang's server's too)
    server.core = ReplicaCore(TLTConfig.from_mapping({}), rank=0, seed=0, spot_root="")
    assert server.add_samples(1, [(ids, mask, torch.randn(6, 8), None)]) == 1


def test_a_long_run_through_the_batcher_keeps_bounded_memory():
    """5,000 engine steps over 50 generations: the engine hands each generation's step records to
    ``on_close`` and keeps none, and the Python heap grows by less than 2 MB (an engine keeping every
    step, as it used to, holds each record and fails the first check)."""
    import tracemalloc

    eng, gens = _batcher_engine(), []
    params = SamplingParams(temperature=1.0, max_new_tokens=101, stop_ids=())

    async def main():
        b = RequestBatcher(lambda: eng, window_s=0.001, max_batch=4,
                           serving=_serving(on_close=lambda g: gens.append(len(g.steps))))
        for g in range(50):
            await asyncio.gather(*(b.submit(RequestState((1 + i, 2, 3), params, seed=g * 4 + i, group=i), f"g{g}r{i}")
                                   for i in range(2)))
            await _until(lambda: len(gens) == g + 1)  # the answers come before the generation closes
            if g == 4:  # after warm-up: allocator pools and caches are filled
                tracemalloc.start()
                before = tracemalloc.take_snapshot()
            assert len(eng.steps) == 0, f"generation {g}: the engine kept {len(eng.steps)} step records"
        return before

    before = asyncio.run(asyncio.wait_for(main(), 300))
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    assert len(gens) == 50 and sum(gens) >= 5000 and eng.steps_run == sum(gens)
    assert grown < 2e6, f"the heap grew {grown / 1e6:.1f} MB over 45 generations"


def test_a_replica_frees_its_kv_cache_between_generations_only():
    """verl's sleep / release_kv_cache take the serving lock, which a generation holds from its start
    to its end: a release waits for a running generation, keeps the memory of an engine with
    requests (and says so), and frees an idle one's; wake_up allocates it again."""
    pytest.importorskip("ray", reason="the verl extra is not installed (pip install 'tlt-rollout[verl]')")
    import types

    from tlt.integrations.verl.server import TLTServer

    eng = _batcher_engine()
    eng.generate([_state(0).prompt], _state(0).params)
    replica = types.SimpleNamespace(_lock=threading.Lock(), engine=eng, rank=0)
    replica._lock.acquire()  # a generation is running
    freed = []
    t = threading.Thread(target=lambda: freed.append(TLTServer._release_memory(replica)))
    t.start()
    time.sleep(0.2)
    assert not freed and not eng.cache.released  # waits for the generation's end
    replica._lock.release()
    t.join(10)
    assert freed[0] == eng.cache.k.numel() * 2 * eng.cache.k.element_size() and eng.cache.released
    TLTServer._restore_memory(replica)
    assert not eng.cache.released
    eng.add([_state(1)])  # requests in the engine: nothing is freed
    assert TLTServer._release_memory(replica) == 0 and not eng.cache.released
    eng.abort()


def test_a_generation_holds_the_serving_lock_from_its_first_step_to_its_last():
    """The replica's ``_serving`` (one function takes and releases the lock): every engine step runs
    under the serving lock, training is stopped before the first, the probe and the statistics get
    the generation; an agent that cannot stop fails the waiting requests and leaves the lock free (a
    lock left held would stop every later generation, weight push and drafter swap)."""
    from tlt.integrations.verl.config import TLTConfig
    from tlt.integrations.verl.replica_core import ReplicaCore
    from tlt.integrations.verl.server import TLTServer

    events, eng = [], _batcher_engine()
    server = object.__new__(TLTServer)  # the serving part without a model, Ray or a coordinator
    from tlt.integrations.verl.moves import ReplicaMoves

    server._lock, server.moves = threading.Lock(), ReplicaMoves()
    server.moves.decide_idle(True)  # IDLE was sent: the generation clears it
    assert server.moves.idle_sent
    server.core = ReplicaCore(TLTConfig.from_mapping({}), rank=0, seed=0, spot_root="")
    server.probe = types.SimpleNamespace(size=1, record=lambda seqs: events.append(("probe", len(seqs))))

    class Agent:
        broken = False

        def busy(self, step):
            events.append(("busy", server._lock.locked()))
            if self.broken:
                raise RuntimeError("the spot session did not stop")

    server.core.agent = Agent()
    real = eng.step

    def step():
        events.append(("step", server._lock.locked()))
        return real()

    eng.step = step

    async def main():
        b = RequestBatcher(lambda: eng, window_s=0.01, max_batch=4, serving=server._serving)
        await asyncio.gather(*(b.submit(_state(i, 6), f"r{i}") for i in range(2)))
        await _until(lambda: server.core.stats.snapshot()["batches"] == 1)
        server.core.agent.broken = True
        with pytest.raises(RuntimeError, match="did not stop"):
            await b.submit(_state(3, 6), "r3")

    asyncio.run(asyncio.wait_for(main(), 60))
    steps = [held for what, held in events if what == "step"]
    assert events[0] == ("busy", True) and len(steps) >= 5 and all(steps)  # 6 tokens: the prefill gives one
    assert ("probe", 1) in events and not server.moves.idle_sent and not server._lock.locked()
    assert events[-1] == ("busy", True)  # the second generation never stepped


@pytest.mark.parametrize("ends", ["failed", "dropped"])
def test_a_request_that_ends_while_leaving_can_leave_again(ends):
    """A request asked to move (``ReplicaMoves.leave``) that fails, or is dropped by tail batching,
    before its move took effect is no longer leaving: verl resubmits it under the same id, and a
    later move of it must not be skipped as already under way."""
    pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'tlt-rollout[verl]')")
    from tlt.integrations.verl.moves import ReplicaMoves
    from tlt.integrations.verl.server import TLTServer
    from tlt.rollout.request import Finished

    server = object.__new__(TLTServer)  # generate's bookkeeping without a model, Ray or an engine
    server.forwarding = types.SimpleNamespace(stale=False)
    server.max_len, server.response_length, server.seed, server.weight_version = 64, 16, 0, 3
    server.model = types.SimpleNamespace(config=types.SimpleNamespace(eos_ids=(0,)))
    server._partial, server._dropping, server.moves = {}, ends == "dropped", ReplicaMoves()

    async def submit(state, key):
        assert server.moves.leave([key], "server-2", lambda keys: keys) == []  # asked to move: under way
        if ends == "failed":
            raise RuntimeError("the generation failed")
        return Finished(0, state, "aborted")

    server.batcher = types.SimpleNamespace(submit=submit)
    assert server.moves.leave(["r0"], "server-1", lambda keys: keys) == ["r0"]

    async def main():
        if ends == "failed":
            with pytest.raises(RuntimeError, match="generation failed"):
                await server.generate("r0", [1, 2, 3], {"temperature": 1.0})
        else:
            out = await server.generate("r0", [1, 2, 3], {"temperature": 1.0})
            assert out.token_ids == [] and out.stop_reason == "tlt_dropped"

    asyncio.run(main())
    assert server.moves.leave(["r0"], "server-2", lambda keys: keys) == ["r0"] and server.moves.moved_out == 0


def test_a_step_begins_though_a_session_outlives_its_stop():
    """``begin_step`` asks a running session to stop; one that outlives the wait is logged and the
    step goes on (the replica's next generation waits for it again, and fails its requests if it
    still runs: ``_serving``), so the driver's step start is not where the run ends."""
    from tlt.integrations.verl.config import TLTConfig
    from tlt.integrations.verl.moves import ReplicaMoves
    from tlt.integrations.verl.replica_core import ReplicaCore
    from tlt.integrations.verl.server import TLTServer
    from tlt.spot_agent import TrainingDidNotStop

    server = object.__new__(TLTServer)  # the step's start without a model, Ray or a coordinator
    server.rank, server.moves = 0, ReplicaMoves()
    server.core = ReplicaCore(TLTConfig.from_mapping({}), rank=0, seed=0, spot_root="")

    class Stuck:
        training = True

        def busy(self, step):
            raise TrainingDidNotStop("session 3 did not stop within busy_timeout_s=300s")

    server.core.agent = Stuck()
    server.begin_step(4)
    assert server.core.step == 4
    asyncio.run(server.end_rollout())  # (logged too)


def test_a_rollout_ends_with_no_session_training():
    """A session whose STOP timed out at the coordinator (its final checkpoint slower than the
    barrier's wait) is waited out when the rollout ends, before verl's update uses the device;
    one already stopped is left alone."""
    from tlt.integrations.verl.config import TLTConfig
    from tlt.integrations.verl.replica_core import ReplicaCore
    from tlt.integrations.verl.server import TLTServer

    server = object.__new__(TLTServer)
    server.rank, server.core = 0, ReplicaCore(TLTConfig.from_mapping({}), rank=0, seed=0, spot_root="")
    server.core.step = 6
    calls = []

    class Late:
        training = True

        def busy(self, step):
            calls.append(step)
            self.training = False

    server.core.agent = Late()
    asyncio.run(server.end_rollout())
    asyncio.run(server.end_rollout())
    assert calls == [6]


@pytest.mark.parametrize("case", ["refused", "unreadable"])
def test_a_drafter_the_engine_refuses_leaves_the_previous_one_serving(monkeypatch, case):
    """A pushed drafter the engine refuses (no room in its memory), or whose checkpoint this replica
    cannot read (a spot root its node does not see): the replica serves its drafter on under the
    pushed version (so the push guard's read-back rejects the push), and the guard's rollback
    serves that same drafter again, not the one before it."""
    from tlt.integrations.verl import server as server_module
    from tlt.integrations.verl.config import TLTConfig
    from tlt.integrations.verl.replica_core import ReplicaCore
    from tlt.integrations.verl.server import TLTServer

    old, new, served = object(), object(), []

    class Assembly:
        proposer_name = "eagle"

        def set_drafter(self, d):
            if d is new:
                raise ValueError("these proposers keep 512 bytes per block")
            served.append(d)

    server = object.__new__(TLTServer)
    server._lock, server.rank, server.assembly = threading.Lock(), 0, Assembly()
    server.spot_root, server.drafter_cfg = "", None
    server.model = types.SimpleNamespace(embed_weight=None, lm_head=types.SimpleNamespace(weight=None))
    server.core = ReplicaCore(TLTConfig.from_mapping({}), rank=0, seed=0, spot_root="")
    server.core.drafters.push(object(), 2)  # the one served before the current one
    server.core.drafters.push(old, 3)
    monkeypatch.setattr(server_module, "load_spot_drafter", lambda *a: (new, 7) if case == "refused" else None)
    assert server._load_drafter(4, 7) == 4
    assert server.core.drafters.served is old and server.core.drafters.version == 4
    assert server._rollback_drafter(5) == 5 and served == [old] and server.core.drafters.served is old
    assert server._rollback_drafter(6) == 5  # once only
