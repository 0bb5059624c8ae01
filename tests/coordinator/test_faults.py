"""Fault cases with real processes and raw sockets: kill -9 of a training worker, kill of the
coordinator, a stalled worker, garbage and out-of-order input. The coordinator keeps serving and
nothing blocks the driver or the workers' report()."""

from __future__ import annotations

import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time

from tlt.coordinator import DriverClient, WorkerState
from tlt.coordinator import protocol as P
from tlt.coordinator.protocol import Promote, Stop

from .conftest import HB, REPO, free_port
from .rawpeer import RawPeer

B, I, T = WorkerState.BUSY, WorkerState.IDLE, WorkerState.TRAINING

# A worker process: registers, reports IDLE, prints every command it gets, never acks a STOP.
WORKER = r"""
import queue, sys, time
from tlt.coordinator import WorkerClient, WorkerConfig
addr, wid, hb = sys.argv[1], sys.argv[2], float(sys.argv[3])
w = WorkerClient(WorkerConfig(address=addr, worker_id=wid, heartbeat_interval_s=hb,
                              reconnect_initial_s=hb, reconnect_max_s=4 * hb)).start()
if not w.wait_connected(10):
    sys.exit(2)
w.report("IDLE", 0)
print("ready", flush=True)
end = time.monotonic() + 30
while time.monotonic() < end:
    try:
        cmd = w.commands.get(timeout=0.05)
    except queue.Empty:
        continue
    print(type(cmd).__name__, flush=True)
"""
COORDINATOR = "import sys; from tlt.coordinator.cli import main; sys.exit(main(sys.argv[1:]))"


def next_of(w, kind: type, timeout_s: float = 3.0):
    """The next command of type ``kind`` in ``w.commands`` (others skipped), or None in time."""
    end = time.monotonic() + timeout_s
    while (left := end - time.monotonic()) > 0:
        try:
            cmd = w.commands.get(timeout=left)
        except queue.Empty:
            return None
        if isinstance(cmd, kind):
            return cmd
    return None


def acker(w, step_after: int = 1, stop_reason: list | None = None):
    """Background app loop: on Stop, 'checkpoint' and report BUSY (bounded in time)."""
    def run():
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                cmd = w.commands.get(timeout=0.02)
            except queue.Empty:
                continue
            if isinstance(cmd, Stop):
                if stop_reason is not None:
                    stop_reason.append(cmd.reason)
                time.sleep(0.01)
                w.report(B, step_after)
                return
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_kill_9_of_a_training_leader(make_coordinator, make_worker, procs, events):
    c = make_coordinator(idle_threshold=2, stop_timeout_s=2.0)
    assert c.step_begin(0)
    pw = procs(WORKER, c.endpoint, "p0", str(HB))
    assert pw.wait_line("ready")
    assert events.wait(lambda: c.snapshot().get("p0", (None,))[0] is I, 5)
    t0 = make_worker(c.endpoint, "t0")
    ack = acker(t0)
    t0.report(I, 0)
    assert events.wait_kind("accept", "p0") and events.wait_kind("accept", "t0")
    assert pw.wait_line("Promote")
    assert [e.detail["role"] for e in events.of("promote", "p0")] == ["leader"]
    pw.p.send_signal(signal.SIGKILL)
    pw.p.wait(5)
    start = time.monotonic()
    out = c.rollout_done(0)
    took = time.monotonic() - start
    assert out.reachable and out.stopped == ("t0",) and "p0" in out.lost + out.timed_out
    assert took < 2.0 + 0.5                       # bounded by the stop timeout, never blocked
    assert events.wait_kind("lost", "p0", timeout_s=2)
    assert events.of("lost", "p0")[0].detail["reason"] in ("heartbeat", "stop_timeout")
    ack.join(2)
    assert events.wait(lambda: c.snapshot() == {"t0": (B, None)}, 2)


def test_kill_of_the_coordinator_then_restart(procs, make_coordinator, make_worker, events):
    port = free_port()
    addr = f"tcp://127.0.0.1:{port}"
    pc = procs(COORDINATOR, "--bind", addr, "--heartbeat-ms", str(int(HB * 1000)), "--idle-threshold", "2",
               "--log-level", "ERROR")
    ws = {k: make_worker(addr, k, connect=False) for k in ("a", "b", "c")}
    assert all(w.wait_connected(10) for w in ws.values())
    with DriverClient(addr, timeout_s=5) as d:
        assert d.step_begin(0)
    ws["a"].report(I, 0)
    ws["b"].report(I, 0)
    assert all(isinstance(next_of(ws[k], Promote), Promote) for k in ("a", "b"))

    pc.p.send_signal(signal.SIGKILL)
    pc.p.wait(5)
    # training workers stop on their own once the coordinator is silent
    for k in ("a", "b"):
        stop = next_of(ws[k], Stop)
        assert isinstance(stop, Stop) and stop.reason == "coordinator_lost"
        ws[k].report(B, 1)
    # rollout never waits on a dead coordinator: report() returns at once, the driver gives up in time
    t = time.monotonic()
    for n in range(200):
        ws["c"].report(I if n % 2 else B, 0)
    assert time.monotonic() - t < 0.2
    with DriverClient(addr, timeout_s=0.3) as d:
        t = time.monotonic()
        assert not d.rollout_done(0).reachable
        assert time.monotonic() - t < 1.0
    assert all(ws[k].state is B for k in ("a", "b")) and ws["c"].state is I

    # a new coordinator on the same address: everyone re-registers with its current state
    c2 = make_coordinator(bind=addr, idle_threshold=2)
    assert all(w.wait_connected(5) for w in ws.values())
    assert events.wait(lambda: c2.snapshot() == {"a": (B, None), "b": (B, None), "c": (I, None)}, 3)
    assert all(w.reconnects >= 1 for w in ws.values())
    # it knows no step yet: workers still IDLE at step 0, whose rollout is over, are not promoted
    # onto GPUs the RL step is using (b and c would cross the threshold)
    ws["b"].report(I, 0)
    assert events.wait(lambda: c2.snapshot()["b"] == (I, None), 3)
    time.sleep(5 * HB)
    assert events.of("promote") == []
    assert c2.step_begin(1)                                       # the driver's first word
    ws["a"].report(I, 1)
    ws["b"].report(I, 1)
    assert isinstance(next_of(ws["a"], Promote), Promote)         # and promotion works again


def test_stalled_worker_process_is_lost_then_comes_back(make_coordinator, procs, events):
    c = make_coordinator(idle_threshold=10)
    pw = procs(WORKER, c.endpoint, "s0", str(HB))
    assert pw.wait_line("ready")
    assert events.wait(lambda: c.snapshot().get("s0", (None,))[0] is I, 5)
    os.kill(pw.p.pid, signal.SIGSTOP)
    try:
        assert events.wait_kind("lost", "s0", timeout_s=3)
        assert "s0" not in c.snapshot()
    finally:
        os.kill(pw.p.pid, signal.SIGCONT)
    assert events.wait_kind("registered", "s0", n=2, timeout_s=5)    # it noticed and re-registered
    assert events.wait(lambda: c.snapshot().get("s0", (None,))[0] is I, 3)


def test_garbage_on_the_socket(make_coordinator, make_worker, events):
    c = make_coordinator(idle_threshold=1)
    assert c.step_begin(0)
    good = make_worker(c.endpoint, "good")
    hb = P.HEADER + bytes([P.Command.HEARTBEAT])
    bad_frames = [
        [b"hello"],
        [b"hello", b"world", b"!"],
        [P.MAGIC + bytes([P.VERSION + 1, P.Command.HEARTBEAT]) + b"\x80"],  # another version
        [P.HEADER + bytes([P.Command.STATE]) + b"\xc1\xc1"],                # not msgpack
        [hb + b"\x80" + b"\x00" * (P.MAX_BODY_BYTES + 10)],                  # oversized (ours)
        P.encode(P.Welcome(coordinator_id="x", heartbeat_ms=1)),             # coordinator-only command
        [P.HEADER + bytes([P.Command.REGISTER]) + b"\x81\xa1a\x01"],         # wrong schema
    ]
    for frames in bad_frames:
        raw = RawPeer(c.endpoint)
        raw.send_frames(frames)
        reply = raw.recv(2)
        assert isinstance(reply, P.Disconnect), (frames[:2], reply)
        raw.close()
    huge = RawPeer(c.endpoint)            # above ZMQ_MAXMSGSIZE: libzmq cuts the connection itself
    huge.send_frames([hb + b"\x00" * (P.MAX_WIRE_BYTES + 1)])
    rng = random.Random(0)
    for payload in (rng.randbytes(4096), b"\xff" + b"\x00" * 8 + b"\x7fGET / HTTP/1.1\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", int(c.endpoint.rsplit(":", 1)[1])), timeout=2) as s:
            s.sendall(payload)
            time.sleep(HB)
    huge.close()
    assert events.wait_kind("dropped", n=len(bad_frames), timeout_s=2)
    # still serving: the good worker was never lost and is promoted as usual
    assert events.of("lost") == []
    good.report(I, 0)
    assert isinstance(next_of(good, Promote), Promote)
    assert c.snapshot() == {"good": (T, c.snapshot()["good"][1])}


def test_out_of_order_messages_drop_the_peer(make_coordinator, make_worker, events):
    c = make_coordinator(idle_threshold=5)
    good = make_worker(c.endpoint, "good")
    raw = RawPeer(c.endpoint)
    try:
        assert isinstance(raw.register("rogue"), P.Welcome)
        raw.send(P.Stopped(session=99, step=0, seq=2, state=B))             # a session never started
        assert isinstance(raw.recv(2, kind=P.Disconnect), P.Disconnect)
        assert events.wait_kind("dropped", "rogue") and events.wait_kind("lost", "rogue")
        assert "out_of_order" in events.of("dropped", "rogue")[0].detail["reason"]
        raw.send(P.State(state=I, step=0, seq=3))                           # no longer registered
        assert isinstance(raw.recv(2, kind=P.Disconnect), P.Disconnect)
        assert isinstance(raw.register("rogue", seq=5), P.Welcome)          # may come back properly
        raw.send(P.State(state=I, step=0, seq=5))                           # seq did not increase
        assert isinstance(raw.recv(2, kind=P.Disconnect), P.Disconnect)
        raw.send(P.RolloutDone(step=0, req=1, deadline_ms=10))              # unregistered: fine as driver
        assert isinstance(raw.recv(2, kind=P.Outcome), P.Outcome)
    finally:
        raw.close()
    assert set(c.snapshot()) == {"good"} and good.reconnects == 0


def test_import_coordinator_pulls_no_torch_and_nothing_of_ours():
    code = ("import sys, tlt.coordinator, tlt.coordinator.broker, tlt.coordinator.worker, tlt.coordinator.driver, "
            "tlt.coordinator.promotion, tlt.coordinator.states, tlt.coordinator.protocol\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy') "
            "or (m.startswith('tlt.') and not m.startswith('tlt.coordinator')))\n"
            "print(bad)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_standalone_coordinator_exits_with_its_parent():
    """``--exit-with-parent`` (the verl trainer starts it so): a parent killed with -9 leaves no
    orphaned coordinator behind."""
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-m', 'tlt.coordinator', '--bind', 'tcp://127.0.0.1:0',"
        " '--exit-with-parent'])\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(600)\n")], cwd=REPO, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        time.sleep(1.0)  # the child is serving
        os.kill(child, 0)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            try:  # reap it if it became our zombie (it is reparented to init, normally)
                os.waitpid(child, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.1)
        else:
            raise AssertionError("the coordinator outlived its parent by 10 s")
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
