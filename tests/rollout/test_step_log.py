"""The engine's step telemetry (``rollout/step_log.py``): by absolute step number, bounded."""

from __future__ import annotations

import pytest

from tlt.rollout.step_log import StepLog


def test_the_step_log_keeps_steps_by_absolute_number_until_forgotten_and_never_more_than_its_cap():
    log = StepLog(cap=8)
    for i in range(5):
        log.append(f"step {i}", [i + 1])
    assert log.steps_run == 5 and log.since(3) == ["step 3", "step 4"] and log.accept_lengths_since(3) == [4, 5]
    log.forget(2)
    assert log.kept[0] == "step 2" and log.steps_run == 5
    with pytest.raises(ValueError, match="steps before 2 were forgotten"):
        log.since(1)
    for i in range(5, 12):  # past the cap: the oldest half goes
        log.append(f"step {i}", [])
    assert len(log.kept) <= 8 and log.kept[-1] == "step 11" and log.steps_run == 12
