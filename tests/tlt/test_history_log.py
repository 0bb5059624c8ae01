"""The draft history's record in the run directory: a restarted replica rebuilds what it had kept."""

from __future__ import annotations

import random

from tlt.rollout.history import HistoryConfig, ResponseHistory
from tlt.integrations.verl.history_log import HistoryLog, read_history

CFG = HistoryConfig(visits=2, per_prompt=4, max_prompts=6, global_tokens=200)


def _steps(n_steps=12, prompts=10, per_step=4, n=2, seed=0):
    """RL steps over a dataset of ``prompts`` prompts, ``per_step`` of them per step (they return
    once per epoch), ``n`` responses each."""
    rng = random.Random(seed)
    for step in range(n_steps):
        batch = [(step * per_step + i) % prompts for i in range(per_step)]
        yield step, [([7, p], [rng.randrange(3, 50) for _ in range(rng.randrange(1, 9))])
                     for p in batch for _ in range(n)]


def _rebuild(path) -> ResponseHistory:
    h = ResponseHistory(CFG)
    for step, pairs in read_history(path).items():
        h.add(step, pairs)
    return h


def test_a_restarted_replica_rebuilds_what_it_kept_from_a_bounded_log(tmp_path):
    path = tmp_path / "tlt_history.jsonl"
    log, replica = HistoryLog(path, CFG), ResponseHistory(CFG)
    for step, pairs in _steps():
        replica.add(step, pairs)
        log.add(step, pairs)
        lines = len(path.read_text().splitlines())
        assert lines == log.lines <= 2 * len(replica.pairs()) + len(pairs)  # compacted: bounded
        assert _rebuild(path).pairs() == replica.pairs()  # at every step, not only after a compaction
    assert log.lines < 12 * 8  # it was compacted at least once


def test_a_line_cut_short_is_skipped_and_a_resumed_trainer_keeps_the_record(tmp_path):
    path = tmp_path / "tlt_history.jsonl"
    log, replica = HistoryLog(path, CFG), ResponseHistory(CFG)
    steps = list(_steps())
    for step, pairs in steps[:5]:
        replica.add(step, pairs)
        log.add(step, pairs)
    resumed = HistoryLog(path, CFG)  # the trainer restarted: the record so far is its mirror's
    assert resumed.mirror.pairs() == replica.pairs() and resumed.lines == log.lines
    for step, pairs in steps[5:]:
        replica.add(step, pairs)
        resumed.add(step, pairs)
    assert _rebuild(path).pairs() == replica.pairs()
    with open(path, "a") as f:
        f.write('{"step": 99, "prompt": [7, 1], "resp')  # a crash mid-append
    assert _rebuild(path).pairs() == replica.pairs()
