"""Driver-side API: what the RL step controller calls (``step_begin``, ``rollout_done``).

A small request-reply client (zguide "Lazy Pirate"): one DEALER socket, one request in flight, a
bounded wait for the reply, and on timeout the socket is discarded so a late reply can never be
taken for the next one. A lost coordinator costs the driver at most ``timeout_s`` per call and
never an exception: rollout and the RL step go on (workers stop training on their own when the
coordinator falls silent; see ``tlt.coordinator.worker``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass

import zmq

from tlt.coordinator.protocol import (
    MAX_WIRE_BYTES_FROM_COORDINATOR,
    Ack,
    Disconnect,
    Message,
    Outcome,
    ProtocolError,
    RolloutDone,
    StepBegin,
    decode,
    encode,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutOutcome:
    """What ``rollout_done`` achieved. ``reachable=False``: no answer in time (nothing was blocked)."""

    step: int
    reachable: bool
    stopped: tuple[str, ...] = ()     # acked STOP (checkpoint done) in time
    timed_out: tuple[str, ...] = ()   # did not ack within the deadline: marked LOST
    lost: tuple[str, ...] = ()        # lost meanwhile (missed heartbeats, dropped)
    elapsed_s: float = 0.0            # coordinator-side time from ROLLOUT_DONE to the last ack

    @property
    def clean(self) -> bool:
        return self.reachable and not self.timed_out and not self.lost


class DriverClient:
    """Thread-safe (one request at a time). ``address``: the coordinator's endpoint."""

    def __init__(self, address: str, *, timeout_s: float = 30.0, context: zmq.Context | None = None):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0 seconds")
        self.address = address
        self.timeout_s = timeout_s
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._lock = threading.Lock()
        self._req = itertools.count(1)

    def step_begin(self, step: int, timeout_s: float | None = None) -> bool:
        """Tell the coordinator step ``step`` began. True if it acknowledged in time."""
        req = next(self._req)
        return self._request(StepBegin(step=step, req=req), Ack, timeout_s or self.timeout_s) is not None

    def rollout_done(self, step: int, timeout_s: float | None = None) -> RolloutOutcome:
        """Rollout of ``step`` is done: stop all training, wait for the acks (bounded by ``timeout_s``).

        The coordinator is given a deadline shorter than our wait, so its answer (with whoever missed
        it) arrives before we give up; the coordinator's own stop timeout may make it shorter still.
        """
        timeout = timeout_s or self.timeout_s
        margin = min(0.5, 0.2 * timeout)
        req = next(self._req)
        msg = RolloutDone(step=step, req=req, deadline_ms=max(1, int((timeout - margin) * 1000)))
        reply = self._request(msg, Outcome, timeout)
        if reply is None:
            log.warning("coordinator at %s did not answer rollout_done(step=%d) within %.2fs; "
                        "rollout goes on", self.address, step, timeout)
            return RolloutOutcome(step=step, reachable=False)
        return RolloutOutcome(step=reply.step, reachable=True, stopped=reply.stopped,
                              timed_out=reply.timed_out, lost=reply.lost,
                              elapsed_s=reply.elapsed_ms / 1000)

    def close(self) -> None:
        with self._lock:
            self._discard()

    def __enter__(self) -> DriverClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ------------------------------------------------------------------------------

    def _request(self, msg: StepBegin | RolloutDone, expect: type, timeout: float) -> Message | None:
        with self._lock:
            try:
                return self._exchange(msg, expect, timeout)
            except zmq.ZMQError as e:  # e.g. the context was terminated under us
                log.warning("driver request to %s failed: %s", self.address, e)
                self._discard()
                return None

    def _exchange(self, msg: StepBegin | RolloutDone, expect: type, timeout: float) -> Message | None:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_BYTES_FROM_COORDINATOR)
            self._sock.connect(self.address)
        sock = self._sock
        try:
            sock.send_multipart(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            self._discard()
            return None
        end = time.monotonic() + timeout
        for _ in range(10_000):  # bounded: stale replies are skipped, never waited on forever
            left = end - time.monotonic()
            if left <= 0 or not sock.poll(max(1, int(left * 1000))):
                break
            try:
                reply = decode(sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                continue
            except ProtocolError as e:
                log.warning("bad reply from tlt.coordinator %s: %s", self.address, e)
                break
            if isinstance(reply, Disconnect):
                log.warning("coordinator %s refused the request: %s", self.address, reply.reason)
                break
            if isinstance(reply, expect) and reply.req == msg.req:
                return reply
            log.debug("skipping stale reply %s", reply)
        self._discard()  # Lazy Pirate: never reuse a socket that may still get a late reply
        return None

    def _discard(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close(linger=0)
            except zmq.ZMQError:
                pass
            self._sock = None
