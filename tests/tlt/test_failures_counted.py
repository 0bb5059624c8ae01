"""Failures the run goes on after are counted, not only logged: the trainer's response record and
draft-history push (``tlt/history_push_failures``, ``tlt/response_record_failures``) and the actor
workers' DataBuffer feeds (``tlt/feeds_dropped``); the demo's records check all three stay 0."""

from __future__ import annotations

import collections
import types

import pytest

pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'tlt-rollout[verl]')")

from tlt.integrations.verl import worker  # noqa: E402
from tlt.integrations.verl.run_records import counted  # noqa: E402


def test_a_failure_is_counted_by_what_failed_and_the_run_goes_on(caplog):
    failures = collections.Counter()
    assert counted(failures, "history", lambda x: x + 1, 1) == 2
    assert not failures

    def push(*_):
        raise RuntimeError("replica 1 is gone")

    assert counted(failures, "history", push, [[1]], [[2]], 3) is None
    assert counted(failures, "history", push) is None
    assert failures == {"history": 2}
    assert "history failed (2 so far this run)" in caplog.text and "replica 1 is gone" in caplog.text


def test_a_feed_the_worker_could_not_hand_over_is_counted(monkeypatch):
    cls = worker.worker_class()
    fake = types.SimpleNamespace(config=types.SimpleNamespace(rollout=types.SimpleNamespace(
        name="tlt", tensor_model_parallel_size=1, data_parallel_size=1, pipeline_model_parallel_size=1)))

    def gone(name):
        raise ValueError(f"Failed to look up actor {name}")

    monkeypatch.setattr(worker.ray, "get_actor", gone)
    assert cls.tlt_dropped_feeds(fake) == 0
    cls._tlt_ship(fake, 1, [object()])
    cls._tlt_ship(fake, 2, [object()])
    assert cls.tlt_dropped_feeds(fake) == 2
