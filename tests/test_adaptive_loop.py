"""The whole adaptive-drafter loop on CPU: an embedded coordinator, three rollout-worker processes with
a long-tail rollout, promotion of the idle ones into a 2-rank FSDP2/gloo spot-training session fed
from each worker's DataBuffer, preemption when the rollout completes, the final checkpoint, and the
next RL step resuming from it; plus a SIGKILL of a training worker mid-session.

Real processes (spawn), ZeroMQ and gloo on 127.0.0.1 only, a tiny drafter. Every wait is bounded.
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import queue
import socket
import threading
import time

import torch

from coordinator import Coordinator, CoordinatorConfig, PolicyConfig, WorkerClient, WorkerConfig
from coordinator.protocol import Promote, Session, Stop
from drafter.buffer import BufferConfig, DataBuffer
from drafter.checkpoint import TrainState, latest, load
from drafter.eagle import Drafter, DrafterConfig
from drafter.model_config import ModelConfig
from drafter.packing import FeatureSample
from drafter.spot import PreemptFlag, SessionSpec, SpotConfig, run_session
from drafter.ttt import TTTConfig

HB = 0.1          # heartbeat interval (coordinator and workers)
LIVENESS = 20     # silent intervals before LOST: generous, the 2 cores are shared with training
V, H = 64, 32
RULE = (5, 7)     # x_{t+1} = (a * x_t + b) % V: a permutation, so the drafter can learn it
SAMPLES_PER_STEP = 32
SESSION_SIZE = 2  # = idle_threshold: the idle pool promoted at once forms one session


def _target():
    tcfg = ModelConfig(model_type="llama", vocab_size=V, hidden_size=H, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    g = torch.Generator().manual_seed(11)
    embed = torch.randn(V, H, generator=g)
    head = torch.randn(V, H, generator=g) * 0.3
    return DrafterConfig.for_target(tcfg, "eagle"), embed, head


def _feature_table() -> torch.Tensor:
    return torch.randn(V, H, generator=torch.Generator().manual_seed(12))


def _rollout_samples(step: int) -> list[FeatureSample]:
    """What a rollout of RL ``step`` yields: identical on every worker (seeded by the step)."""
    g = torch.Generator().manual_seed(1000 + step)
    table, (a, b) = _feature_table(), RULE
    out = []
    for _ in range(SAMPLES_PER_STEP):
        n = int(torch.randint(20, 33, (1,), generator=g))
        x = [int(torch.randint(0, V, (1,), generator=g))]
        for _ in range(n):
            x.append((a * x[-1] + b) % V)
        ids = torch.tensor(x[:n])
        nxt = torch.tensor(x[1:n + 1])
        hidden = table[nxt] + 0.05 * torch.randn(n, H, generator=g)  # f_t = F[x_{t+1}] + noise
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n // 2:] = True
        out.append(FeatureSample(ids, mask, hidden))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spot_config(**kw) -> SpotConfig:
    return SpotConfig(**{"lr": 1e-2, "token_budget": 192, "interval": 10_000, "ttt": TTTConfig(steps=2),
                         "seed": 3, "timeout_s": 30.0, **kw})


# ---------------------------------------------------------------- worker process (spawned)
def _worker(i: int, coord_addr: str, port: int, root: str, durations: list[float], trains: bool,
            spot_kw: dict, ctl, out) -> None:
    """One rollout replica: rolls out when told, reports IDLE (or 'rollout complete' if it is the
    long tail), and trains the drafter on a thread while promoted."""
    torch.set_num_threads(1)
    wid = f"w{i}"
    dcfg, embed, head = _target()
    buf = DataBuffer(BufferConfig(dtype="float32", max_bytes=64 << 20))
    st: dict = {"thread": None, "flag": None, "step": 0, "stop": None}
    client: WorkerClient | None = None

    def train(p: Promote, flag: PreemptFlag, step: int) -> None:
        ok = True
        try:
            members = p.members
            if len(members) < SESSION_SIZE:  # the leader's PROMOTE lists only who was in so far:
                st["members_ready"].wait(5)  # the SESSION update that follows carries the rest
                members = st["members"] or members
            calls = itertools.count()

            def next_batch(budget: int):  # same seeded draw on every rank of the session
                return buf.sample_batch(budget, seed=step * 1_000_003 + next(calls))

            spec = SessionSpec(rank=members.index(wid), world_size=len(members),
                               # a fresh port per session (the leader's base port + session id):
                               # re-using the previous session's port right away hung rendezvous
                               master_port=int(p.leader_address.rsplit(":", 1)[1]) + p.session,
                               session_id=f"s{p.session}")
            res = run_session(spec=spec, config=_spot_config(**spot_kw), drafter_config=dcfg,
                              embed_weight=embed, head_weight=head, checkpoint_root=root,
                              next_batch=next_batch, should_stop=flag)
            out.put(("result", wid, step, dataclasses.asdict(res), st["stop"]))
        except BaseException as e:  # noqa: BLE001 - a failed session must still be acked
            ok = False
            out.put(("error", wid, step, repr(e), st["stop"]))
        finally:
            client.report("BUSY", step + 1, ok=ok)  # ack: training stopped, back to the next rollout

    def on_command(cmd) -> None:  # client thread: signal and return
        if isinstance(cmd, Promote):
            st["flag"] = PreemptFlag()
            st["stop"], st["members"] = None, None
            st["members_ready"] = threading.Event()
            out.put(("promoted", wid, st["step"], cmd.session, tuple(cmd.members)))
            st["thread"] = threading.Thread(target=train, args=(cmd, st["flag"], st["step"]), daemon=True)
            st["thread"].start()
        elif isinstance(cmd, Session):
            st["members"] = tuple(cmd.members)
            out.put(("session", wid, st["step"], cmd.session, tuple(cmd.members)))
            if len(cmd.members) >= SESSION_SIZE:
                st["members_ready"].set()
        elif isinstance(cmd, Stop):
            st["stop"] = cmd.reason
            st["flag"].set()

    client = WorkerClient(WorkerConfig(address=coord_addr, worker_id=wid, trainer_address=f"tcp://127.0.0.1:{port}",
                                       heartbeat_interval_s=HB, liveness=LIVENESS,
                                       reconnect_initial_s=HB, reconnect_max_s=4 * HB),
                          on_command=on_command).start()
    try:
        assert client.wait_connected(30)
        out.put(("ready", wid))
        while True:
            msg = ctl.get(timeout=180)
            if msg[0] == "exit":
                break
            step = msg[1]
            if st["thread"] is not None:
                st["thread"].join(60)
            st["step"] = step
            t0 = time.monotonic()
            for s in _rollout_samples(step):
                buf.add(s, step)
            time.sleep(max(0.0, t0 + durations[step] - time.monotonic()))
            if trains:
                client.report("IDLE", step)  # requests drained: GPU free
            else:
                out.put(("complete", wid, step))  # the long tail: the rollout is done
    finally:
        if st["thread"] is not None:
            st["thread"].join(30)
        client.close()


# ---------------------------------------------------------------- driver harness
class _Loop:
    def __init__(self, root, durations: dict[int, list[float]], spot_kw: dict | None = None,
                 stop_timeout_s: float = 20.0) -> None:
        self.events: list = []
        self.coord = Coordinator(CoordinatorConfig(
            bind="tcp://127.0.0.1:0", heartbeat_interval_s=HB, liveness=LIVENESS,
            policy=PolicyConfig(idle_threshold=SESSION_SIZE, stop_timeout_s=stop_timeout_s)),
            on_event=self.events.append).start()
        ctx = multiprocessing.get_context("spawn")
        self.out = ctx.Queue()
        self.ctls = [ctx.Queue() for _ in durations]
        self.procs = [ctx.Process(target=_worker, daemon=True, args=(
            i, self.coord.endpoint, _free_port(), str(root), durations[i], i != len(durations) - 1,
            spot_kw or {}, self.ctls[i], self.out)) for i in range(len(durations))]
        for p in self.procs:
            p.start()
        self.msgs: list[tuple] = []
        self.expect(lambda m: m[0] == "ready", n=len(self.procs), timeout_s=60)
        end = time.monotonic() + 10
        while len(self.coord.snapshot()) < len(self.procs) and time.monotonic() < end:
            time.sleep(0.05)
        assert len(self.coord.snapshot()) == len(self.procs), self.coord.snapshot()

    def expect(self, pred, n: int = 1, timeout_s: float = 60.0) -> list[tuple]:
        """Wait (bounded) until ``n`` received messages satisfy ``pred``; returns them."""
        end = time.monotonic() + timeout_s
        while True:
            got = [m for m in self.msgs if pred(m)]
            if len(got) >= n:
                return got
            errors = [m for m in self.msgs if m[0] == "error"]
            left = end - time.monotonic()
            if left <= 0 or any(not p.is_alive() and p.exitcode not in (0, None) for p in self.live()):
                raise AssertionError(f"timed out waiting; messages: {self.msgs}, errors: {errors}")
            try:
                self.msgs.append(self.out.get(timeout=min(left, 0.5)))
            except queue.Empty:
                pass

    def live(self):
        return [p for p in self.procs if not getattr(p, "_tlt_killed", False)]

    def begin(self, step: int) -> None:
        assert self.coord.step_begin(step)
        for c, p in zip(self.ctls, self.procs):
            if p.is_alive():
                c.put(("step", step))

    def close(self) -> None:
        for c in self.ctls:
            c.put(("exit",))
        for p in self.procs:
            p.join(30)
        for p in self.procs:
            if p.is_alive():
                p.kill()
        self.coord.stop()


def _mean(xs) -> float:
    return sum(xs) / len(xs)


def test_adaptive_loop(tmp_path):
    t_start = time.monotonic()
    steps = 3
    # Long tail: w0 and w1 finish early (at different times), w2 runs much longer each step.
    durations = {0: [0.3] * steps, 1: [0.8] * steps, 2: [7.0] * steps}
    root = tmp_path / "ckpt"
    loop = _Loop(root, durations)
    try:
        results: dict[int, dict[str, dict]] = {}
        outcomes = []
        for s in range(steps):
            loop.begin(s)
            promoted = loop.expect(lambda m, s=s: m[0] == "promoted" and m[2] == s, n=2, timeout_s=30)
            assert {m[1] for m in promoted} == {"w0", "w1"}
            # one session: w0 (idle first) leads; its PROMOTE lists only itself, SESSION adds w1
            assert {m[3] for m in promoted} and len({m[3] for m in promoted}) == 1
            assert {m[1]: m[4] for m in promoted} == {"w0": ("w0",), "w1": ("w0", "w1")}
            loop.expect(lambda m, s=s: m[0] == "session" and m[2] == s and m[4] == ("w0", "w1"),
                        timeout_s=10)
            loop.expect(lambda m, s=s: m[0] == "complete" and m[2] == s, timeout_s=60)
            t = time.monotonic()
            out = loop.coord.rollout_done(s)
            done_s = time.monotonic() - t
            outcomes.append(out)
            if not out.clean:
                print("MSGS", out, [m if m[0] != "result" else m[:3] + (m[3]["start_step"], m[3]["end_step"]) for m in loop.msgs])
            assert out.reachable and out.clean, out
            assert set(out.stopped) == {"w0", "w1"}, out
            assert done_s < 20, done_s
            got = loop.expect(lambda m, s=s: m[0] in ("result", "error") and m[2] == s, n=2, timeout_s=30)
            assert all(m[0] == "result" for m in got), got
            results[s] = {m[1]: m[3] for m in got}
            assert all(m[4] == "rollout_done" for m in got), got
        snapshot = loop.coord.snapshot()
    finally:
        loop.close()

    for s in range(steps):
        r0, r1 = results[s]["w0"], results[s]["w1"]
        assert (r0["rank"], r1["rank"], r0["world_size"]) == (0, 1, 2)
        assert r0["stop_reason"] == r1["stop_reason"] == "preempted"
        assert r0["end_step"] == r1["end_step"] and r0["losses"] == r1["losses"]  # one global loss
        assert r0["end_step"] > r0["start_step"], r0  # it trained before the preemption
        assert r0["checkpoint_step"] == r0["end_step"]  # final checkpoint committed before the ack
        if s:
            assert r0["start_step"] == results[s - 1]["w0"]["end_step"]  # resumed from it
    assert latest(root) == results[steps - 1]["w0"]["end_step"]
    first, last = _mean(results[0]["w0"]["losses"]), _mean(results[steps - 1]["w0"]["losses"])
    curve = {s: results[s]["w0"]["losses"] for s in results}
    assert last < 0.85 * first, (first, last, curve)  # mean loss per session goes down across steps
    assert curve[steps - 1][-1] < 0.5 * curve[0][0], curve  # and well below the untrained drafter
    assert all(state.value == "BUSY" for state, _ in snapshot.values()), snapshot
    promote_sessions = {e.detail["session"] for e in loop.events if e.kind == "promote"}
    assert len(promote_sessions) == steps
    elapsed = time.monotonic() - t_start
    print(f"adaptive loop: {steps} RL steps in {elapsed:.1f}s; sessions "
          + ", ".join(f"{results[s]['w0']['start_step']}->{results[s]['w0']['end_step']} "
                      f"loss {_mean(results[s]['w0']['losses']):.3f}" for s in range(steps)))
    assert elapsed < 120, elapsed


def test_training_worker_killed(tmp_path):
    """SIGKILL of a training rank mid-session: rollout_done still returns within its deadline and
    reports it lost; the survivor's session fails within the process-group timeout and is acked;
    the latest complete checkpoint still loads."""
    durations = {0: [0.3], 1: [0.6], 2: [5.0]}  # the driver ends this step itself, after the kill
    root = tmp_path / "ckpt"
    stop_timeout = 15.0
    loop = _Loop(root, durations, spot_kw={"interval": 2, "timeout_s": 6.0}, stop_timeout_s=stop_timeout)
    try:
        loop.begin(0)
        loop.expect(lambda m: m[0] == "promoted", n=2, timeout_s=30)
        end = time.monotonic() + 40
        while latest(root) is None and time.monotonic() < end:
            time.sleep(0.05)
        assert latest(root) is not None, "no checkpoint before the kill"
        loop.procs[1].kill()  # w1 = rank 1 of the session
        loop.procs[1]._tlt_killed = True
        loop.procs[1].join(5)
        t = time.monotonic()
        out = loop.coord.rollout_done(0)
        done_s = time.monotonic() - t
        assert out.reachable, out
        assert "w1" in out.lost + out.timed_out, out
        assert "w1" not in out.stopped
        assert done_s < stop_timeout + 3, done_s
        # the survivor's session ends (error or preempted) and it acks; it must not hang
        got = loop.expect(lambda m: m[0] in ("result", "error") and m[1] == "w0", timeout_s=30)
        assert got
    finally:
        loop.close()
    step = latest(root)
    dcfg, embed, head = _target()
    d = Drafter(dcfg, embed, head)
    st = TrainState(d, torch.optim.AdamW(d.parameters()))
    assert load(root, {"train": st}) == step and st.step == step
