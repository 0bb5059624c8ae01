"""Promotion: which idle workers train, in which session, and when training stops.

Pure logic over a worker table. Every input (a report, a lost worker, the driver's rollout-done, the
passing of time) returns ``Decisions``: the messages to send (by worker id), the finished stop
barriers for the driver, and events for observers. No sockets and no clock of its own (``now`` is
passed in, ``time.monotonic`` seconds), so the rules are tested directly and decision latency is
measurable apart from the transport.

Rules
- Rollout gating: IDLE reports for a step whose rollout is already done (``step <= done_step``) are
  never promoted; they wait for the worker's next-step reports. STEP_BEGIN of step ``s`` implies
  the rollouts of all steps before ``s`` are done. Nobody is promoted before the driver's first
  STEP_BEGIN or ROLLOUT_DONE (a coordinator restarted after ROLLOUT_DONE of step ``s`` would
  otherwise promote the workers still IDLE at ``s`` onto GPUs the RL step is using); the IDLE
  workers it then finds promotable are promoted at once.
- Threshold: when IDLE (promotable) + TRAINING (in live sessions) >= ``idle_threshold``, every
  promotable IDLE worker is promoted, oldest idle first. So the first crossing promotes the whole
  idle pool at once, and each later idle worker is promoted as soon as it reports.
- Sessions are per data-parallel group: the first promoted worker of a group with no live session
  leads a new one; later ones join it (PROMOTE to the joiner at once). At most one live (not
  stopping) session per group. ``session_updates()``, which the broker calls once per batch of
  input, sends SESSION (a new epoch and the member list) to every member of each session that was
  formed or changed since the last call: a burst of promotions costs one SESSION per member, and a
  trainer with fixed process-group membership forms its group from SESSION, never from PROMOTE.
- Rollout done: every TRAINING worker gets STOP with a deadline; the driver's barrier completes when
  all have acked (STOPPED) or the deadline passes. A worker that misses its STOP deadline is LOST.
- Lost or departing leader: the session is ended (STOP to its members, reason ``leader_lost``).
  Members that ack as IDLE in a still-open rollout are promoted again at once, so the group gets a
  new session whose leader is its first eligible worker. (No in-place leader hand-over: a new
  session is simpler for the trainer and costs one checkpoint, which training writes anyway.)
- Out-of-order input (a transition the state machine forbids, a non-increasing ``seq``, STOPPED or
  acceptance for a session the worker is not in) raises ``ProtocolError``; nothing is changed.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from tlt.coordinator.protocol import (
    MAX_LIST,
    Message,
    Promote,
    ProtocolError,
    Register,
    Role,
    Session,
    State,
    Stop,
    Stopped,
    WorkerState,
)
from tlt.coordinator.states import Cause, transition

BUSY, IDLE, TRAINING, LOST = WorkerState.BUSY, WorkerState.IDLE, WorkerState.TRAINING, WorkerState.LOST


@dataclass(frozen=True, kw_only=True)
class PromotionConfig:
    idle_threshold: int = 2        # promote once this many workers are free (idle + training)
    stop_timeout_s: float = 10.0   # a TRAINING worker must ack STOP within this, else LOST
    max_workers: int = 1024        # registrations beyond this are refused (bounds memory)

    def __post_init__(self) -> None:
        if self.idle_threshold < 1:
            raise ValueError(f"idle_threshold={self.idle_threshold}: must be >= 1 (1 = train as soon "
                             "as any worker is idle)")
        if not self.stop_timeout_s > 0:
            raise ValueError(f"stop_timeout_s={self.stop_timeout_s}: must be > 0 seconds")
        if not 1 <= self.max_workers <= MAX_LIST:
            raise ValueError(f"max_workers={self.max_workers}: use 1..{MAX_LIST} (the most worker ids one "
                             "protocol message can list)")


@dataclass(frozen=True)
class Event:
    """Something the coordinator decided or observed (for tests, benches, metrics)."""

    kind: str        # registered|state|promote|accept|decline|stop|stopped|lost|session_end|
                     # step_begin|rollout_done|outcome|dropped
    worker_id: str   # "" for events not about one worker
    t: float         # time.monotonic()
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BarrierResult:
    """A rollout-done barrier finished: reply to the driver identified by ``token``."""

    token: Hashable
    step: int
    stopped: tuple[str, ...]
    timed_out: tuple[str, ...]
    lost: tuple[str, ...]
    elapsed_s: float


@dataclass
class Decisions:
    sends: list[tuple[str, Message]] = field(default_factory=list)   # (worker_id, message)
    results: list[BarrierResult] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)


@dataclass(slots=True)
class WorkerRecord:
    worker_id: str
    dp_group: int
    rank: int
    address: str
    state: WorkerState
    step: int
    seq: int
    since: float                      # time of the last state change
    session: int | None = None
    accepted: bool = False            # TRAINING confirmed by the worker
    stop_deadline: float | None = None


@dataclass(slots=True)
class _Session:
    id: int
    dp_group: int
    step: int
    leader: str
    leader_address: str
    members: list[str]                # leader first
    stopping: bool = False


@dataclass(slots=True)
class _Barrier:
    token: Hashable
    step: int
    t0: float
    deadline: float
    waiting: set[str]
    stopped: list[str] = field(default_factory=list)
    timed_out: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)


class Promotion:
    """``first_epoch``: the epoch of the first SESSION (the broker starts from the wall clock in ms,
    so a restarted coordinator does not repeat the epochs, and rendezvous ports, of its last life)."""

    def __init__(self, cfg: PromotionConfig, first_epoch: int = 1):
        self.cfg = cfg
        self.workers: dict[str, WorkerRecord] = {}
        self.sessions: dict[int, _Session] = {}
        self._live: dict[int, int] = {}           # dp_group -> live (not stopping) session id
        self._barriers: list[_Barrier] = []
        self.current_step = -1
        self.done_step = -1                        # highest step whose rollout is done
        self._next_session = 1
        self._next_epoch = first_epoch
        self._out = Decisions()
        self._changed: set[int] = set()            # sessions whose members changed since the last SESSION

    # ---- inputs ---------------------------------------------------------------------------------

    def register(self, msg: Register, now: float) -> Decisions:
        old = self.workers.get(msg.worker_id)
        if old is None and len(self.workers) >= self.cfg.max_workers:
            raise ProtocolError("refused", f"max_workers={self.cfg.max_workers} reached")
        if old is not None:  # re-registration (new connection): the old incarnation is gone
            self._lose(old, "reregistered", now)
        w = WorkerRecord(msg.worker_id, msg.dp_group, msg.rank, msg.address,
                         transition(None, msg.state, Cause.REGISTER), msg.step, msg.seq, now)
        self.workers[w.worker_id] = w
        self._event("registered", w.worker_id, now, state=w.state.value, step=w.step, dp_group=w.dp_group)
        self._promote_if_due(w, now)
        return self._flush()

    def report(self, worker_id: str, msg: State, now: float) -> Decisions:
        w = self._known(worker_id)
        self._check_seq(w, msg.seq)
        if msg.state is TRAINING:
            if w.state is not TRAINING or w.session != msg.session or w.accepted:
                raise ProtocolError("out_of_order", f"{worker_id} accepts session {msg.session} but "
                                    f"is {w.state.value} in session {w.session} (accepted={w.accepted})")
            transition(w.state, TRAINING, Cause.ACCEPT)
            w.accepted, w.seq, w.step = True, msg.seq, msg.step
            self._event("accept", worker_id, now, session=msg.session)
        elif w.state is TRAINING:
            if w.accepted:
                raise ProtocolError("out_of_order", f"{worker_id} reports {msg.state.value} while "
                                    f"training session {w.session}: expected STOPPED")
            transition(w.state, msg.state, Cause.DECLINE)
            w.seq, w.step = msg.seq, msg.step
            self._event("decline", worker_id, now, session=w.session, state=msg.state.value)
            self._leave(w, msg.state, now, acked=True)
        else:
            new = transition(w.state, msg.state, Cause.REPORT)
            if new is not w.state:
                w.since = now
            w.state, w.seq, w.step = new, msg.seq, msg.step
            self._event("state", worker_id, now, state=new.value, step=msg.step)
        self._promote_if_due(w, now)
        return self._flush()

    def stopped(self, worker_id: str, msg: Stopped, now: float) -> Decisions:
        w = self._known(worker_id)
        self._check_seq(w, msg.seq)
        if w.state is not TRAINING or w.session != msg.session:
            raise ProtocolError("out_of_order", f"{worker_id} STOPPED session {msg.session} but is "
                                f"{w.state.value} in session {w.session}")
        transition(w.state, msg.state, Cause.STOPPED)
        w.seq, w.step = msg.seq, max(w.step, msg.step)
        self._event("stopped", worker_id, now, session=msg.session, ok=msg.ok, state=msg.state.value)
        self._leave(w, msg.state, now, acked=True)
        self._promote_if_due(w, now)
        return self._flush()

    def lose(self, worker_id: str, reason: str, now: float) -> Decisions:
        """The worker is gone (heartbeats missed, dropped, disconnected). Unknown ids are ignored."""
        w = self.workers.get(worker_id)
        if w is not None:
            self._lose(w, reason, now)
        return self._flush()

    def step_begin(self, step: int, now: float) -> Decisions:
        self.current_step = max(self.current_step, step)
        self.done_step = max(self.done_step, step - 1)
        self._event("step_begin", "", now, step=step)
        self._promote_waiting(now)
        return self._flush()

    def rollout_done(self, step: int, now: float, token: Hashable,
                     deadline_s: float | None = None) -> Decisions:
        """Stop every TRAINING worker; the barrier for ``token`` completes on all acks or the deadline."""
        self.done_step = max(self.done_step, step)
        self.current_step = max(self.current_step, step)
        timeout = self.cfg.stop_timeout_s if deadline_s is None else min(self.cfg.stop_timeout_s, deadline_s)
        deadline = now + timeout
        for s in list(self.sessions.values()):
            self._stop_session(s, "rollout_done", now, deadline)
        waiting = {w.worker_id for w in self.workers.values() if w.state is TRAINING}
        for wid in waiting:  # already stopping for another reason: this barrier's deadline binds too
            w = self.workers[wid]
            w.stop_deadline = deadline if w.stop_deadline is None else min(w.stop_deadline, deadline)
        self._barriers.append(_Barrier(token, step, now, deadline, waiting))
        self._event("rollout_done", "", now, step=step, training=len(waiting))
        self._complete_barriers(now)
        self._promote_waiting(now)
        return self._flush()

    def tick(self, now: float) -> Decisions:
        """Enforce deadlines: STOP not acked in time -> LOST; barriers past their deadline finish."""
        for w in [w for w in self.workers.values() if w.stop_deadline is not None and now >= w.stop_deadline]:
            self._lose(w, "stop_timeout", now)
        for b in self._barriers:
            if now >= b.deadline:
                for wid in list(b.waiting):
                    if wid in self.workers:
                        self._lose(self.workers[wid], "stop_timeout", now)
        self._complete_barriers(now, force=True)
        return self._flush()

    def session_updates(self) -> Decisions:
        """SESSION (new epoch, current members) to every member of each live session that was
        formed or whose membership changed since the last call."""
        for sid in sorted(self._changed):
            s = self.sessions.get(sid)
            if s is not None and not s.stopping:
                msg = Session(session=s.id, epoch=self._next_epoch, members=tuple(s.members))
                self._next_epoch += 1
                for wid in s.members:
                    self._send(wid, msg)
        self._changed.clear()
        return self._flush()

    def next_deadline(self) -> float | None:
        times = [w.stop_deadline for w in self.workers.values() if w.stop_deadline is not None]
        times += [b.deadline for b in self._barriers]
        return min(times) if times else None

    def snapshot(self) -> dict[str, tuple[WorkerState, int | None]]:
        return {wid: (w.state, w.session) for wid, w in self.workers.items()}

    # ---- rules ----------------------------------------------------------------------------------

    def _promote_if_due(self, changed: WorkerRecord, now: float) -> None:
        """Called after ``changed`` changed state: only a newly promotable IDLE worker can make a
        promotion due (losses and stops only lower the count)."""
        if changed.state is not IDLE or changed.step <= self.done_step or self.current_step < 0:
            return
        idle = [w for w in self.workers.values() if w.state is IDLE and w.step > self.done_step]
        training = sum(1 for w in self.workers.values()
                       if w.state is TRAINING and w.session in self.sessions
                       and not self.sessions[w.session].stopping)
        if len(idle) + training < self.cfg.idle_threshold:
            return
        idle.sort(key=lambda w: (w.since, w.rank, w.worker_id))
        for w in idle:
            sid = self._live.get(w.dp_group)
            if sid is None:
                s = _Session(self._next_session, w.dp_group, w.step, w.worker_id, w.address, [w.worker_id])
                self._next_session += 1
                self.sessions[s.id] = s
                self._live[w.dp_group] = s.id
                role = Role.LEADER
            else:
                s = self.sessions[sid]
                s.members.append(w.worker_id)
                role = Role.MEMBER
            self._changed.add(s.id)
            w.state = transition(w.state, TRAINING, Cause.PROMOTE)
            w.session, w.accepted, w.since = s.id, False, now
            self._send(w.worker_id, Promote(session=s.id, step=s.step, dp_group=s.dp_group, role=role,
                                            leader=s.leader, leader_address=s.leader_address,
                                            members=tuple(s.members), seq=w.seq))
            self._event("promote", w.worker_id, now, session=s.id, role=role.value, dp_group=s.dp_group)

    def _promote_waiting(self, now: float) -> None:
        """The driver spoke: workers that reported IDLE before it (a coordinator that started or
        restarted mid-rollout) are promoted now if due, not at their next report."""
        waiting = next((w for w in self.workers.values() if w.state is IDLE and w.step > self.done_step), None)
        if waiting is not None:
            self._promote_if_due(waiting, now)  # promotes every due worker, not only this one

    def _stop_session(self, s: _Session, reason: str, now: float, deadline: float | None = None) -> None:
        if s.stopping:
            return
        s.stopping = True
        if self._live.get(s.dp_group) == s.id:
            del self._live[s.dp_group]
        deadline = now + self.cfg.stop_timeout_s if deadline is None else deadline
        for wid in s.members:
            w = self.workers[wid]
            w.stop_deadline = deadline
            self._send(wid, Stop(session=s.id, step=s.step, reason=reason,
                                 deadline_ms=max(1, int((deadline - now) * 1000))))
            self._event("stop", wid, now, session=s.id, reason=reason)
        self._event("session_end", "", now, session=s.id, reason=reason, members=list(s.members))

    def _leave(self, w: WorkerRecord, new_state: WorkerState, now: float, *, acked: bool) -> None:
        """``w`` leaves its session (acked STOP, declined, or lost) and becomes ``new_state``."""
        sid = w.session
        w.state, w.session, w.accepted, w.stop_deadline, w.since = new_state, None, False, None, now
        for b in self._barriers:
            if w.worker_id in b.waiting:
                b.waiting.discard(w.worker_id)
                if acked:
                    b.stopped.append(w.worker_id)
        self._complete_barriers(now)
        s = self.sessions.get(sid) if sid is not None else None
        if s is None:
            return
        s.members.remove(w.worker_id)
        if not s.members:
            if self._live.get(s.dp_group) == s.id:
                del self._live[s.dp_group]
            del self.sessions[s.id]
            self._changed.discard(s.id)
        elif w.worker_id == s.leader and not s.stopping:
            self._stop_session(s, "leader_lost", now)
        elif not s.stopping:
            self._changed.add(s.id)

    def _lose(self, w: WorkerRecord, reason: str, now: float) -> None:
        transition(w.state, LOST, Cause.LOST)
        for b in self._barriers:
            if w.worker_id in b.waiting:
                b.waiting.discard(w.worker_id)
                (b.timed_out if reason == "stop_timeout" else b.lost).append(w.worker_id)
        self._leave(w, LOST, now, acked=False)
        del self.workers[w.worker_id]
        self._event("lost", w.worker_id, now, reason=reason)

    def _complete_barriers(self, now: float, force: bool = False) -> None:
        keep = []
        for b in self._barriers:
            if b.waiting and not (force and now >= b.deadline):
                keep.append(b)
                continue
            r = BarrierResult(b.token, b.step, tuple(b.stopped), tuple(b.timed_out + sorted(b.waiting)),
                              tuple(b.lost), now - b.t0)
            self._out.results.append(r)
            self._event("outcome", "", now, step=b.step, stopped=len(r.stopped),
                        timed_out=len(r.timed_out), lost=len(r.lost), elapsed_s=r.elapsed_s)
        self._barriers = keep

    # ---- helpers --------------------------------------------------------------------------------

    def _known(self, worker_id: str) -> WorkerRecord:
        w = self.workers.get(worker_id)
        if w is None:
            raise ProtocolError("out_of_order", f"{worker_id!r} is not registered")
        return w

    @staticmethod
    def _check_seq(w: WorkerRecord, seq: int) -> None:
        if seq <= w.seq:
            raise ProtocolError("out_of_order", f"{w.worker_id} seq {seq} <= last seq {w.seq}")

    def _send(self, worker_id: str, msg: Message) -> None:
        self._out.sends.append((worker_id, msg))

    def _event(self, kind: str, worker_id: str, now: float, **detail: Any) -> None:
        self._out.events.append(Event(kind, worker_id, now, detail))

    def _flush(self) -> Decisions:
        out, self._out = self._out, Decisions()
        return out
