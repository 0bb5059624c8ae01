"""The ``tlt`` trainer's components, without verl: the step's rollout window and the metrics made
from the replicas' statistics, and the run directory's records. The whole trainer runs for real in
the verl runs (tests/integrations/test_verl_loop.py)."""

from __future__ import annotations

import json
import math

from tlt.integrations.verl.batcher import Generation
from tlt.integrations.verl.run_records import RunRecords
from tlt.integrations.verl.step_metrics import RolloutWindow, step_extra, step_metrics
from tlt.integrations.verl.step_stats import StepStats
from tlt.rollout.engine import StepRecord
from tlt.rollout.history import HistoryConfig


def _snapshot(steps: list[StepRecord], tokens: int) -> dict:
    st = StepStats()
    st.batch(Generation(finished=[], steps=steps, started=1.0, seconds=0.5, tokens=tokens, lifecycle={"evicted": 1}))
    # what the replica adds to the statistics' snapshot (ReplicaCore.step_stats and the server's fields)
    return {**st.snapshot(), "buffer": {"samples": 3}, "drift_top1": None, "proposer": "eagle"}


def test_metrics_pool_the_replicas_and_name_each_arm():
    a = _snapshot([StepRecord(batch=2, arm="3,1,3", sd=True, accepted=6, committed=10, seconds=0.1)], tokens=12)
    b = _snapshot([StepRecord(batch=1, arm="3,1,3@suffix", sd=True, accepted=2, committed=4, seconds=0.1),
                   StepRecord(batch=1, arm="off", sd=False, accepted=0, committed=1, seconds=0.1)], tokens=5)
    w = RolloutWindow()
    w.begin()
    w.end()
    w.collect([a, b], None, {"moves": 3})
    m = step_metrics(w, drafter_version=4, drafter_spot_step=6, push_rejected=1, repushed=0,
                     failures={"responses": 1, "checkpoint": 2}, feeds_dropped=0, rounds=None)
    # verifies count rows (batch 2 + batch 1); a plain step is neither verified nor an arm
    assert m["rollout/spec_accept_length"] == (10 + 4) / 3 and m["tlt/spec_verifies"] == 3
    assert m["tlt/sd_token_share"] == 14 / 17 and m["tlt/tail_moves"] == 3 and m["tlt/evicted"] == 2
    assert m["tlt/arm_share/3,1,3"] == m["tlt/arm_share/3,1,3@suffix"] == 1 / 2 and "tlt/arm_share/off" not in m
    assert m["tlt/proposer_share/suffix"] == 1 / 2 and m["tlt/drafter_version"] == 4
    assert m["tlt/drafter_spot_step"] == 6
    # a failed read of the step's responses loses both its record and its draft history
    assert m["tlt/history_push_failures"] == m["tlt/response_record_failures"] == 1
    assert m["tlt/checkpoint_failures"] == 2 and "tlt/tail_queue" not in m
    assert m["tlt/rollout_s"] == w.seconds >= 0
    extra = step_extra(w, rounds={"queued_after": 2})
    assert extra["coordinator_reachable"] is False and extra["tail"] == {"moves": 3}
    assert extra["tail_batching"] == {"queued_after": 2} and len(extra["replica_gen_s"]) == 2


def test_a_step_without_speculation_has_no_accept_length():
    w = RolloutWindow()
    w.collect([_snapshot([StepRecord(batch=1, arm="off", sd=False, accepted=0, committed=1, seconds=0.1)], 1)],
              None, {})
    m = step_metrics(w, drafter_version=0, drafter_spot_step=0, push_rejected=0, repushed=0, failures={},
                     feeds_dropped=0,
                     rounds={"queued_after": 5, "dropped_share": 0.25})
    assert math.isnan(m["rollout/spec_accept_length"]) and m["tlt/tail_queue"] == 5
    assert w.lengths == []  # the consolidator's estimate: the replicas' response lengths


def test_records_write_nothing_until_a_step_and_hash_each_response(tmp_path):
    rec = RunRecords(tmp_path / "run" / "tlt_steps.jsonl")
    assert not (tmp_path / "run").exists()
    rec.write_step({"step": 1, "tlt/x": 1.0})
    rec.write_responses(["u1_0_0", "u2_1_0"], [[1, 2], [3]], 1, {"u1": 7})
    rec.log_history(1, [([1], [2, 3])], HistoryConfig())
    assert json.loads(rec.steps_path.read_text()) == {"step": 1, "tlt/x": 1.0}
    lines = [json.loads(x) for x in rec.responses_path.read_text().splitlines()]
    assert [(x["index"], x["sample"], x["length"]) for x in lines] == [(7, 0, 2), (-1, 1, 1)]
    assert lines[0]["sha1"] != lines[1]["sha1"] and rec.history_path.is_file()
    assert rec.counted("record", lambda: 1 / 0) is None and rec.failures == {"record": 1}


def test_the_draft_history_is_written_where_a_restarted_replica_reads_it(tmp_path):
    """With ``tlt.record_path`` elsewhere, the history log stays in the run directory, which is
    where ``TLTServer`` (given ``run_dir``) reads it back after a restart."""
    from tlt.integrations.verl.history_log import HISTORY_FILE, read_history

    (tmp_path / "run").mkdir()  # the trainer's default_local_dir, made at its set-up
    rec = RunRecords(tmp_path / "logs" / "steps.jsonl", tmp_path / "run")
    rec.log_history(1, [([1], [2, 3])], HistoryConfig())
    assert rec.history_path == tmp_path / "run" / HISTORY_FILE  # server.py: Path(run_dir) / HISTORY_FILE
    assert read_history(rec.history_path) and not (tmp_path / "logs" / HISTORY_FILE).exists()
