"""The worker state machine table, checked exhaustively against an independent statement of it."""

from __future__ import annotations

import itertools

import pytest

from tlt.coordinator.protocol import ProtocolError, WorkerState
from tlt.coordinator.states import Cause, IllegalTransition, transition

B, I, T, L = WorkerState.BUSY, WorkerState.IDLE, WorkerState.TRAINING, WorkerState.LOST

LEGAL = {
    (None, B, Cause.REGISTER), (None, I, Cause.REGISTER),
    (B, B, Cause.REPORT), (B, I, Cause.REPORT), (I, I, Cause.REPORT), (I, B, Cause.REPORT),
    (I, T, Cause.PROMOTE),
    (T, T, Cause.ACCEPT),
    (T, B, Cause.DECLINE), (T, I, Cause.DECLINE),
    (T, B, Cause.STOPPED), (T, I, Cause.STOPPED),
    (B, L, Cause.LOST), (I, L, Cause.LOST), (T, L, Cause.LOST),
}


@pytest.mark.parametrize("old,new,cause", list(itertools.product([None, B, I, T, L], [B, I, T, L], Cause)))
def test_table(old, new, cause):
    if (old, new, cause) in LEGAL:
        assert transition(old, new, cause) is new
    else:
        with pytest.raises(IllegalTransition) as e:
            transition(old, new, cause)
        assert isinstance(e.value, ProtocolError) and e.value.kind == "out_of_order"


def test_lost_is_terminal_and_training_only_by_promotion():
    for new, cause in itertools.product(WorkerState, Cause):
        with pytest.raises(IllegalTransition):
            transition(L, new, cause)
    assert {(o, c) for (o, n, c) in LEGAL if n is T and o is not T} == {(I, Cause.PROMOTE)}
