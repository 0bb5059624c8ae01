"""``tlt bench resume --quick`` runs its two real gloo ranks end to end: the hand cut and DCP load
the same state (the bench fails otherwise) and the record holds a timing per state and variant."""

from __future__ import annotations

import json

from tlt.cli import main


def test_resume_bench_quick_writes_its_record(tmp_path):
    out = tmp_path / "resume.json"
    assert main(["bench", "resume", "--quick", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["bench"] == "resume" and rec["quick"] and rec["rounds"] == 3
    assert set(rec["median_s"]) == {"one-rank/cut", "one-rank/dcp", "own shards/cut", "own shards/dcp"}
    assert all(len(v) == 3 and min(v) > 0 for v in rec["times_s"].values())
    assert all(r > 0 for r in rec["dcp_over_cut"].values()) and len(rec["summary"]) == 3
