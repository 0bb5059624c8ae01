"""Simulated RL steps of the adaptive drafter on one machine: real processes, sockets and FSDP2.

Owns the harness that ``tests/test_adaptive_loop.py`` and ``examples/adaptive_loop.py`` drive: a
coordinator (a thread of this process, or its own process so it can be killed), and one spawned
process per rollout worker. Each worker runs a :class:`~tlt.spot_agent.SpotAgent` with a
:class:`~tlt.drafter.buffer.DataBuffer`; per RL step it "rolls out" for its configured duration (adding
that step's feature samples to its buffer), then reports IDLE, except the last worker, the long
tail, whose end is the end of the rollout. Idle workers are promoted and train the drafter with
FSDP2/gloo until the driver calls :meth:`SimLoop.rollout_done`.

The data is synthetic but learnable: token ``x_{t+1} = (a x_t + b) mod V`` and a hidden feature
that encodes the next token plus noise, so the drafter's loss falls across steps. Every worker
adds the same seeded samples, so the shared seeded draws of one formation agree on all ranks.
Every wait is bounded.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tlt.drafter.seeds import derive
from tlt.coordinator import (
    Coordinator,
    CoordinatorConfig,
    DriverClient,
    PromotionConfig,
    WorkerConfig,
)
from tlt.coordinator.driver import RolloutOutcome
from tlt.drafter.buffer import BufferConfig, DataBuffer
from tlt.drafter.eagle import DrafterConfig
from tlt.drafter.model_config import ModelConfig
from tlt.drafter.packing import FeatureSample
from tlt.drafter.resume_state import WarmStore
from tlt.drafter.spot import SpotConfig, SpotTrainer
from tlt.drafter.ttt import TTTConfig
from tlt.ports import free_port
from tlt.spot_agent import AgentConfig, FormationRecord, SpotAgent, TrainingDidNotStop

log = logging.getLogger(__name__)

V, H = 64, 32
RULE = (5, 7)  # x_{t+1} = (a * x_t + b) % V: a permutation, so the drafter can learn it


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimConfig:
    durations: tuple[tuple[float, ...], ...]  # [worker][step] rollout seconds; last = the long tail
    idle_threshold: int = 2
    heartbeat_s: float = 0.1
    liveness: int = 20  # generous: the CPU is shared with training, heartbeats must not starve
    stop_timeout_s: float = 20.0
    samples_per_step: int = 32
    spot: SpotConfig = SpotConfig(lr=1e-2, token_budget=192, interval=10_000, ttt=TTTConfig(steps=2),
                                  seed=3, timeout_s=30.0)
    agent: AgentConfig = AgentConfig()
    coordinator_process: bool = False  # True: `python -m tlt.coordinator` in its own (killable) process

    def __post_init__(self) -> None:
        if len(self.durations) < 2 or len({len(d) for d in self.durations}) != 1 or not self.durations[0]:
            raise ValueError("durations: give >= 2 workers, each with one rollout time per step")
        if any(t < 0 for d in self.durations for t in d):
            raise ValueError(f"durations={self.durations}: rollout times must be >= 0 seconds")
        if self.idle_threshold < 1 or self.samples_per_step < 1:
            raise ValueError(f"idle_threshold={self.idle_threshold}, samples_per_step="
                             f"{self.samples_per_step}: both must be >= 1")

    @property
    def steps(self) -> int:
        return len(self.durations[0])


def target() -> tuple[DrafterConfig, torch.Tensor, torch.Tensor]:
    """The simulated target's drafter config and its frozen embedding / LM head."""
    tcfg = ModelConfig(model_type="llama", vocab_size=V, hidden_size=H, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    g = torch.Generator().manual_seed(11)
    embed = torch.randn(V, H, generator=g)
    head = torch.randn(V, H, generator=g) * 0.3
    return DrafterConfig.for_target(tcfg, "eagle"), embed, head


def rollout_samples(step: int, n_samples: int) -> list[FeatureSample]:
    """What the rollout of RL ``step`` yields (seeded by the step: identical on every worker)."""
    g = torch.Generator().manual_seed(1000 + step)
    table = torch.randn(V, H, generator=torch.Generator().manual_seed(12))
    a, b = RULE
    out = []
    for _ in range(n_samples):
        n = int(torch.randint(20, 33, (1,), generator=g))
        x = [int(torch.randint(0, V, (1,), generator=g))]
        for _ in range(n):
            x.append((a * x[-1] + b) % V)
        ids, nxt = torch.tensor(x[:n]), torch.tensor(x[1:n + 1])
        hidden = table[nxt] + 0.05 * torch.randn(n, H, generator=g)  # f_t = F[x_{t+1}] + noise
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n // 2:] = True
        out.append(FeatureSample(ids, mask, hidden))
    return out


# ---------------------------------------------------------------- worker process (spawned)
def _worker(i: int, cfg: SimConfig, coord_addr: str, port: int, root: str, ctl, out) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    wid, long_tail = f"w{i}", i == len(cfg.durations) - 1
    dcfg, embed, head = target()
    buf = DataBuffer(BufferConfig(dtype="float32", max_bytes=64 << 20))
    warm = WarmStore()  # this worker's sessions resume from memory, as a replica's do

    def make_trainer(spec):
        return SpotTrainer(spec=spec, config=cfg.spot, drafter_config=dcfg, embed_weight=embed,
                           head_weight=head, checkpoint_root=root, warm_store=warm)

    def batches(f):
        calls = itertools.count()  # the same seeded draws on every rank of the formation
        return lambda budget: buf.sample_batch(budget, seed=derive(f.epoch, next(calls)))

    def on_record(rec: FormationRecord) -> None:
        out.put(("record", wid, rec.formation.rl_step, dataclasses.asdict(rec)))

    agent = SpotAgent(WorkerConfig(address=coord_addr, worker_id=wid, trainer_address=f"tcp://127.0.0.1:{port}",
                                   heartbeat_interval_s=cfg.heartbeat_s, liveness=cfg.liveness,
                                   reconnect_initial_s=cfg.heartbeat_s, reconnect_max_s=4 * cfg.heartbeat_s),
                      make_trainer=make_trainer, batches=batches, config=cfg.agent, on_record=on_record)
    agent.start()
    try:
        out.put(("ready", wid, agent.client.wait_connected(30)))
        while (msg := ctl.get(timeout=600))[0] != "exit":
            step = msg[1]
            t0 = time.monotonic()
            try:
                agent.busy(step)
                out.put(("busy", wid, step, True))
            except TrainingDidNotStop:  # the driver sees a worker still training
                out.put(("busy", wid, step, False))
            for s in rollout_samples(step, cfg.samples_per_step):
                buf.add(s, step)
            try:  # the rollout runs; an "exit" ends it early
                if ctl.get(timeout=max(0.0, t0 + cfg.durations[i][step] - time.monotonic()))[0] == "exit":
                    break
            except queue.Empty:
                pass
            if long_tail:
                out.put(("complete", wid, step))  # the last request finished: rollout is done
            else:
                agent.idle(step)  # requests drained: this worker's accelerator may train
    finally:
        agent.close()


# ---------------------------------------------------------------- driver side
class SimLoop:
    """The driver of a simulated run. Use as a context manager; every wait is bounded."""

    def __init__(self, cfg: SimConfig, checkpoint_root: str | Path, on_event=None) -> None:
        self.cfg, self.root = cfg, Path(checkpoint_root)
        self.msgs: list[tuple] = []
        self._on_event = on_event
        self._coord: Coordinator | None = None
        self._coord_proc: subprocess.Popen | None = None
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self._start_coordinator()
        self.driver = DriverClient(self.address, timeout_s=cfg.stop_timeout_s + 5)
        ctx = multiprocessing.get_context("spawn")
        self.out = ctx.Queue()
        n = len(cfg.durations)
        self.ctls = [ctx.Queue() for _ in range(n)]
        self.procs = [ctx.Process(target=_worker, daemon=True, name=f"tlt-sim-w{i}", args=(
            i, cfg, self.address, free_port(cfg.agent.port_span), str(self.root), self.ctls[i], self.out))
            for i in range(n)]
        for p in self.procs:
            p.start()
        self.killed: set[int] = set()
        self.expect(lambda m: m[0] == "ready", n=n, timeout_s=120)

    # coordinator ------------------------------------------------------------------------------
    def _start_coordinator(self) -> None:
        c = self.cfg
        if c.coordinator_process:
            self._coord_proc = subprocess.Popen(
                [sys.executable, "-m", "tlt.coordinator", "--bind", self.address,
                 "--heartbeat-ms", str(int(c.heartbeat_s * 1000)), "--liveness", str(c.liveness),
                 "--idle-threshold", str(c.idle_threshold), "--stop-timeout-s", str(c.stop_timeout_s),
                 "--log-level", "ERROR"])
        else:
            self._coord = Coordinator(CoordinatorConfig(
                bind=self.address, heartbeat_interval_s=c.heartbeat_s, liveness=c.liveness,
                promotion=PromotionConfig(idle_threshold=c.idle_threshold, stop_timeout_s=c.stop_timeout_s)),
                on_event=self._on_event).start()

    @property
    def coordinator(self) -> Coordinator | None:
        """The embedded coordinator (None when it runs in its own process)."""
        return self._coord

    def kill_coordinator(self) -> None:
        if self._coord_proc is None:
            raise ValueError("kill_coordinator needs SimConfig(coordinator_process=True)")
        self._coord_proc.send_signal(signal.SIGKILL)
        self._coord_proc.wait(10)

    def restart_coordinator(self) -> None:
        if self._coord_proc is None or self._coord_proc.poll() is None:
            raise ValueError("restart_coordinator: kill it first (coordinator_process=True)")
        self._start_coordinator()

    # workers ----------------------------------------------------------------------------------
    def kill_worker(self, i: int) -> None:
        self.killed.add(i)
        self.procs[i].kill()
        self.procs[i].join(10)

    def begin(self, step: int, timeout_s: float = 10.0) -> bool:
        """Start RL step ``step`` on every live worker; True if the coordinator acknowledged it."""
        ok = self.driver.step_begin(step, timeout_s=timeout_s)
        for i, c in enumerate(self.ctls):
            if i not in self.killed:
                c.put(("step", step))
        return ok

    def wait_rollout(self, step: int, timeout_s: float = 120.0) -> None:
        """Until the long-tail worker finished ``step`` (the rollout is complete)."""
        self.expect(lambda m: m[0] == "complete" and m[2] == step, timeout_s=timeout_s)

    def rollout_done(self, step: int, timeout_s: float | None = None) -> RolloutOutcome:
        return self.driver.rollout_done(step, timeout_s=timeout_s)

    def records(self, step: int, worker: str | None = None) -> list[dict[str, Any]]:
        """Formation records (``FormationRecord`` as dicts) received so far for RL ``step``."""
        self.drain()
        return [m[3] for m in self.msgs if m[0] == "record" and m[2] == step and worker in (None, m[1])]

    def drain(self) -> None:
        while True:
            try:
                self.msgs.append(self.out.get_nowait())
            except queue.Empty:
                return

    def expect(self, pred, n: int = 1, timeout_s: float = 60.0) -> list[tuple]:
        """Wait (bounded) until ``n`` received messages satisfy ``pred``; returns them."""
        end = time.monotonic() + timeout_s
        while True:
            got = [m for m in self.msgs if pred(m)]
            if len(got) >= n:
                return got
            dead = [p.name for i, p in enumerate(self.procs) if i not in self.killed and not p.is_alive()]
            if time.monotonic() > end or dead:
                raise TimeoutError(f"waited {timeout_s:.0f}s (dead workers: {dead}); messages: "
                                   f"{[m[:3] for m in self.msgs]}")
            try:
                self.msgs.append(self.out.get(timeout=0.2))
            except queue.Empty:
                pass

    def close(self) -> None:
        for i, c in enumerate(self.ctls):
            if i not in self.killed:
                c.put(("exit",))
        end = time.monotonic() + 60
        for p in self.procs:
            while p.is_alive() and time.monotonic() < end:
                self.drain()  # a child cannot exit while its queued records are unread
                p.join(0.2)
            if p.is_alive():
                p.kill()
        self.drain()
        self.driver.close()
        if self._coord is not None:
            self._coord.stop()
        if self._coord_proc is not None and self._coord_proc.poll() is None:
            self._coord_proc.terminate()
            try:
                self._coord_proc.wait(10)
            except subprocess.TimeoutExpired:  # a coordinator that ignores SIGTERM is a bug: fail, leak nothing
                self._coord_proc.kill()
                self._coord_proc.wait()
                raise

    def __enter__(self) -> SimLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run(cfg: SimConfig, checkpoint_root: str | Path) -> list[dict[str, Any]]:
    """All RL steps, driven as verl would: begin, wait for the long tail, rollout_done.
    Returns per step: the rollout outcome and every formation record of that step."""
    outcomes = []
    with SimLoop(cfg, checkpoint_root) as loop:
        for step in range(cfg.steps):
            loop.begin(step)
            loop.wait_rollout(step)
            outcomes.append(loop.rollout_done(step))
            log.info("step %d: rollout done, stopped %s", step, outcomes[-1].stopped)
    return [{"step": s, "outcome": dataclasses.asdict(o), "records": loop.records(s)}
            for s, o in enumerate(outcomes)]
