"""``tlt bench tail-batching``: figures computed from a demo run's records, and docs/tail.md's table
shows the committed record's figures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tlt.bench.tail_batching import compare

ROOT = Path(__file__).resolve().parents[2]


def _write(run: Path, arm: str, steps: list[dict], responses: list[dict]) -> None:
    d = run / f"arm-{arm}"
    d.mkdir(parents=True)
    (d / "tlt_steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (d / "tlt_responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in responses))


def _step(step: int, rollout_s: float, tb: dict | None = None) -> dict:
    return {"step": step, "tlt/rollout_s": rollout_s, "timing_s/step": rollout_s + 1, "critic/score/mean": 0.1 * step,
            "replica_train_s": [0.0, 0.0], "tail_batching": tb}


def test_shares_and_lengths_come_from_the_rounds(tmp_path):
    short = {"round": "short", "kept_lengths": [10, 20], "finished_not_kept_lengths": [30],
             "dropped_partial_lengths": [5, 15], "tokens": 80, "dropped_tokens": 20, "thrown_away_tokens": 50}
    _write(tmp_path, "A", [_step(s, 4.0) for s in (1, 2, 3)],
           [{"step": s, "length": 40, "index": 0, "sample": 0} for s in (1, 2, 3)])
    _write(tmp_path, "F", [_step(1, 5.0, short), _step(2, 2.0, {"round": "long"}), _step(3, 6.0, short)],
           [{"step": 2, "length": 100, "index": 1, "sample": 0}, {"step": 2, "length": 60, "index": 2, "sample": 0}])
    rec = compare(tmp_path)
    f = rec["by_arm"]["F"]
    # steps 2+ (step 1's short round left out, as the default arm's step 1): a short round's own
    # count plus what the long round trained
    assert f["tokens"] == 160 + 80 and f["rounds"] == {1: "short", 2: "long", 3: "short"}
    assert f["dropped_share"] == pytest.approx(20 / 240) and f["thrown_away_share"] == pytest.approx(50 / 240)
    assert f["lengths"]["short_dropped_partial"]["n"] == 2
    assert f["lengths"]["short_kept"]["median"] == 15 and f["lengths"]["long_trained"]["median"] == 80
    assert f["rollout_s_by_round"] == {"long": {"mean": 2.0, "steps": 1}, "short": {"mean": 6.0, "steps": 1}}
    assert f["rollout_time_ratio_default_over_tb"] == pytest.approx(8.0 / 8.0)


def test_a_run_of_one_step_has_no_figures_past_step_1(tmp_path):
    short = {"round": "short", "kept_lengths": [10], "finished_not_kept_lengths": [], "dropped_partial_lengths": [],
             "tokens": 10, "dropped_tokens": 0, "thrown_away_tokens": 0}
    _write(tmp_path, "A", [_step(1, 4.0)], [{"step": 1, "length": 40, "index": 0, "sample": 0}])
    _write(tmp_path, "F", [_step(1, 5.0, short)], [])
    from tlt.bench.tail_batching import lines

    f = compare(tmp_path)["by_arm"]["F"]
    assert f["tokens"] == 0 and f["spot_train_s_per_step"] == {"A": None, "F": None}
    assert "replica-s per step n/a (A) vs n/a (F)" in "\n".join(lines(compare(tmp_path)))


def test_a_run_without_its_default_arm_is_refused(tmp_path):
    _write(tmp_path, "F", [_step(1, 5.0)], [])
    with pytest.raises(ValueError, match="arms A missing"):
        compare(tmp_path)


def test_docs_table_is_the_record():
    rec = json.loads((ROOT / "docs/bench/tail_batching.json").read_text())["by_arm"]
    text = (ROOT / "docs/tail.md").read_text()
    table = text.split("## Tail batching in the trainer, measured", 1)[1].split("\n- ", 1)[0]
    row = next(x for x in table.splitlines() if x.startswith("| rollout time, default / tail batching"))
    want = [f"{rec[a]['rollout_time_ratio_default_over_tb']:.2f}x ({rec[a]['rollout_time_ratio_ci90'][0]:.2f}-"
            f"{rec[a]['rollout_time_ratio_ci90'][1]:.2f})" for a in "FGH"]
    assert [c.strip() for c in row.strip("|").split("|")[1:]] == want
    row = next(x for x in table.splitlines() if x.startswith("| generated tokens dropped"))
    shares = re.findall(r"(\d+)% / (\d+)%", row)
    assert shares == [(f"{100 * rec[a]['dropped_share']:.0f}", f"{100 * rec[a]['thrown_away_share']:.0f}")
                      for a in "FGH"]
