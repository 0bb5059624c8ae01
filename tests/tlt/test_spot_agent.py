"""SpotAgent: endpoint derivation, config errors, and one worker's whole cycle against a real
embedded coordinator (PROMOTE -> SESSION -> FSDP2/gloo world of 1 -> STOP -> checkpoint -> ack).
Multi-rank formations, late joiners and regrouping after a kill are in tests/test_adaptive_loop.py."""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
import threading
import time

import pytest

from tlt.coordinator import Coordinator, CoordinatorConfig, PromotionConfig, WorkerConfig
from tlt.coordinator.protocol import Promote, Role, Session, Stop
from tlt.drafter.checkpoint import latest
from tlt.drafter.spot import SpotTrainer
from tlt.ports import free_port
from simloop import SimConfig, rollout_samples, target
from tlt.spot_agent import AgentConfig, SpotAgent, TrainingDidNotStop, rendezvous_endpoint

HB = 0.05


def test_rendezvous_endpoint():
    assert rendezvous_endpoint("tcp://10.0.0.3:29500", 5, 256) == ("10.0.0.3", 29505)
    assert rendezvous_endpoint("node-1:29500", 300, 256) == ("node-1", 29544)
    for bad in ("tcp://10.0.0.3", "29500", "tcp://:29500"):
        with pytest.raises(ValueError, match="trainer address"):
            rendezvous_endpoint(bad, 0, 16)
    with pytest.raises(ValueError, match="port_span"):
        rendezvous_endpoint("tcp://h:65500", 0, 256)


def test_agent_config_errors_name_the_field():
    for kw, field in [({"port_span": 0}, "port_span"), ({"formation_wait_s": 0}, "formation_wait_s"),
                      ({"busy_timeout_s": -1}, "busy_timeout_s"), ({"nice": 20}, "nice")]:
        with pytest.raises(ValueError, match=field):
            AgentConfig(**kw)
    with pytest.raises(ValueError, match="trainer address"):
        SpotAgent(WorkerConfig(address="tcp://127.0.0.1:1", worker_id="w", trainer_address="nope"),
                  make_trainer=None, batches=None)


def _agent(addr, root, **agent_kw):
    dcfg, embed, head = target()
    samples = rollout_samples(0, 16)
    spot = SimConfig(durations=((0,), (0,))).spot

    def make_trainer(spec):
        return SpotTrainer(spec=spec, config=dataclasses.replace(spot, interval=2),
                           drafter_config=dcfg, embed_weight=embed, head_weight=head, checkpoint_root=root)

    def batches(f):
        calls = itertools.count()
        return lambda budget: samples[next(calls) % 4::4]

    return SpotAgent(WorkerConfig(address=addr, worker_id="w0", trainer_address=f"tcp://127.0.0.1:{free_port(16)}",
                                  heartbeat_interval_s=HB, liveness=40),
                     make_trainer=make_trainer, batches=batches, config=AgentConfig(port_span=16, **agent_kw))


def test_idle_and_busy_report_in_the_order_they_take_effect(tmp_path):
    """``idle()`` and ``busy()`` from two threads: whichever sets the agent's state last reports
    last, so the coordinator never holds IDLE for an agent that is busy (it would promote a worker
    that declines, and wait out the STOP). Here idle()'s report is slow (held); busy() meanwhile
    must wait for it, not report BUSY first."""
    agent = _agent("tcp://127.0.0.1:1", tmp_path)  # never started: the client only records
    reports, inside, release = [], threading.Event(), threading.Event()

    def report(state, step=None, *, ok=True):
        if state == "IDLE":
            inside.set()
            release.wait(10)
        reports.append(state)

    agent.client.report = report
    a = threading.Thread(target=agent.idle, args=(1,))
    a.start()
    assert inside.wait(10)
    b = threading.Thread(target=agent.busy, args=(2,))
    b.start()
    time.sleep(0.2)  # busy() runs meanwhile as far as it can
    release.set()
    a.join(10)
    b.join(10)
    assert reports == ["IDLE", "BUSY"] and not agent._idle


def test_one_worker_cycle_against_a_real_coordinator(tmp_path):
    coord = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", heartbeat_interval_s=HB, liveness=40,
                                          promotion=PromotionConfig(idle_threshold=1, stop_timeout_s=20))).start()
    try:
        with _agent(coord.endpoint, tmp_path) as agent:
            agent.start()
            assert agent.client.wait_connected(10)
            assert coord.step_begin(0)
            agent.idle(0)
            end = time.monotonic() + 60
            while (latest(tmp_path) or 0) < 2 and time.monotonic() < end:
                time.sleep(0.05)
            assert agent.training and latest(tmp_path) >= 2
            out = coord.rollout_done(0)
            assert out.clean and out.stopped == ("w0",), out
            assert not agent.training
            [rec] = agent.records
            res = rec.result
            assert rec.formation.members == ("w0",) and rec.formation.rank == 0
            assert res.stop_reason == "preempted" and res.checkpoint_step == res.end_step > 2
            assert res.preempt_latency_s is not None and res.preempt_latency_s < 5
            assert coord.snapshot()["w0"][0].value == "BUSY"  # acked BUSY after rollout_done
    finally:
        coord.stop()


def _spied(tmp_path, **kw):
    agent = _agent("tcp://127.0.0.1:1", tmp_path, **kw)
    reports = []
    agent.client.report = lambda state, step=None, ok=True: reports.append((state, step, ok))
    return agent, reports


def _promote(session=4):
    return Promote(session=session, step=0, dp_group=0, role=Role.LEADER, leader="w0",
                   leader_address="tcp://127.0.0.1:29500", members=("w0",), seq=1)


def test_stop_before_any_session_message_acks_without_forming(tmp_path):
    """A STOP that overtakes the SESSION (or a coordinator lost right after PROMOTE) must still be
    acked at once, with nothing formed. Driven through the agent's command entry point."""
    agent, reports = _spied(tmp_path, formation_wait_s=30)
    agent.idle(0)
    agent._on_command(_promote())
    assert agent.training
    t = time.monotonic()
    agent._on_command(Stop(session=4, step=0, reason="leader_lost", deadline_ms=1000))
    agent._cur.thread.join(5)
    assert time.monotonic() - t < 1.0 and not agent.training
    assert reports == [("IDLE", 0, True), ("IDLE", 0, True)] and len(agent.records) == 0


def test_promote_racing_busy_is_declined_and_busy_overrides_the_ack(tmp_path):
    """busy() was called (the BUSY report is queued) when a PROMOTE decided on the earlier IDLE
    arrives: no session thread starts; the queued BUSY tells the coordinator. And a session stopped
    by leader_lost acks BUSY, not IDLE, once busy() has been called."""
    agent, reports = _spied(tmp_path, formation_wait_s=30)
    agent.idle(0)
    agent.busy(1)
    agent._on_command(_promote(5))
    assert not agent.training and reports == [("IDLE", 0, True), ("BUSY", 1, True)]

    agent.idle(1)
    agent._on_command(_promote(6))
    agent._on_command(Stop(session=6, step=1, reason="leader_lost", deadline_ms=1000))
    agent.busy(2)
    assert reports[-2:] == [("BUSY", 1, True), ("BUSY", 2, True)], reports


def test_no_session_message_in_time_is_reported_as_a_failure(tmp_path):
    agent, reports = _spied(tmp_path, formation_wait_s=0.2)
    agent.idle(0)
    agent._on_command(_promote())
    agent._cur.thread.join(5)
    assert reports[-1] == ("BUSY", 0, False)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="niceness is per thread on Linux only")
def test_a_session_thread_runs_at_the_configured_nice_value(tmp_path):
    """Spot training yields the CPU: the session thread (and what it starts) is niced, the thread
    that serves rollouts (here: the caller's) is not."""
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = []
    for nice in (19, 0):
        agent, reports = _spied(tmp_path, formation_wait_s=30, nice=nice)
        agent._next_formation = lambda cur: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        agent.idle(0)
        agent._on_command(_promote())
        agent._cur.thread.join(5)
        assert not agent.training
    assert seen == [max(19, own), own]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own


def test_a_session_that_does_not_stop_in_time_is_an_error_not_a_busy_replica(tmp_path):
    """A trainer blocked where it cannot see the stop (a collective waiting on a dead peer): busy()
    raises after busy_timeout_s instead of letting the replica serve beside the session, reports
    nothing, and the session acks BUSY itself once it ends."""
    entered, release = threading.Event(), threading.Event()

    class Stuck:
        def run(self, next_batch, flag):
            entered.set()
            release.wait(30)
            raise RuntimeError("the collective timed out")

    agent, reports = _spied(tmp_path, formation_wait_s=30, busy_timeout_s=0.2)
    agent._make_trainer = lambda spec: Stuck()
    agent.idle(0)
    agent._on_command(_promote())
    agent._on_command(Session(session=4, epoch=1, members=("w0",)))
    assert entered.wait(10)
    with pytest.raises(TrainingDidNotStop, match="did not stop within busy_timeout_s=0s"):
        agent.busy(1)
    assert agent.training and reports == [("IDLE", 0, True)]
    release.set()
    agent._cur.thread.join(5)
    assert not agent.training and reports[-1][0] == "BUSY"


def test_the_replicas_agent_waits_out_a_sessions_slowest_stop():
    """The verl replica's agent: busy() outlasts a collective blocked for the group's whole timeout,
    then the final checkpoint's collective as long again."""
    from tlt.integrations.verl.config import TLTConfig
    from tlt.integrations.verl.spot_wiring import agent_config, spot_config

    cfg = TLTConfig.from_mapping({})
    spot = spot_config(cfg, seed=0)
    assert agent_config(cfg, spot).busy_timeout_s > 2 * spot.timeout_s
