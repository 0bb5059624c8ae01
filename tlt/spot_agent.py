"""Spot agent: the training side of one rollout worker, driven by the coordinator.

Owns the wiring between a :class:`coordinator.WorkerClient` and the FSDP2 spot trainer, so a
rollout replica only says ``idle(step)`` when its requests drained and ``busy(step)`` when the next
rollout begins. Everything between is the agent's:

- PROMOTE puts the worker in a session; the trainer's process group is formed from SESSION
  messages only (every member gets each one, with the member list and a coordinator-wide epoch),
  never from PROMOTE, whose list may still grow in the same batch.
- One process group per epoch: rank = position in the member list, rendezvous at the leader's host
  on port ``base + epoch % port_span`` (a fresh port per formation: torch keeps the last session's
  store, and its port, alive until the next one). Pick the base port (the worker's
  ``trainer_address``) below the kernel's ephemeral range (``ip_local_port_range``, usually from
  32768), as torch's 29500 is, so no outgoing connection can occupy a rendezvous port.
- A newer epoch while training (a late idle worker joined, or a member was lost) preempts the
  running group at the next micro-step boundary on every rank; it checkpoints, and the new group
  resumes from that checkpoint. So a joiner trains from its first formation, not the next session.
- A formation that fails (a rank died mid-collective, a rendezvous timed out) is retried when a
  newer epoch arrives within ``regroup_wait_s`` (the coordinator sends one when it declares the
  dead member lost); otherwise the worker leaves the session, reporting the failure.
- STOP (rollout done, leader lost, coordinator lost) preempts, the final checkpoint is written,
  then the agent acks: BUSY after ``rollout_done`` (the GPU goes back to the RL step), IDLE after
  ``leader_lost`` / ``coordinator_lost`` (still idle in this rollout: the coordinator regroups it).
  Leaving on its own (``max_steps``, ``no_data``, failure) acks BUSY: nothing to train until the
  next rollout, so the coordinator does not promote it straight back.
- ``busy()`` returns once training stopped, or raises :class:`TrainingDidNotStop` after
  ``busy_timeout_s`` (the session still holds the device: its caller must not serve meanwhile).
- ``busy()`` wins every race: a session it interrupts acks BUSY whatever stopped it first, and a
  PROMOTE that arrives after ``busy()`` (decided on the earlier IDLE) starts nothing; the queued
  BUSY report declines it. Each PROMOTE gets its own state, so a late thread of an earlier
  session can never touch the next one.
- A session's thread runs at the nice value ``AgentConfig.nice`` (Linux, where niceness is per
  thread; the threads it starts, gloo's included, inherit it): training takes the CPU cycles the
  rollout does not want, the CPU's counterpart of a GPU the long tail left idle.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import sys
import threading
from collections.abc import Callable

from tlt.coordinator import WorkerClient, WorkerConfig
from tlt.coordinator.protocol import Promote, Session, Stop
from tlt.drafter.spot import NextBatch, PreemptFlag, SessionResult, SessionSpec, SpotTrainer

log = logging.getLogger(__name__)


class TrainingDidNotStop(RuntimeError):
    """A session asked to stop by ``busy()`` still runs after ``AgentConfig.busy_timeout_s``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentConfig:
    port_span: int = 256         # rendezvous ports used: leader's base port + 0..port_span-1
    formation_wait_s: float = 10.0  # after PROMOTE or a failure: wait this long for a SESSION epoch
    busy_timeout_s: float = 60.0    # busy(): wait at most this for a running session to stop
    nice: int = 0                   # a session thread's nice value (Linux; 0: the process's own)

    def __post_init__(self) -> None:
        if not 1 <= self.port_span <= 4096:
            raise ValueError(f"port_span={self.port_span}: use 1..4096 ports")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"nice={self.nice}: use a nice value in 0..19 (19: train only on cycles nothing "
                             "else wants)")
        if self.formation_wait_s <= 0 or self.busy_timeout_s <= 0:
            raise ValueError(f"formation_wait_s={self.formation_wait_s} and busy_timeout_s="
                             f"{self.busy_timeout_s} must be > 0 seconds")


@dataclasses.dataclass(frozen=True)
class Formation:
    """One process group of one session, as this worker joins it."""

    session: int
    epoch: int
    members: tuple[str, ...]
    rank: int
    master_addr: str
    master_port: int
    rl_step: int  # the RL step this worker was idle in


@dataclasses.dataclass(frozen=True)
class FormationRecord:
    formation: Formation
    result: SessionResult | None  # None when it failed
    error: str = ""


MakeTrainer = Callable[[SessionSpec], SpotTrainer]


@dataclasses.dataclass(eq=False)
class _SessionState:
    """One accepted PROMOTE's state, shared by the client thread and that session's thread only."""

    promote: Promote
    rl_step: int
    latest: Session | None = None      # newest SESSION (epoch, members)
    stop: str | None = None            # why the session ends: STOP reason, or "busy"
    flag: PreemptFlag | None = None    # preempts the running formation
    formed_epoch: int = 0
    thread: threading.Thread | None = None
    acked: bool = False                # the session's end was reported: no longer training


def lower_thread_priority(nice: int) -> bool:
    """Raise the calling thread's nice value to at least ``nice`` (Linux only: elsewhere niceness
    is per process, and the process also serves rollouts). Returns whether it was applied."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    except OSError as e:
        log.warning("spot session: could not set nice %d on thread %d: %r", nice, tid, e)
        return False
    return True


def rendezvous_endpoint(leader_address: str, epoch: int, port_span: int) -> tuple[str, int]:
    """``tcp://host:port`` (or ``host:port``) of the leader -> (host, port for this epoch)."""
    addr = leader_address.split("://", 1)[-1]
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"trainer address {leader_address!r}: use tcp://HOST:PORT (the base port of "
                         "the leader's rendezvous ports)")
    base = int(port)
    if not 0 < base or base + port_span > 65536:
        raise ValueError(f"trainer address {leader_address!r}: base port {base} + port_span "
                         f"{port_span} must stay within 1..65535")
    return host, base + epoch % port_span


class SpotAgent:
    """``make_trainer(spec)`` builds this rank's trainer for a formation; ``batches(formation)``
    returns its ``next_batch`` (the same draws on every rank of the formation)."""

    def __init__(self, worker: WorkerConfig, *, make_trainer: MakeTrainer,
                 batches: Callable[[Formation], NextBatch], config: AgentConfig = AgentConfig(),
                 on_record: Callable[[FormationRecord], None] | None = None) -> None:
        if worker.trainer_address:
            rendezvous_endpoint(worker.trainer_address, 0, config.port_span)  # validate early
        self.cfg, self.worker_id = config, worker.worker_id
        self._make_trainer, self._batches, self._on_record = make_trainer, batches, on_record
        self.client = WorkerClient(worker, on_command=self._on_command)
        self.records: collections.deque[FormationRecord] = collections.deque(maxlen=1024)
        self._cond = threading.Condition()
        self._cur: _SessionState | None = None  # the session of the last accepted PROMOTE
        self._idle = False                      # between idle() and busy(): may take a PROMOTE
        self._step = 0

    # ---- rollout side ---------------------------------------------------------------------------
    def start(self, step: int = 0) -> SpotAgent:
        self._step = step
        self.client.start("BUSY", step)
        return self

    def idle(self, step: int) -> None:
        """This worker's rollout requests for ``step`` drained: its accelerator may train.
        Ignored (logged) while an earlier session is still running: it acks when it ends."""
        with self._cond:
            if self._running():
                log.warning("worker %s: idle(%d) while session %d still runs; not reported",
                            self.worker_id, step, self._cur.promote.session)
                return
            self._step, self._idle = step, True
            self.client.report("IDLE", step)  # (never blocks) under the lock: reports keep the calls' order

    def busy(self, step: int) -> None:
        """Rollout of ``step`` begins: stop training (checkpointed) if any, then report BUSY.
        :class:`TrainingDidNotStop` if a session did not stop within ``busy_timeout_s``: it is left
        running and acks BUSY itself when it ends (nothing is reported now)."""
        with self._cond:
            self._idle = False  # a PROMOTE racing this call is refused (the BUSY below declines it)
            cur = self._cur if self._running() else None
            if cur is not None:
                cur.stop = "busy"  # ack BUSY: the rollout has begun, whatever stopped it first
                if cur.flag is not None:
                    cur.flag.set()
                self._cond.notify_all()
        if cur is not None:
            cur.thread.join(self.cfg.busy_timeout_s)
            if cur.thread.is_alive():
                raise TrainingDidNotStop(f"worker {self.worker_id}: spot session {cur.promote.session} did not stop "
                                         f"within busy_timeout_s={self.cfg.busy_timeout_s:.0f}s; it still holds "
                                         "the device (it acks BUSY when it ends)")
        with self._cond:  # an idle() meanwhile (its rollout drained while this one waited) reported first
            self._step, self._idle = step, False
            self.client.report("BUSY", step)

    @property
    def training(self) -> bool:
        with self._cond:
            return self._running()

    def close(self) -> None:
        try:
            self.busy(self._step)
        except TrainingDidNotStop:  # (a daemon thread: it goes with the process)
            log.exception("worker %s: closing with a session still running", self.worker_id)
        self.client.close()

    def __enter__(self) -> SpotAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _running(self) -> bool:
        cur = self._cur
        return cur is not None and cur.thread is not None and cur.thread.is_alive() and not cur.acked

    # ---- coordinator side (client thread: signal and return) ------------------------------------
    def _on_command(self, cmd: Promote | Session | Stop) -> None:
        with self._cond:
            if isinstance(cmd, Promote):
                if not self._idle:
                    log.info("worker %s: PROMOTE to session %d after busy(): declined", self.worker_id,
                             cmd.session)
                    return
                cur = self._cur = _SessionState(cmd, self._step)
                cur.thread = threading.Thread(target=self._run, args=(cur,), daemon=True,
                                              name=f"tlt-spot-{self.worker_id}-s{cmd.session}")
                cur.thread.start()
                return
            cur = self._cur
            if cur is None or cmd.session != cur.promote.session:
                return
            if isinstance(cmd, Session):
                if cur.latest is None or cmd.epoch > cur.latest.epoch:
                    cur.latest = cmd
                    if cur.flag is not None and cmd.epoch > cur.formed_epoch:
                        cur.flag.set()  # regroup at the next micro-step boundary
            else:
                cur.stop = cur.stop or cmd.reason
                if cur.flag is not None:
                    cur.flag.set()
            self._cond.notify_all()

    # ---- session thread -------------------------------------------------------------------------
    def _next_formation(self, cur: _SessionState) -> Formation | None:
        """Block until a newer epoch (-> its formation) or a stop / timeout (-> None)."""
        with self._cond:
            newer = lambda: cur.latest is not None and cur.latest.epoch > cur.formed_epoch
            self._cond.wait_for(lambda: cur.stop is not None or newer(), self.cfg.formation_wait_s)
            if cur.stop is not None or not newer():
                return None
            s = cur.latest
            if self.worker_id not in s.members:
                log.warning("worker %s: not a member of session %d epoch %d %s", self.worker_id,
                            s.session, s.epoch, s.members)
                return None
            cur.formed_epoch, cur.flag = s.epoch, PreemptFlag()
        host, port = rendezvous_endpoint(cur.promote.leader_address, s.epoch, self.cfg.port_span)
        return Formation(s.session, s.epoch, s.members, s.members.index(self.worker_id), host, port,
                         cur.rl_step)

    def _run(self, cur: _SessionState) -> None:
        lower_thread_priority(self.cfg.nice)
        ok, voluntary, formed = True, False, False
        try:
            while (f := self._next_formation(cur)) is not None:
                formed = True
                spec = SessionSpec(rank=f.rank, world_size=len(f.members), master_addr=f.master_addr,
                                   master_port=f.master_port, session_id=f"s{f.session}e{f.epoch}")
                try:
                    res = self._make_trainer(spec).run(self._batches(f), cur.flag)
                except Exception as e:  # noqa: BLE001 - a failed group may be re-formed
                    log.warning("worker %s: session %d epoch %d (rank %d of %d) failed: %r",
                                self.worker_id, f.session, f.epoch, f.rank, len(f.members), e)
                    self._record(FormationRecord(f, None, repr(e)))
                    ok = False
                    continue
                ok = True
                self._record(FormationRecord(f, res))
                if res.stop_reason != "preempted":  # max_steps / no_data: nothing left to train
                    voluntary = True
                    break
        except Exception:  # a bug here must still ack, or the coordinator waits for the deadline
            log.exception("worker %s: session thread failed", self.worker_id)
            ok = False
        with self._cond:
            reason = cur.stop
            cur.flag = None
            if reason is None and not voluntary and not formed:
                ok = False  # no SESSION came within formation_wait_s: report it
            idle = reason in ("leader_lost", "coordinator_lost") and ok and not voluntary
            cur.acked = True
            self.client.report("IDLE" if idle else "BUSY", cur.rl_step, ok=ok)
        log.info("worker %s: left session %d (%s), acked %s", self.worker_id, cur.promote.session,
                 reason or ("done" if voluntary else "failed"), "IDLE" if idle else "BUSY")

    def _record(self, rec: FormationRecord) -> None:
        self.records.append(rec)
        if self._on_record is not None:
            try:
                self._on_record(rec)
            except Exception:
                log.exception("worker %s: on_record failed", self.worker_id)
