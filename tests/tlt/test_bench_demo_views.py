"""``tlt bench demo --from``: one bench over any set of demo runs, each view where the runs hold
its arms, with the same figures as the view's own bench (hand-made records)."""

from __future__ import annotations

import argparse
import json

import pytest

from tlt.bench import consolidation, tail_batching
from tlt.bench.demo_runs import add_to, views
from tlt.cli import main


def _arm(run, arm, rollout, train, al, tb=None, length=40):
    d = run / f"arm-{arm}"
    d.mkdir(parents=True)
    rows = [{"step": s, "tlt/rollout_s": rollout, "timing_s/step": rollout + 1.0, "replica_train_s": [train, 0.0],
             "tlt/drafter_version": float(s), "tlt/spec_verifies": 10.0, "tlt/spec_committed": 10.0 * al,
             "tlt/tail_moves": 2.0 if arm == "C" else 0.0, "critic/score/mean": 0.1 * s,
             **({"tail_batching": tb} if tb else {})} for s in range(1, 5)]
    (d / "tlt_steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "tlt_responses.jsonl").write_text("".join(
        json.dumps({"step": s, "index": k, "sample": 0, "sha1": f"{s}-{k}", "length": length}) + "\n"
        for s in range(1, 5) for k in range(4)))


def _run(root, i, arms):
    run = root / f"run-{i}"
    figures = {"A": (4.0, 0.0, 1.0), "B": (3.0, 0.0, 1.5), "C": (2.0, 1.0 + i, 2.0), "E": (2.0 * i, 0.5, 2.5),
               "F": (3.5, 0.0, 1.0)}
    long_round = {"round": "long"}
    for arm in arms:
        _arm(run, arm, *figures[arm], tb=long_round if arm == "F" else None)
    return run


def test_every_view_the_runs_hold_with_its_own_benchs_figures(tmp_path, capsys):
    runs = [_run(tmp_path, i, "ABCEF") for i in (1, 2)]
    out = tmp_path / "rec.json"
    assert main(["-q", "bench", "demo", "--from", *map(str, runs), "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["arms"] == "ABCEF" and rec["views"] == ["main job", "consolidation", "tail batching"]
    assert rec["across_runs"]["rollout_time_ratio_ar_over_tlt"]["mean"] == pytest.approx(4.0 / 2.0)  # A over C
    # each view's own figures: E over C is 1.0 in run 1 and 2.0 in run 2; A over F 4.0 / 3.5 in each
    assert rec["consolidation"]["across_runs"]["rollout_time_ratio_e_over_c"]["mean"] == pytest.approx(1.5)
    assert [tb["by_arm"]["F"]["rollout_time_ratio_default_over_tb"] for tb in rec["tail_batching"]] == \
        pytest.approx([4.0 / 3.5] * 2)
    assert [tb["run"] for tb in rec["tail_batching"]] == [str(r) for r in runs]
    assert rec["command"].startswith("tlt demo --arms ABCEF")
    text = capsys.readouterr().out
    own = consolidation.run(argparse.Namespace(runs_from=list(map(str, runs)), quick=False, repeats=0))["summary"]
    assert all(line in text for line in own)  # the view prints what `tlt bench consolidation` prints
    assert all(line in text for line in tail_batching.lines(tail_batching.compare(runs[0])))


def test_runs_of_one_view_show_that_view_alone(tmp_path):
    runs = [_run(tmp_path, i, "BCE") for i in (1, 2)]
    out = tmp_path / "rec.json"
    assert main(["-q", "bench", "demo", "--from", *map(str, runs), "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["views"] == ["consolidation"] and "across_runs" not in rec
    mixed = [_run(tmp_path / "x", 1, "ABC"), _run(tmp_path / "x", 2, "BCE")]  # in common: B, C
    with pytest.raises(ValueError, match="hold arms BC in common"):
        views(mixed)
    with pytest.raises(ValueError, match="at least one"):
        views([])


def test_add_to_grows_a_record_over_days(tmp_path, capsys):
    """``--add-to RECORD`` keeps the earlier record's runs (with their own dates) before the new ones,
    reads every figure across all of them, and refuses a record of another kind before any work."""
    first = tmp_path / "first.json"
    assert main(["-q", "bench", "demo", "--from", str(_run(tmp_path, 1, "ABC")), "--json", str(first)]) == 0
    earlier = json.loads(first.read_text())
    for r in earlier["runs"]:  # a record written before runs carried their own date: the record's applies
        del r["date"], r["machine"]
    earlier["date"] = "2026-01-02"
    first.write_text(json.dumps(earlier))
    later = _run(tmp_path / "later", 2, "ABC")
    for arm in "AC":  # run 2's rollout ratio: 4.0 / 1.0 instead of run 1's 4.0 / 2.0
        path = later / f"arm-{arm}" / "tlt_steps.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({**r, "tlt/rollout_s": 4.0 if arm == "A" else 1.0}) + "\n" for r in rows))
    elsewhere = {"cpu": "Some CPU (family 1, model 2)", "cpus": 64}  # the demo's summary names its machine
    (later / "summary.json").write_text(json.dumps({"seconds": 600.0, "machine": elsewhere}))
    grown = tmp_path / "grown.json"
    assert main(["-q", "bench", "demo", "--from", str(later), "--add-to", str(first), "--json", str(grown)]) == 0
    rec = json.loads(grown.read_text())
    assert [r["run"] for r in rec["runs"]] == [1, 2]
    assert rec["runs"][0]["date"] == "2026-01-02" and rec["runs"][0]["machine"] == earlier["machine"]
    assert rec["runs"][1]["date"] == rec["date"] > "2026-01-02" and rec["dates"] == ["2026-01-02", rec["date"]]
    assert rec["runs"][1]["machine"] == elsewhere and rec["runs"][1]["seconds"] == 600.0
    ratio = rec["across_runs"]["rollout_time_ratio_ar_over_tlt"]
    assert (ratio["runs"], ratio["min"], ratio["max"]) == (2, pytest.approx(2.0), pytest.approx(4.0))
    assert ratio["mean"] == pytest.approx(3.0)
    assert "--add-to" in rec["command"] and "1 from" in capsys.readouterr().out

    other = tmp_path / "other.json"
    other.write_text(json.dumps({"bench": "rollout", "runs": []}))
    assert main(["bench", "demo", "--from", str(later), "--add-to", str(other)]) == 2
    assert "not a main-job record" in capsys.readouterr().err
    assert main(["bench", "demo", "--add-to", str(tmp_path / "missing.json")]) == 2  # refused before any demo runs
    assert "cannot read it" in capsys.readouterr().err
    with pytest.raises(ValueError, match="views"):  # runs of other arms do not join a main-job record
        add_to(earlier, {"views": ["consolidation"], "quick": False}, "first.json")
