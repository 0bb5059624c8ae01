"""Coordinator + worker clients over real loopback sockets: heartbeating first, then whole steps."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from tlt.coordinator import (Coordinator, CoordinatorConfig, DriverClient, PromotionConfig, WorkerClient, WorkerConfig,
                             WorkerState)
from tlt.coordinator import protocol as P
from tlt.coordinator.protocol import Promote, Stop

from .conftest import HB, REPO, free_port
from .rawpeer import RawPeer

B, I, T = WorkerState.BUSY, WorkerState.IDLE, WorkerState.TRAINING


def test_config_validation_names_the_field():
    for kw, name in [({"bind": "localhost:5"}, "bind"), ({"bind": "tcp://127.0.0.1:99999"}, "bind"),
                     ({"heartbeat_interval_s": 0}, "heartbeat_interval_s"),
                     ({"liveness": 1}, "liveness")]:
        with pytest.raises(ValueError, match=name):
            CoordinatorConfig(**kw)
    with pytest.raises(ValueError, match="worker_id"):
        WorkerConfig(address="tcp://127.0.0.1:1", worker_id="")
    with pytest.raises(ValueError, match="reconnect_initial_s"):
        WorkerConfig(address="tcp://127.0.0.1:1", worker_id="w", reconnect_initial_s=5, reconnect_max_s=1)


def test_the_old_name_of_the_promotion_config_is_read_with_a_warning():
    import tlt.coordinator as coordinator
    from tlt.coordinator.promotion import PromotionConfig

    with pytest.warns(DeprecationWarning, match="promotion"):
        old = CoordinatorConfig(policy=PromotionConfig(idle_threshold=5))
    assert old.promotion.idle_threshold == 5 and old.policy is None
    with pytest.warns(DeprecationWarning, match="PromotionConfig"):
        assert coordinator.PolicyConfig is PromotionConfig
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="promotion= only"):
        CoordinatorConfig(policy=PromotionConfig(idle_threshold=5), promotion=PromotionConfig(idle_threshold=3))


def test_coordinator_heartbeats_a_registered_peer(make_coordinator):
    c = make_coordinator()
    raw = RawPeer(c.endpoint)
    try:
        assert isinstance(raw.register("raw"), P.Welcome)
        n, end = 0, time.monotonic() + 12 * HB
        while time.monotonic() < end:   # we keep talking, so it stays alive; count its heartbeats
            raw.send(P.Heartbeat())
            if raw.recv(HB / 2, kind=P.Heartbeat) is not None:
                n += 1
        assert 4 <= n <= 16, n           # about one per interval (12), with room for a loaded machine
    finally:
        raw.close()


def test_any_message_counts_as_a_heartbeat(make_coordinator, events):
    c = make_coordinator(idle_threshold=100)
    raw = RawPeer(c.endpoint)
    try:
        raw.register("chatty")
        seq, end = 1, time.monotonic() + 12 * HB
        while time.monotonic() < end:            # state reports only, never a HEARTBEAT
            seq += 1
            raw.send(P.State(state=B if seq % 2 else I, step=0, seq=seq))
            time.sleep(HB / 2)
        assert events.of("lost") == [] and "chatty" in c.snapshot()
    finally:
        raw.close()


def test_reconnect_backoff_is_capped_and_report_never_blocks(make_worker, make_coordinator):
    port = free_port()
    w = make_worker(f"tcp://127.0.0.1:{port}", "lonely", connect=False)
    t = time.monotonic()
    for n in range(100):
        w.report(I if n % 2 else B, 0)
    assert time.monotonic() - t < 0.1
    time.sleep(1.0)                     # HB 50 ms, liveness 3, backoff 50 -> 100 -> 200 (cap) ms
    assert 2 <= w.reconnects <= 8, w.reconnects
    assert w._backoff == 4 * HB         # capped at reconnect_max_s
    make_coordinator(bind=f"tcp://127.0.0.1:{port}")
    assert w.wait_connected(3)
    assert w._backoff == HB             # reset by WELCOME


def test_a_step_the_wire_cannot_carry_is_refused_at_the_call(make_coordinator, make_worker):
    """report()/start() check the step where it is given: past the call it failed on the client
    thread, which dropped the report and the connection, and every later REGISTER failed too."""
    class Step(int):  # an int of another type (the wire takes ints only), as a numpy integer is
        pass

    c = make_coordinator()
    w = make_worker(c.endpoint, "w")
    for bad in (-1, 2**60, 1.5, "2", True):
        with pytest.raises(ValueError, match="step="):
            w.report(I, bad)
    with pytest.raises(ValueError, match="step="):
        WorkerClient(WorkerConfig(address=c.endpoint, worker_id="v")).start(B, -3)
    w.report(I, Step(4))
    end = time.monotonic() + 5
    while c.snapshot()["w"][0] != I and time.monotonic() < end:
        time.sleep(0.01)
    assert c.snapshot()["w"][0] == I and w.connected.is_set() and w.reconnects == 0


def test_embedded_driver_api_never_raises_when_stopped(make_coordinator):
    c = make_coordinator()
    c.stop()
    assert c.step_begin(1) is False
    out = c.rollout_done(1, timeout_s=0.2)
    assert not out.reachable


def test_quiet_workers_stay_alive(make_coordinator, make_worker, events):
    c = make_coordinator()
    ws = [make_worker(c.endpoint, f"w{k}") for k in range(3)]
    time.sleep(15 * HB)                 # nothing but heartbeats for 15 intervals
    assert events.of("lost") == []
    assert all(w.reconnects == 0 and w.connected.is_set() for w in ws)
    assert set(c.snapshot()) == {"w0", "w1", "w2"}


def test_stalled_peer_is_lost_purged_and_told(make_coordinator, events):
    c = make_coordinator()
    raw = RawPeer(c.endpoint)
    try:
        raw.register("stalled")
        t0 = time.monotonic()
        assert events.wait_kind("lost", "stalled", timeout_s=3)          # it never sends again
        waited = time.monotonic() - t0
        assert 2.5 * HB <= waited <= 3 + 6 * HB
        assert events.of("lost", "stalled")[0].detail["reason"] == "heartbeat"
        assert "stalled" not in c.snapshot()
        assert raw.recv(1, kind=P.Disconnect) is not None                 # told it was dropped
        raw.send(P.Heartbeat())                                           # unknown now: told again
        assert raw.recv(1, kind=P.Disconnect) is not None
    finally:
        raw.close()


class App:
    """A simulated rollout worker: on Stop it 'checkpoints' briefly and reports BUSY for the next step."""

    def __init__(self, w, checkpoint_s=0.02):
        self.w, self.checkpoint_s = w, checkpoint_s
        self.promotes: list[Promote] = []
        self.stops: list[Stop] = []
        self.next_step = 1
        self._done = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        end = time.monotonic() + 30
        while not self._done.is_set() and time.monotonic() < end:
            try:
                cmd = self.w.commands.get(timeout=0.02)
            except queue.Empty:
                continue
            if isinstance(cmd, Promote):
                self.promotes.append(cmd)
            elif isinstance(cmd, Stop):
                self.stops.append(cmd)
                time.sleep(self.checkpoint_s)
                self.w.report(B, self.next_step)

    def close(self):
        self._done.set()
        self.t.join(2)


def test_long_tail_rollout_two_steps(make_coordinator, make_worker, events):
    """6 workers in 2 DP groups finish at different times; 3 free -> training; rollout done -> stop."""
    c = make_coordinator(idle_threshold=3, stop_timeout_s=2.0)
    ws = [make_worker(c.endpoint, f"w{k}", dp_group=k % 2) for k in range(6)]
    apps = [App(w) for w in ws]
    try:
        for step in range(2):
            for a in apps:
                a.next_step = step + 1
            assert c.step_begin(step)
            order = [(step + k) % 6 for k in range(6)]           # a different long tail each step
            for n, k in enumerate(order[:5]):
                ws[k].report(I, step)
                if n < 2:                                        # below threshold: nobody promoted
                    assert events.wait(lambda k=k: c.snapshot()[f"w{k}"][0] is I, 2)
                    assert not any(s is T for s, _ in c.snapshot().values())
                else:
                    assert events.wait(lambda k=k: c.snapshot()[f"w{k}"][0] is T, 2)
            tail = f"w{order[5]}"
            assert events.wait_kind("accept", n=5 * (step + 1), timeout_s=3)
            # one session per group, led by that group's first idle worker
            snap = c.snapshot()
            by_group: dict[int, set] = {}
            for k in order[:5]:
                by_group.setdefault(k % 2, set()).add(snap[f"w{k}"][1])
            assert all(len(s) == 1 for s in by_group.values())
            for g in (0, 1):
                first = next(k for k in order[:5] if k % 2 == g)
                app = apps[first]
                end = time.monotonic() + 2              # its app thread may not have read it yet
                while not (app.promotes and app.promotes[-1].step == step) and time.monotonic() < end:
                    time.sleep(0.005)
                p = app.promotes[-1]
                assert p.step == step and p.role is P.Role.LEADER and p.leader == f"w{first}"
            out = c.rollout_done(step)                           # the tail finished: rollout done
            ws[order[5]].report(I, step)                         # too late for this step: not promoted
            assert out.reachable and out.clean, out
            assert sorted(out.stopped) == sorted(f"w{k}" for k in order[:5])
            assert out.elapsed_s < 1.0
            assert events.wait(lambda: all(s in (B, I) for s, _ in c.snapshot().values()), 2)
            assert events.wait(lambda tail=tail: c.snapshot()[tail][0] is I, 2)   # IDLE, not promoted
            ws[order[5]].report(B, step + 1)
            assert events.wait(lambda: all(s is B for s, _ in c.snapshot().values()), 2)
            for k in order[:5]:
                assert ws[k].state is B and ws[k].step == step + 1
    finally:
        for a in apps:
            a.close()
    assert events.of("lost") == [] and events.of("dropped") == []
    times = c.decision_times()
    assert len(times["promote"]) >= 2 * 3 and len(times["stop"]) == 2   # promotions batch; 1 stop per step
    assert max(times["promote"] + times["stop"]) < 0.5


def test_a_group_whose_member_list_is_past_64_kib_trains_and_stops(make_worker, events):
    """132 workers of one group, each id 128 characters (the most a worker takes), 125 of them of 4
    bytes: PROMOTE, SESSION and the driver's OUTCOME list ~66 KB of ids (about 520 ASCII ids). They were refused as oversized at 64 KiB: the late joiners never
    heard of their promotion and the driver got no answer."""
    n, hb = 132, 0.5  # heartbeating clients on a shared CI core
    cfg = CoordinatorConfig(bind="tcp://127.0.0.1:0", heartbeat_interval_s=hb, liveness=20,
                            promotion=PromotionConfig(idle_threshold=n, stop_timeout_s=10.0))
    ids = [f"{k:03d}" + "\U0001d11e" * 125 for k in range(n)]
    with Coordinator(cfg, on_event=events) as c:
        ws = [make_worker(c.endpoint, wid, heartbeat_interval_s=hb, reconnect_initial_s=hb,
                          reconnect_max_s=4 * hb) for wid in ids]
        assert c.step_begin(0)
        for w in ws:
            w.report(I, 0)
        assert events.wait_kind("accept", n=n, timeout_s=30), len(events.of("accept"))
        members = P.Session(session=1, epoch=1, members=tuple(ids))
        assert len(P.encode(members)[0]) > 64 * 1024

        def ack_stops():  # each gets its STOP: checkpoint done, back to the RL step
            for w in ws:
                while not isinstance(w.commands.get(timeout=15), Stop):
                    pass
                w.report(B, 1)

        acker = threading.Thread(target=ack_stops, daemon=True)
        acker.start()
        out = c.rollout_done(0)
        acker.join(15)
        assert out.reachable and sorted(out.stopped) == sorted(ids) and not out.lost, out
        assert events.of("dropped") == []


def test_driver_over_tcp_and_unreachable(make_coordinator):
    c = make_coordinator()
    with DriverClient(c.endpoint, timeout_s=2) as d:
        assert d.step_begin(4)
        out = d.rollout_done(4)
        assert out.reachable and out.step == 4 and out.stopped == ()
    with DriverClient(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.3) as d:  # nobody there
        t0 = time.monotonic()
        assert d.step_begin(1) is False
        out = d.rollout_done(1)
        assert not out.reachable and not out.clean
        assert time.monotonic() - t0 < 1.5


def test_standalone_process_serves_and_exits_on_sigterm(procs, make_worker):
    port = free_port()
    pr = procs("import sys; from tlt.coordinator.cli import main; sys.exit(main(sys.argv[1:]))",
               "--bind", f"tcp://127.0.0.1:{port}", "--heartbeat-ms", str(int(HB * 1000)),
               "--log-level", "WARNING")
    w = make_worker(f"tcp://127.0.0.1:{port}", "w0", connect=False)
    assert w.wait_connected(10)
    pr.p.send_signal(signal.SIGTERM)
    assert pr.p.wait(timeout=5) == 0
    end = time.monotonic() + 2      # the shutdown DISCONNECT (or silence) is noticed promptly
    while w.connected.is_set() and time.monotonic() < end:
        time.sleep(HB / 5)
    assert not w.connected.is_set()


# A SIGTERM handler runs in the main thread between any two lines it executes, even while that thread
# holds a lock (CPython gh-126434 reports it for multiprocessing.Event). This calls the installed
# handler at every line the serving main thread runs: a handler that takes a lock the serve loop holds
# (``threading.Event.set`` while the loop sits in ``Event.wait``) deadlocks here -- the likely cause
# of a coordinator that ignored a SIGTERM once in CI.
_HANDLER_AT_EVERY_LINE = """
import signal, sys
from tlt.coordinator import Coordinator, CoordinatorConfig

calls = []

def trace(frame, event, arg):
    if event in ("call", "line"):
        handler = signal.getsignal(signal.SIGTERM)
        if callable(handler):
            calls.append(1)
            handler(signal.SIGTERM, frame)
    return trace

c = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0"))
sys.settrace(trace)
c.serve_forever(until=lambda: sys.exit("the loop went on past its signal"))
sys.settrace(None)
print("stopped" if calls else "the handler never ran", flush=True)
"""


def test_sigterm_handler_is_safe_at_any_line_of_the_serve_loop():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _HANDLER_AT_EVERY_LINE], cwd=REPO, capture_output=True,
                       text=True, timeout=30, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "stopped" and "Traceback" not in r.stderr and "Exception" not in r.stderr, r.stderr
