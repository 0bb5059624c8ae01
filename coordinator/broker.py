"""The coordinator process/thread: a ROUTER socket, one poll loop and heartbeats. The promotion rules
it applies to each message are :mod:`tlt.coordinator.promotion`'s.

One thread owns the socket (zguide Paranoid Pirate / Majordomo broker):

    loop:
        poll(router, wake) with timeout = heartbeat interval (shorter if a STOP deadline is nearer)
        drain every waiting message: decode -> handler -> promotion -> send decisions
        purge peers silent for ``liveness`` intervals (-> LOST), enforce STOP deadlines
        send HEARTBEAT to every peer we have not sent anything to for an interval

Any message from a peer counts as its heartbeat. Malformed, oversized, version-mismatched or
out-of-order input is logged and its peer dropped (DISCONNECT sent, record removed: a real worker
re-registers); an unexpected exception in a handler is logged the same way. Nothing a peer sends can
stop the loop. Frames above ``protocol.MAX_WIRE_BYTES`` and non-ZMTP bytes are cut by libzmq itself.

Use embedded (``with Coordinator(cfg) as c: ...`` or ``start()``/``stop()``) or standalone
(``python -m tlt.coordinator --bind tcp://0.0.0.0:5555``, ``main(argv)``). The driver API
(``step_begin``, ``rollout_done``) goes through the same socket over ``inproc``, or over the network
with ``tlt.coordinator.driver.DriverClient``.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import secrets
import signal
import socket
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from tlt.coordinator.driver import DriverClient, RolloutOutcome
from tlt.coordinator.promotion import Decisions, Event, Promotion, PromotionConfig
from tlt.coordinator.protocol import (
    MAX_STR,
    MAX_WIRE_BYTES,
    Ack,
    Disconnect,
    Heartbeat,
    Message,
    Outcome,
    Promote,
    ProtocolError,
    Register,
    RolloutDone,
    State,
    StepBegin,
    Stop,
    Stopped,
    Welcome,
    WorkerState,
    decode,
    encode,
)

log = logging.getLogger(__name__)

_MAX_DRAIN = 512          # messages handled per poll before the purge/heartbeat pass runs
_NOBLOCK = int(zmq.NOBLOCK)                 # plain ints: pyzmq's IntFlag arithmetic costs
_MORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK  # microseconds per send on the hot path
_DROP_LOG_MEMORY = 1024   # identities remembered so a flooding peer is logged once at WARNING


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig:
    bind: str = "tcp://127.0.0.1:5555"   # port 0 or * = any free port (see Coordinator.endpoint)
    heartbeat_interval_s: float = 1.0
    liveness: int = 3                    # a peer silent this many intervals is LOST
    promotion: PromotionConfig = field(default_factory=PromotionConfig)
    policy: PromotionConfig | None = None  # the old name of ``promotion``: read until the next release

    def __post_init__(self) -> None:
        if self.policy is not None:
            warnings.warn("CoordinatorConfig(policy=...) is renamed CoordinatorConfig(promotion=...): the old keyword "
                          "is accepted (its value moves to .promotion) until the next release", DeprecationWarning,
                          stacklevel=3)
            if self.promotion != PromotionConfig() and self.promotion != self.policy:
                raise ValueError("policy and promotion both given and different: pass promotion= only "
                                 "(policy is its old name)")
            object.__setattr__(self, "promotion", self.policy)
            object.__setattr__(self, "policy", None)
        if not re.match(r"^(tcp|ipc|inproc)://.+", self.bind):
            raise ValueError(f"bind={self.bind!r}: use tcp://HOST:PORT, ipc://PATH or inproc://NAME")
        port = re.fullmatch(r"tcp://.*:(\d+)", self.bind)
        if port and int(port.group(1)) > 65535:
            raise ValueError(f"bind={self.bind!r}: port {port.group(1)} is past 65535 (0: any free port)")
        if not 0.001 <= self.heartbeat_interval_s <= 60:
            raise ValueError(f"heartbeat_interval_s={self.heartbeat_interval_s}: use 0.001..60 seconds")
        if self.liveness < 2:
            raise ValueError(f"liveness={self.liveness}: use >= 2 (missed heartbeats before LOST)")
        if not isinstance(self.promotion, PromotionConfig):
            raise ValueError("promotion: pass a tlt.coordinator.promotion.PromotionConfig")


@dataclass(slots=True)
class _Peer:
    worker_id: str
    expiry: float     # LOST when now passes this
    hb_due: float     # next HEARTBEAT to it (pushed back by any message we send it)


class Coordinator:
    """Embeddable coordinator. ``on_event`` is called from the coordinator thread; keep it quick."""

    def __init__(self, cfg: CoordinatorConfig | None = None, *,
                 on_event: Callable[[Event], None] | None = None):
        self.cfg = cfg or CoordinatorConfig()
        self.id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.endpoint: str | None = None
        self._on_event = on_event
        self._ctx: zmq.Context | None = None  # created by start()
        self._inproc = f"inproc://tlt-coordinator-{secrets.token_hex(6)}"
        self._wake_addr = self._inproc + "-wake"
        self._promotion = Promotion(self.cfg.promotion, first_epoch=int(time.time() * 1000))  # see Promotion
        self._peers: dict[bytes, _Peer] = {}
        self._ident: dict[str, bytes] = {}
        self._dropped: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._stats_lock = threading.Lock()
        self._decide_s = {"promote": collections.deque(maxlen=100_000),
                          "stop": collections.deque(maxlen=100_000)}
        self._promotion_lock = threading.Lock()  # the loop mutates the promotion state under it; snapshot() reads
        self._router: zmq.Socket | None = None  # owned by the coordinator thread
        self._handlers: dict[type, Callable[[bytes, _Peer | None, Message, float], Decisions]] = {
            Register: self._on_register, Heartbeat: self._on_heartbeat, State: self._on_state,
            Stopped: self._on_stopped, Disconnect: self._on_disconnect,
            StepBegin: self._on_step_begin, RolloutDone: self._on_rollout_done}

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> Coordinator:
        """Bind (errors raise here, in the caller) and run the loop in a daemon thread."""
        if self._thread is not None:
            raise RuntimeError("Coordinator.start() called twice")
        self._ctx = zmq.Context()
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_BYTES)
        wake = self._ctx.socket(zmq.PAIR)
        try:
            router.bind(_any_port(self.cfg.bind))
            self.endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            router.bind(self._inproc)
            wake.bind(self._wake_addr)
        except zmq.ZMQError:
            router.close(linger=0)
            wake.close(linger=0)
            self._ctx.destroy(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, args=(router, wake), daemon=True,
                                        name="tlt-coordinator")
        self._thread.start()
        log.info("coordinator %s listening on %s (heartbeat %.3fs x %d, idle threshold %d)",
                 self.id, self.endpoint, self.cfg.heartbeat_interval_s, self.cfg.liveness,
                 self.cfg.promotion.idle_threshold)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Tell workers we are going (DISCONNECT), stop the loop, release the sockets."""
        if self._thread is None or self._ctx is None or self._stopping.is_set():
            return
        self._stopping.set()
        if threading.current_thread() is self._thread:  # called from on_event: the loop ends by itself
            return
        poke = self._ctx.socket(zmq.PAIR)
        poke.connect(self._wake_addr)
        try:
            poke.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # the loop still sees the flag within one heartbeat interval
        poke.close(linger=0)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("coordinator thread did not stop within %.1fs", timeout_s)
            return
        self._ctx.destroy(linger=0)

    def serve_forever(self, until: Callable[[], bool] | None = None) -> None:
        """Run until SIGINT/SIGTERM or ``until()`` (checked every 0.5 s); standalone use, from the
        main thread.

        The signal handler only writes a byte to a socket pair that the loop waits on. Python runs a
        handler in the main thread between any two of its lines, locks held included, so a handler
        that takes a lock (``threading.Event.set``) can deadlock the loop waiting on that lock."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("serve_forever handles SIGINT/SIGTERM: call it from the main thread "
                               "(elsewhere, use start() and stop())")
        wake_r, wake_w = socket.socketpair()
        wake_r.settimeout(0.5)
        wake_w.setblocking(False)

        def on_signal(signum: int, frame: object) -> None:
            try:
                wake_w.send(b"\0")
            except OSError:  # buffer full: a byte is already waiting
                pass

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.start()
            while self._thread is not None and self._thread.is_alive():
                try:
                    wake_r.recv(1)  # a signal's byte
                    break
                except TimeoutError:
                    pass
                if until is not None and until():
                    break
        finally:
            try:
                self.stop()
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
                wake_r.close()
                wake_w.close()

    def __enter__(self) -> Coordinator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- driver API and observation (any thread) ------------------------------------------------

    def driver(self, timeout_s: float | None = None) -> DriverClient:
        """A driver client over inproc (close it, or use it as a context manager)."""
        if self._ctx is None or self._stopping.is_set():
            raise RuntimeError("the coordinator is not running: call start() first")
        return DriverClient(self._inproc, context=self._ctx, timeout_s=timeout_s or self._wait_s())

    def step_begin(self, step: int) -> bool:
        """Tell the coordinator step ``step`` began; False if it is not running (never raises)."""
        try:
            with self.driver() as d:
                return d.step_begin(step)
        except (RuntimeError, zmq.ZMQError) as e:
            log.warning("step_begin(%d): coordinator not running (%s)", step, e)
            return False

    def rollout_done(self, step: int, timeout_s: float | None = None) -> RolloutOutcome:
        """Stop all training for ``step``; returns once every TRAINING worker acked or its deadline
        passed. A coordinator that is not running answers ``reachable=False`` (never raises)."""
        try:
            with self.driver(timeout_s) as d:
                return d.rollout_done(step)
        except (RuntimeError, zmq.ZMQError) as e:
            log.warning("rollout_done(%d): coordinator not running (%s)", step, e)
            return RolloutOutcome(step=step, reachable=False)

    def snapshot(self) -> dict[str, tuple[WorkerState, int | None]]:
        """worker id -> (state, session), as of the last handled message."""
        with self._promotion_lock:
            return self._promotion.snapshot()

    def decision_times(self) -> dict[str, list[float]]:
        """Seconds from receiving a message to having sent the decisions it caused, for messages that
        caused a PROMOTE (``"promote"``) or a STOP (``"stop"``); the last 100k of each."""
        with self._stats_lock:
            return {k: list(v) for k, v in self._decide_s.items()}

    def _wait_s(self) -> float:
        return self.cfg.promotion.stop_timeout_s + 2 * self.cfg.heartbeat_interval_s + 1.0

    # ---- the loop (coordinator thread only) -----------------------------------------------------

    def _run(self, router: zmq.Socket, wake: zmq.Socket) -> None:
        self._router = router
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        interval = self.cfg.heartbeat_interval_s
        try:
            while not self._stopping.is_set():
                try:
                    self._iteration(poller, router, interval)
                except zmq.ContextTerminated:
                    break
                except Exception:  # handlers catch their own; this is a bug elsewhere: log, go on
                    log.exception("coordinator loop iteration failed")
                    time.sleep(min(interval, 0.1))
        finally:
            try:
                for ident in list(self._peers):
                    self._send(ident, Disconnect(reason="coordinator shutting down"), time.monotonic())
                router.close(linger=200)
                wake.close(linger=0)
            except zmq.ZMQError:
                pass  # context already gone

    def _iteration(self, poller: zmq.Poller, router: zmq.Socket, interval: float) -> None:
        timeout = interval
        deadline = self._promotion.next_deadline()
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - time.monotonic()))
        ready = dict(poller.poll(int(timeout * 1000) + 1))
        if router in ready:
            for _ in range(_MAX_DRAIN):
                try:
                    frames = router.recv_multipart(_NOBLOCK)
                except zmq.Again:
                    break
                self._handle(frames)
            with self._promotion_lock:  # members hear of membership changes once per batch
                d = self._promotion.session_updates()
            self._apply(d, time.monotonic())
        now = time.monotonic()
        self._purge(now)
        self._heartbeat(now)

    def _handle(self, frames: list[bytes]) -> None:
        t0 = time.perf_counter()
        now = time.monotonic()
        ident = frames[0]
        peer = self._peers.get(ident)
        if peer is not None:
            peer.expiry = now + self.cfg.liveness * self.cfg.heartbeat_interval_s
        try:
            msg = decode(frames[1:])
            handler = self._handlers.get(type(msg))
            if handler is None:
                raise ProtocolError("out_of_order", f"{msg.COMMAND.name} is never sent to a coordinator")
            with self._promotion_lock:
                decisions = handler(ident, peer, msg, now)
        except ProtocolError as e:
            self._drop(ident, str(e), now, quiet=e.kind == "unregistered")
            return
        except Exception as e:  # a bug must not stop the loop: log it, drop the peer, go on
            log.exception("handler failed on a message from %s", _show(ident, peer))
            self._drop(ident, f"internal error: {type(e).__name__}", now)
            return
        self._apply(decisions, now, t0)

    def _apply(self, d: Decisions, now: float, t0: float | None = None) -> None:
        for wid, msg in d.sends:
            ident = self._ident.get(wid)
            if ident is not None:
                self._send(ident, msg, now)
        for r in d.results:
            ident, req = r.token
            self._send(ident, Outcome(req=req, step=r.step, stopped=r.stopped, timed_out=r.timed_out,
                                      lost=r.lost, elapsed_ms=r.elapsed_s * 1000), now)
        if t0 is not None and d.sends:
            dt = time.perf_counter() - t0
            kinds = {type(m) for _, m in d.sends}
            with self._stats_lock:
                if Promote in kinds:
                    self._decide_s["promote"].append(dt)
                if Stop in kinds:
                    self._decide_s["stop"].append(dt)
        for e in d.events:
            if e.kind == "lost":  # the promotion rules let go of a worker: let go of its connection too
                ident = self._ident.get(e.worker_id)
                if ident is not None and e.worker_id not in self._promotion.workers:
                    self._forget(ident)
                    self._send(ident, Disconnect(reason=str(e.detail.get("reason", "lost"))), now)
                reason = e.detail.get("reason")
                log.log(logging.INFO if reason in ("disconnect", "reregistered") else logging.WARNING,
                        "worker %s LOST (%s)", e.worker_id, reason)
            elif e.kind == "accept":
                log.info("worker %s TRAINING (session %s)", e.worker_id, e.detail.get("session"))
            elif e.kind == "stopped":
                log.info("worker %s stopped training (session %s, %s)", e.worker_id, e.detail.get("session"),
                         "ok" if e.detail.get("ok") else "failed")
        for e in d.events:  # after the sends: observers never delay a decision
            self._emit(e)

    def _purge(self, now: float) -> None:
        for ident in [i for i, p in self._peers.items() if now > p.expiry]:
            wid = self._peers[ident].worker_id
            self._forget(ident)
            self._send(ident, Disconnect(reason="heartbeats missed"), now)
            with self._promotion_lock:
                d = self._promotion.lose(wid, "heartbeat", now)
            self._apply(d, now)
        with self._promotion_lock:
            d = self._promotion.tick(now)
        self._apply(d, now)

    def _heartbeat(self, now: float) -> None:
        for ident, p in list(self._peers.items()):
            if now >= p.hb_due:
                self._send(ident, Heartbeat(), now)

    def _send(self, ident: bytes, msg: Message, now: float) -> None:
        assert self._router is not None, "sends happen on the coordinator thread only"
        try:
            frame = encode(msg)[0]
            self._router.send(ident, _MORE_NOBLOCK)
            self._router.send(frame, _NOBLOCK)
        except (zmq.Again, ProtocolError) as e:  # peer's queue full, or our message too big
            log.warning("could not send %s to %s: %s", msg.COMMAND.name, _show(ident, None), e)
            return
        peer = self._peers.get(ident)
        if peer is not None:
            peer.hb_due = now + self.cfg.heartbeat_interval_s

    def _drop(self, ident: bytes, reason: str, now: float, quiet: bool = False) -> None:
        peer = self._peers.get(ident)
        first = ident not in self._dropped
        self._dropped[ident] = None
        self._dropped.move_to_end(ident)
        while len(self._dropped) > _DROP_LOG_MEMORY:
            self._dropped.popitem(last=False)
        level = logging.DEBUG if not first else logging.INFO if quiet else logging.WARNING
        log.log(level, "dropping peer %s: %s", _show(ident, peer), reason)
        self._send(ident, Disconnect(reason=reason[:MAX_STR]), now)
        self._emit(Event("dropped", peer.worker_id if peer else "", now, {"reason": reason}))
        if peer is not None:
            self._forget(ident)
            with self._promotion_lock:
                d = self._promotion.lose(peer.worker_id, "dropped", now)
            self._apply(d, now)

    def _forget(self, ident: bytes) -> None:
        peer = self._peers.pop(ident, None)
        if peer is not None and self._ident.get(peer.worker_id) == ident:
            del self._ident[peer.worker_id]

    def _emit(self, e: Event) -> None:
        if self._on_event is not None:
            try:
                self._on_event(e)
            except Exception:
                log.exception("on_event callback failed")

    # ---- handlers: (identity, peer or None, message, now) -> Decisions --------------------------

    def _on_register(self, ident: bytes, peer: _Peer | None, msg: Register, now: float) -> Decisions:
        if peer is not None:
            raise ProtocolError("out_of_order", f"{peer.worker_id} registered twice on one connection")
        d = self._promotion.register(msg, now)  # raises before changing anything
        old = self._ident.get(msg.worker_id)
        if old is not None:
            log.warning("worker %s re-registered from a new connection; dropping the old one", msg.worker_id)
            self._forget(old)
            self._send(old, Disconnect(reason="replaced by a newer connection"), now)
        self._peers[ident] = _Peer(msg.worker_id, now + self.cfg.liveness * self.cfg.heartbeat_interval_s, now)
        self._ident[msg.worker_id] = ident
        d.sends.insert(0, (msg.worker_id, Welcome(coordinator_id=self.id,
                                                  heartbeat_ms=int(self.cfg.heartbeat_interval_s * 1000))))
        log.info("worker %s registered (group %d rank %d, %s, step %d)", msg.worker_id, msg.dp_group,
                 msg.rank, msg.state.value, msg.step)
        return d

    def _on_heartbeat(self, ident: bytes, peer: _Peer | None, msg: Heartbeat, now: float) -> Decisions:
        _require_worker(peer, msg)
        return Decisions()

    def _on_state(self, ident: bytes, peer: _Peer | None, msg: State, now: float) -> Decisions:
        return self._promotion.report(_require_worker(peer, msg), msg, now)

    def _on_stopped(self, ident: bytes, peer: _Peer | None, msg: Stopped, now: float) -> Decisions:
        return self._promotion.stopped(_require_worker(peer, msg), msg, now)

    def _on_disconnect(self, ident: bytes, peer: _Peer | None, msg: Disconnect, now: float) -> Decisions:
        wid = _require_worker(peer, msg)
        log.info("worker %s disconnected: %s", wid, msg.reason)
        self._forget(ident)
        return self._promotion.lose(wid, "disconnect", now)

    def _on_step_begin(self, ident: bytes, peer: _Peer | None, msg: StepBegin, now: float) -> Decisions:
        _require_driver(peer, msg)
        d = self._promotion.step_begin(msg.step, now)
        self._send(ident, Ack(req=msg.req), now)
        return d

    def _on_rollout_done(self, ident: bytes, peer: _Peer | None, msg: RolloutDone, now: float) -> Decisions:
        _require_driver(peer, msg)
        return self._promotion.rollout_done(msg.step, now, (ident, msg.req), msg.deadline_ms / 1000)


# ---- helpers --------------------------------------------------------------------------------------

def _require_worker(peer: _Peer | None, msg: Message) -> str:
    if peer is None:
        raise ProtocolError("unregistered", f"{msg.COMMAND.name} from a peer that has not registered")
    return peer.worker_id


def _require_driver(peer: _Peer | None, msg: Message) -> None:
    if peer is not None:
        raise ProtocolError("out_of_order", f"worker {peer.worker_id} sent driver command {msg.COMMAND.name}")


def _any_port(bind: str) -> str:
    """tcp://HOST:0 -> tcp://HOST:* (libzmq's spelling of "any free port")."""
    return re.sub(r"^(tcp://.+):0$", r"\1:*", bind)


def _show(ident: bytes, peer: _Peer | None) -> str:
    return f"{peer.worker_id} [{ident.hex()}]" if peer is not None else f"[{ident.hex()}]"
