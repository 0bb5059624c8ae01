"""Worker client: one rollout worker's link to the coordinator (DEALER, background thread).

The application (a rollout replica / spot trainer) calls ``report(state, step)`` on every BUSY/IDLE
transition and receives commands (``Promote``, ``Stop``, ``Session``) through ``on_command`` or the
``commands`` queue. ``report`` only appends to a deque and pokes the thread: it never blocks, whether
or not a coordinator is there, so rollout is never held up by the coordinator.

The client thread (zguide Paranoid Pirate worker) owns the socket and every piece of protocol state:

- REGISTER on each (re)connect with the current state (TRAINING registers as BUSY: a new connection
  never inherits a session), then HEARTBEAT whenever it has sent nothing for an interval.
- Any message from the coordinator counts as its heartbeat. Silent for ``liveness`` intervals, a
  DISCONNECT, or malformed input: close the socket, wait a backoff (doubling from
  ``reconnect_initial_s`` up to ``reconnect_max_s``, reset by WELCOME), open a new socket, register.
- Losing the coordinator while training delivers a ``Stop(reason="coordinator_lost")``: nobody would
  otherwise preempt training when rollout ends, so the worker stops on its own.
- A PROMOTE is accepted (reported back as STATE TRAINING) only if the worker is IDLE and has sent
  nothing since the report the decision echoes (``seq``); otherwise it is stale and ignored (the
  newer report tells the coordinator). STOP/SESSION for a session the worker is not in are ignored.
- While TRAINING, the application's next ``report(BUSY|IDLE)`` means "training stopped, checkpoint
  done" and goes out as STOPPED (the ack of a STOP, or a voluntary stop). Ack a STOP whose reason
  is ``rollout_done`` with BUSY (the GPU goes back to the RL step) and one with ``leader_lost`` with
  IDLE (still idle in this rollout: the coordinator regroups it under a new leader at once).

Command callbacks run on the client thread: keep them quick (signal the trainer, return).
"""

from __future__ import annotations

import collections
import logging
import numbers
import queue
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

import zmq

from tlt.coordinator.protocol import (
    MAX_INT,
    MAX_WIRE_BYTES_FROM_COORDINATOR,
    Disconnect,
    Heartbeat,
    Message,
    Promote,
    ProtocolError,
    Register,
    Session,
    State,
    Stop,
    Stopped,
    Welcome,
    WorkerState,
    decode,
    encode,
)

log = logging.getLogger(__name__)

BUSY, IDLE, TRAINING = WorkerState.BUSY, WorkerState.IDLE, WorkerState.TRAINING
Command = Union[Promote, Stop, Session]
_MAX_DRAIN = 256
_NOBLOCK = int(zmq.NOBLOCK)  # a plain int: pyzmq's IntFlag arithmetic costs microseconds per call


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    address: str                       # coordinator endpoint, e.g. tcp://10.0.0.1:5555
    worker_id: str                     # unique and stable across reconnects
    dp_group: int = 0                  # data-parallel group: sessions never span groups
    rank: int = 0
    trainer_address: str = ""          # rendezvous address announced if this worker leads a session
    heartbeat_interval_s: float = 1.0  # must match the coordinator's
    liveness: int = 3                  # coordinator silent this many intervals -> reconnect
    reconnect_initial_s: float = 0.5
    reconnect_max_s: float = 30.0

    def __post_init__(self) -> None:
        if not re.match(r"^(tcp|ipc|inproc)://.+", self.address):
            raise ValueError(f"address={self.address!r}: use tcp://HOST:PORT, ipc://PATH or inproc://NAME")
        if not self.worker_id or len(self.worker_id) > 128:
            raise ValueError(f"worker_id={self.worker_id!r}: use a non-empty id of at most 128 chars")
        if self.dp_group < 0 or self.rank < 0:
            raise ValueError(f"dp_group={self.dp_group}, rank={self.rank}: both must be >= 0")
        if not 0.001 <= self.heartbeat_interval_s <= 60:
            raise ValueError(f"heartbeat_interval_s={self.heartbeat_interval_s}: use 0.001..60 seconds")
        if self.liveness < 2:
            raise ValueError(f"liveness={self.liveness}: use >= 2")
        if not 0 < self.reconnect_initial_s <= self.reconnect_max_s:
            raise ValueError(f"reconnect_initial_s={self.reconnect_initial_s}, reconnect_max_s="
                             f"{self.reconnect_max_s}: need 0 < initial <= max")


class WorkerClient:
    def __init__(self, cfg: WorkerConfig, *, on_command: Callable[[Command], None] | None = None,
                 context: zmq.Context | None = None):
        self.cfg = cfg
        self.commands: queue.Queue[Command] = queue.Queue()  # used when on_command is None
        self._on_command = on_command or self.commands.put
        self._ctx = context or zmq.Context.instance()
        self._reports: collections.deque[tuple[WorkerState, int | None, bool]] = collections.deque()
        self._wake_addr = f"inproc://tlt-worker-{secrets.token_hex(6)}"
        self._poke: zmq.Socket | None = None
        self._poke_lock = threading.Lock()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self.connected = threading.Event()  # set once WELCOME arrives on the current connection
        # protocol state: written by the client thread only (readable anywhere)
        self.state = BUSY
        self.step = 0
        self.session: int | None = None
        self.coordinator_id = ""
        self.reconnects = 0
        self._seq = 0
        self._stop_seen: int | None = None
        self._sock: zmq.Socket | None = None
        self._poller = zmq.Poller()
        self._expiry = self._hb_due = self._reconnect_at = 0.0
        self._backoff = cfg.reconnect_initial_s

    # ---- application API (any thread) -----------------------------------------------------------

    def start(self, state: WorkerState | str = BUSY, step: int = 0) -> WorkerClient:
        if self._thread is not None:
            raise RuntimeError("WorkerClient.start() called twice")
        self.state, self.step = self._reportable(state), self._step(step)
        wake = self._ctx.socket(zmq.PAIR)
        wake.bind(self._wake_addr)
        self._poke = self._ctx.socket(zmq.PAIR)
        self._poke.connect(self._wake_addr)
        self._thread = threading.Thread(target=self._run, args=(wake,), daemon=True,
                                        name=f"tlt-worker-{self.cfg.worker_id}")
        self._thread.start()
        return self

    def report(self, state: WorkerState | str, step: int | None = None, *, ok: bool = True) -> None:
        """Report a transition to BUSY or IDLE (never blocks). From TRAINING it means "stopped";
        ``ok=False`` says the checkpoint failed."""
        self._reports.append((self._reportable(state), None if step is None else self._step(step), ok))
        self._wake()

    def wait_connected(self, timeout_s: float) -> bool:
        return self.connected.wait(timeout_s)

    def close(self, timeout_s: float = 2.0) -> None:
        """Say DISCONNECT (if connected) and stop the thread."""
        if self._thread is None or self._closing.is_set():
            return
        self._closing.set()
        self._wake()
        self._thread.join(timeout_s)
        with self._poke_lock:
            if self._poke is not None:
                self._poke.close(linger=0)
                self._poke = None

    def __enter__(self) -> WorkerClient:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _reportable(state: WorkerState | str) -> WorkerState:
        s = WorkerState(state)
        if s not in (BUSY, IDLE):
            raise ValueError(f"state={s.value}: workers report BUSY or IDLE (TRAINING comes from a "
                             "PROMOTE, LOST is the coordinator's verdict)")
        return s

    @staticmethod
    def _step(step: object) -> int:
        """An RL step as the wire carries it (checked here: past this call, a step the message
        cannot carry would drop the connection on the client thread, and the report with it)."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or not 0 <= step <= MAX_INT:
            raise ValueError(f"step={step!r}: an int in 0..2**53 (the RL step)")
        return int(step)

    def _wake(self) -> None:
        with self._poke_lock:
            if self._poke is not None:
                try:
                    self._poke.send(b"", zmq.NOBLOCK)
                except zmq.Again:
                    pass  # a wake-up is already pending

    # ---- client thread --------------------------------------------------------------------------

    def _run(self, wake: zmq.Socket) -> None:
        self._poller.register(wake, zmq.POLLIN)
        interval = self.cfg.heartbeat_interval_s
        while not self._closing.is_set():
            try:
                now = time.monotonic()
                if self._sock is None and now >= self._reconnect_at:
                    self._connect(now)
                due = self._reconnect_at if self._sock is None else min(self._hb_due, self._expiry)
                timeout = min(interval, max(0.0, due - now))
                ready = dict(self._poller.poll(int(timeout * 1000) + 1))
                if wake in ready:
                    for _ in range(_MAX_DRAIN):
                        try:
                            wake.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                self._drain_reports()
                if self._sock is not None and self._sock in ready:
                    self._drain_socket()
                now = time.monotonic()
                if self._sock is not None:
                    if now >= self._expiry:
                        self._lose(f"coordinator silent for {self.cfg.liveness} heartbeats", now)
                    elif now >= self._hb_due:
                        self._send(Heartbeat())
            except zmq.ContextTerminated:
                log.warning("worker %s: ZeroMQ context terminated; client stops", self.cfg.worker_id)
                self._sock = None
                break
            except Exception:  # a bug or a bad address must not kill the link: log, back off, retry
                log.exception("worker %s: client loop error", self.cfg.worker_id)
                self._lose("client error", time.monotonic())
        try:
            if self._sock is not None:
                self._send(Disconnect(reason="worker closing"))
                self._sock.close(linger=100)
                self._sock = None
            wake.close(linger=0)
        except zmq.ZMQError:
            pass  # context already gone
        self.connected.clear()

    def _connect(self, now: float) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_BYTES_FROM_COORDINATOR)
        try:
            sock.connect(self.cfg.address)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self._sock = sock
        self._poller.register(sock, zmq.POLLIN)
        self._expiry = now + self.cfg.liveness * self.cfg.heartbeat_interval_s
        self._seq += 1
        state = BUSY if self.state is TRAINING else self.state
        self._send(Register(worker_id=self.cfg.worker_id, dp_group=self.cfg.dp_group, rank=self.cfg.rank,
                            state=state, step=self.step, seq=self._seq, address=self.cfg.trainer_address))

    def _lose(self, reason: str, now: float) -> None:
        """Drop the connection; deliver a local Stop if training; schedule the reconnect."""
        delay = self._backoff
        self._backoff = min(self._backoff * 2, self.cfg.reconnect_max_s)
        log.warning("worker %s: lost coordinator at %s (%s); reconnecting in %.2fs",
                    self.cfg.worker_id, self.cfg.address, reason, delay)
        if self._sock is not None:
            self._poller.unregister(self._sock)
            self._sock.close(linger=0)
            self._sock = None
        self.connected.clear()
        self.reconnects += 1
        self._reconnect_at = now + delay
        if self.session is not None:
            session, self.session = self.session, None
            if self._stop_seen != session:
                self._deliver(Stop(session=session, step=self.step, reason="coordinator_lost", deadline_ms=0))

    def _send(self, msg: Message) -> None:
        if self._sock is None:
            return
        try:
            self._sock.send(encode(msg)[0], _NOBLOCK)
        except zmq.Again:  # coordinator unreachable and our queue is full: the state goes out on REGISTER
            return
        self._hb_due = time.monotonic() + self.cfg.heartbeat_interval_s

    def _drain_reports(self) -> None:
        for _ in range(len(self._reports)):
            state, step, ok = self._reports.popleft()
            if step is not None:
                self.step = step
            self._seq += 1
            if self.state is TRAINING and self.session is not None:
                self._send(Stopped(session=self.session, step=self.step, seq=self._seq, state=state, ok=ok))
                self.session = None
            else:
                self._send(State(state=state, step=self.step, seq=self._seq))
            self.state = state

    def _drain_socket(self) -> None:
        assert self._sock is not None
        for _ in range(_MAX_DRAIN):
            try:
                frames = self._sock.recv_multipart(_NOBLOCK)
            except zmq.Again:
                return
            now = time.monotonic()
            self._expiry = now + self.cfg.liveness * self.cfg.heartbeat_interval_s
            try:
                msg = decode(frames)
            except ProtocolError as e:
                self._lose(f"bad message from coordinator: {e}", now)
                return
            if isinstance(msg, Disconnect):
                self._lose(f"coordinator said DISCONNECT: {msg.reason}", now)
                return
            if not self._dispatch(msg):
                self._lose(f"unexpected {msg.COMMAND.name} from coordinator", now)
                return

    def _dispatch(self, msg: Message) -> bool:
        if isinstance(msg, Heartbeat):
            pass
        elif isinstance(msg, Welcome):
            self.coordinator_id = msg.coordinator_id
            self._backoff = self.cfg.reconnect_initial_s
            self.connected.set()
        elif isinstance(msg, Promote):
            if self.state is IDLE and self.session is None and msg.seq == self._seq:
                self._seq += 1
                self.state, self.session, self._stop_seen = TRAINING, msg.session, None
                self._send(State(state=TRAINING, step=self.step, seq=self._seq, session=msg.session))
                self._deliver(msg)
            else:
                log.debug("worker %s: stale PROMOTE (seq %d, ours %d, %s)", self.cfg.worker_id,
                          msg.seq, self._seq, self.state.value)
        elif isinstance(msg, Stop):
            if msg.session == self.session and self._stop_seen != msg.session:
                self._stop_seen = msg.session
                self._deliver(msg)
        elif isinstance(msg, Session):
            if msg.session == self.session:
                self._deliver(msg)
        else:
            return False
        return True

    def _deliver(self, cmd: Command) -> None:
        try:
            self._on_command(cmd)
        except Exception:
            log.exception("worker %s: on_command failed for %s", self.cfg.worker_id, cmd.COMMAND.name)
