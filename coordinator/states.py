"""The worker state machine, as seen by the coordinator: which transitions each cause may make.

Pure logic (no sockets, no clocks), so the whole table is unit-tested. A transition not in the table
is an ``IllegalTransition`` (a ``ProtocolError`` of kind ``out_of_order``): the coordinator logs it
and drops the peer that caused it.

    REGISTER  (new) -> BUSY | IDLE                    a worker (re)joins; never as TRAINING
    REPORT    BUSY <-> IDLE (and repeats)             rollout work ran out / came back
    PROMOTE   IDLE -> TRAINING                        coordinator decision (pending acceptance)
    ACCEPT    TRAINING -> TRAINING                    worker confirms the PROMOTE it was sent
    DECLINE   TRAINING -> BUSY | IDLE                 worker reported a newer state before it saw
                                                      the PROMOTE (only while not yet accepted)
    STOPPED   TRAINING -> BUSY | IDLE                 STOP acked (checkpoint done) or voluntary stop
    LOST      BUSY | IDLE | TRAINING -> LOST          missed heartbeats, no STOP ack in time, dropped

LOST is terminal: the record is removed; a worker that comes back registers afresh.
"""

from __future__ import annotations

import enum

from tlt.coordinator.protocol import ProtocolError, WorkerState

BUSY, IDLE, TRAINING, LOST = WorkerState.BUSY, WorkerState.IDLE, WorkerState.TRAINING, WorkerState.LOST


class Cause(enum.Enum):
    REGISTER = "register"
    REPORT = "report"
    PROMOTE = "promote"
    ACCEPT = "accept"
    DECLINE = "decline"
    STOPPED = "stopped"
    LOST = "lost"


TRANSITIONS: dict[Cause, frozenset[tuple[WorkerState | None, WorkerState]]] = {
    Cause.REGISTER: frozenset({(None, BUSY), (None, IDLE)}),
    Cause.REPORT: frozenset({(BUSY, BUSY), (BUSY, IDLE), (IDLE, IDLE), (IDLE, BUSY)}),
    Cause.PROMOTE: frozenset({(IDLE, TRAINING)}),
    Cause.ACCEPT: frozenset({(TRAINING, TRAINING)}),
    Cause.DECLINE: frozenset({(TRAINING, BUSY), (TRAINING, IDLE)}),
    Cause.STOPPED: frozenset({(TRAINING, BUSY), (TRAINING, IDLE)}),
    Cause.LOST: frozenset({(BUSY, LOST), (IDLE, LOST), (TRAINING, LOST)}),
}


class IllegalTransition(ProtocolError):
    def __init__(self, old: WorkerState | None, new: WorkerState, cause: Cause):
        name = old.value if old is not None else "(new)"
        super().__init__("out_of_order", f"{cause.value}: {name} -> {new.value} is not allowed")
        self.old, self.new, self.cause = old, new, cause


def transition(old: WorkerState | None, new: WorkerState, cause: Cause) -> WorkerState:
    """Return ``new`` if ``cause`` may move a worker from ``old`` to it, else raise IllegalTransition."""
    if (old, new) not in TRANSITIONS[cause]:
        raise IllegalTransition(old, new, cause)
    return new
