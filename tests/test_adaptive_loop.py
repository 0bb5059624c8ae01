"""The whole adaptive-drafter loop on CPU (``examples/simloop.py``): a coordinator, rollout-worker processes
with a long-tail rollout, promotion of the idle ones into an FSDP2/gloo spot-training session fed
from each worker's DataBuffer, a late idle worker joining the running session, preemption when the
rollout completes, the final checkpoint, and the next RL step resuming from it. Fault cases: SIGKILL
of a training worker (the survivor regroups and trains on), SIGKILL of the coordinator (training
stops on its own, rollout goes on, a restarted coordinator picks the loop up again).

Real processes (spawn), ZeroMQ and gloo on 127.0.0.1 only, a tiny drafter. Every wait is bounded.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from tlt.drafter.checkpoint import TrainState, latest, load
from tlt.drafter.eagle import Drafter
from simloop import SimConfig, SimLoop, target


def _mean(xs) -> float:
    return sum(xs) / len(xs)


def _by_epoch(records) -> dict[int, dict[str, dict]]:
    """{epoch: {worker_rank: record}} of successful formations."""
    out: dict[int, dict[int, dict]] = {}
    for r in records:
        if r["result"] is not None:
            out.setdefault(r["formation"]["epoch"], {})[r["formation"]["rank"]] = r
    return dict(sorted(out.items()))


def test_adaptive_loop(tmp_path):
    t_start = time.monotonic()
    steps = 3
    # Long tail: w0 and w1 finish early, w2 later (joins the running session), w3 ends the rollout.
    cfg = SimConfig(durations=((0.3,) * steps, (0.8,) * steps, (3.0,) * steps, (9.0,) * steps))
    root = tmp_path / "ckpt"
    events: list = []
    with SimLoop(cfg, root, on_event=events.append) as loop:
        for s in range(steps):
            assert loop.begin(s)
            loop.wait_rollout(s)
            t = time.monotonic()
            out = loop.rollout_done(s)
            assert out.clean and set(out.stopped) == {"w0", "w1", "w2"}, out
            assert time.monotonic() - t < 20
        snapshot = loop.coordinator.snapshot()
    assert all(state.value == "BUSY" for state, _ in snapshot.values()), snapshot

    prev_end, curve = 0, []
    for s in range(steps):
        recs = loop.records(s)
        assert all(r["result"] is not None for r in recs), [r["error"] for r in recs]
        forms = _by_epoch(recs)
        sessions = {r["formation"]["session"] for r in recs}
        assert len(sessions) == 1, sessions  # one session per RL step, re-formed as it grew
        members = [next(iter(f.values()))["formation"]["members"] for f in forms.values()]
        assert members[0] == ("w0", "w1") and members[-1] == ("w0", "w1", "w2"), members
        for epoch, ranks in forms.items():
            world = len(next(iter(ranks.values()))["formation"]["members"])
            assert sorted(ranks) == list(range(world)), (epoch, ranks)  # every rank reported
            res = [r["result"] for r in ranks.values()]
            assert len({(x["start_step"], x["end_step"], x["losses"]) for x in res}) == 1  # one global loss
            r0 = res[0]
            assert r0["stop_reason"] == "preempted" and r0["checkpoint_step"] == r0["end_step"]
            assert r0["start_step"] == prev_end, (s, epoch, r0["start_step"], prev_end)  # resumed
            prev_end = r0["end_step"]
            curve += r0["losses"]
        first = next(iter(forms.values()))[0]["result"]
        assert first["end_step"] > first["start_step"], first  # trained before the joiner came
        last = list(forms.values())[-1]
        assert last[2]["formation"]["members"][2] == "w2"  # the joiner trained as rank 2
        assert last[0]["result"]["end_step"] > last[0]["result"]["start_step"], last[0]
    assert latest(root) == prev_end
    head, tail = _mean(curve[:5]), _mean(curve[-5:])
    assert tail < 0.5 * head, (head, tail)  # the drafter learned across the RL steps
    promote_sessions = {e.detail["session"] for e in events if e.kind == "promote"}
    assert len(promote_sessions) == steps
    print(f"adaptive loop: {steps} RL steps in {time.monotonic() - t_start:.1f}s, {len(curve)} drafter "
          f"steps, loss {head:.3f} -> {tail:.3f}")


def test_training_worker_killed_survivor_regroups(tmp_path):
    """SIGKILL of a training rank mid-session: the survivor's group fails, the coordinator declares
    the dead worker lost and sends a new epoch, the survivor re-forms alone from the latest
    checkpoint and trains on; rollout_done stops it cleanly and lists the dead one as lost."""
    base = SimConfig(durations=((0.3,), (0.6,), (60.0,)), stop_timeout_s=15.0)
    cfg = dataclasses.replace(base, spot=dataclasses.replace(base.spot, interval=2, timeout_s=6.0))
    root = tmp_path / "ckpt"
    with SimLoop(cfg, root) as loop:
        assert loop.begin(0)
        end = time.monotonic() + 60
        while latest(root) is None and time.monotonic() < end:
            time.sleep(0.05)
        before = latest(root)
        assert before is not None, "no checkpoint before the kill"
        loop.kill_worker(1)  # w1 = rank 1 of the 2-rank group
        end = time.monotonic() + 60  # wait until the regrouped survivor has checkpointed again
        while (latest(root) or 0) <= before + 2 and time.monotonic() < end:
            time.sleep(0.1)
        t = time.monotonic()
        out = loop.rollout_done(0)
        done_s = time.monotonic() - t
        assert out.clean and out.stopped == ("w0",), out  # w1 was declared lost long before
        assert done_s < 10, done_s
        assert set(loop.coordinator.snapshot()) == {"w0", "w2"}
    recs = loop.records(0, "w0")
    failed = [r for r in recs if r["result"] is None]
    alone = [r for r in recs if r["result"] is not None and r["formation"]["members"] == ("w0",)]
    assert failed and failed[0]["formation"]["members"] == ("w0", "w1"), recs
    assert len(alone) == 1 and alone[0]["formation"]["epoch"] > failed[0]["formation"]["epoch"]
    res = alone[0]["result"]
    assert before <= res["start_step"] < res["end_step"] == res["checkpoint_step"], res
    dcfg, embed, head = target()
    d = Drafter(dcfg, embed, head)
    st = TrainState(d, torch.optim.AdamW(d.parameters()))
    assert load(root, {"train": st}) == res["end_step"] == st.step


def test_coordinator_killed_then_restarted(tmp_path):
    """SIGKILL of the coordinator while two workers train: they stop on their own and checkpoint,
    the rollout completes on time and the driver is never blocked; a coordinator restarted on the
    same address picks the loop up, and the next session resumes from that checkpoint."""
    cfg = SimConfig(durations=((0.3, 0.3), (0.6, 0.6), (6.0, 6.0)), coordinator_process=True,
                    liveness=10)
    root = tmp_path / "ckpt"
    with SimLoop(cfg, root) as loop:
        t0 = time.monotonic()
        assert loop.begin(0)
        time.sleep(3.0)  # both train
        loop.kill_coordinator()
        # coordinator silent for liveness x heartbeat: each trainer stops, checkpoints, acks into the void
        got = loop.expect(lambda m: m[0] == "record" and m[2] == 0 and m[3]["result"] is not None,
                          n=2, timeout_s=30)
        res = [m[3]["result"] for m in got]
        assert all(r["stop_reason"] == "preempted" and r["end_step"] > 0 for r in res), res
        assert all(r["checkpoint_step"] == r["end_step"] for r in res), res
        loop.wait_rollout(0, timeout_s=30)
        assert time.monotonic() - t0 < 6.0 + 5, "rollout was held up by the dead coordinator"
        t = time.monotonic()
        assert not loop.rollout_done(0, timeout_s=1.0).reachable
        assert time.monotonic() - t < 2.0
        assert not loop.begin(1, timeout_s=0.5)  # workers start step 1 anyway
        assert all(m[3] for m in loop.expect(lambda m: m[0] == "busy" and m[2] == 1, n=3, timeout_s=30))
        loop.restart_coordinator()
        end = time.monotonic() + 20
        while not loop.driver.step_begin(1, timeout_s=0.5) and time.monotonic() < end:
            pass
        loop.wait_rollout(1)
        out = loop.rollout_done(1)
        assert out.clean and set(out.stopped) == {"w0", "w1"}, out
    step1 = _by_epoch(loop.records(1))
    assert step1, loop.records(1)
    first = next(iter(step1.values()))[0]["result"]
    assert first["start_step"] == res[0]["end_step"] < first["end_step"], first


def test_stalled_training_rank_is_dropped_then_rejoins(tmp_path):
    """SIGSTOP of a training rank for longer than the liveness window: the coordinator declares it
    lost and gives the survivor a new epoch; the survivor leaves the stalled group (at the next
    boundary, or when its collective times out) and trains alone from the latest checkpoint. When the
    stalled worker wakes it learns it was dropped, stops, acks, re-registers, and is promoted back
    into the running session. Nothing hangs and rollout_done is clean."""
    import os
    import signal

    base = SimConfig(durations=((0.3,), (0.6,), (60.0,)), stop_timeout_s=15.0)
    cfg = dataclasses.replace(base, spot=dataclasses.replace(base.spot, interval=2, timeout_s=6.0))
    root = tmp_path / "ckpt"
    events: list = []
    with SimLoop(cfg, root, on_event=events.append) as loop:
        assert loop.begin(0)
        end = time.monotonic() + 60
        while latest(root) is None and time.monotonic() < end:
            time.sleep(0.05)
        before = latest(root)
        assert before is not None
        pid = loop.procs[1].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            end = time.monotonic() + 15
            while not any(e.kind == "lost" and e.worker_id == "w1" for e in events) and time.monotonic() < end:
                time.sleep(0.05)
            assert any(e.kind == "lost" and e.worker_id == "w1" for e in events), "stalled rank not dropped"
            time.sleep(1.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        # the survivor trains alone (a 1-rank formation) and the woken worker comes back into the session
        end = time.monotonic() + 60
        while time.monotonic() < end and not (
                any(e.kind == "registered" and e.worker_id == "w1" for e in events[events.index(
                    next(e for e in events if e.kind == "lost" and e.worker_id == "w1")):])
                and (latest(root) or 0) >= before + 4):
            time.sleep(0.1)
        t = time.monotonic()
        out = loop.rollout_done(0)
        assert out.clean and "w0" in out.stopped, out
        assert time.monotonic() - t < 15
    recs = sorted(loop.records(0), key=lambda r: (r["formation"]["epoch"], r["formation"]["rank"]))
    first_epoch = recs[0]["formation"]["epoch"]
    assert recs[0]["formation"]["members"] == ("w0", "w1")
    later = [r for r in recs if r["formation"]["epoch"] > first_epoch and r["result"] is not None]
    # the survivor trained on after the stall (alone, or with w1 once it was promoted back)
    assert any(r["result"]["end_step"] > r["result"]["start_step"] >= before for r in later), recs
    # the stalled rank reported its interrupted group (result or error): it never hung
    assert any(r["formation"]["members"][r["formation"]["rank"]] == "w1"
               and r["formation"]["epoch"] == first_epoch for r in recs), recs
    rejoined = [r for r in later if "w1" in r["formation"]["members"]]
    print("stalled rank: formations", [(r["formation"]["members"], r["formation"]["rank"],
                                        None if r["result"] is None else (r["result"]["start_step"], r["result"]["end_step"]),
                                        r["error"][:60]) for r in recs])
    assert rejoined, recs  # promoted back into the running session after it woke
    assert latest(root) >= before + 4
