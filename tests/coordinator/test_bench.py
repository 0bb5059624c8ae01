"""``tlt bench coordinator --quick`` runs, is bounded, and returns a complete record."""

from __future__ import annotations

import argparse
import json
import time

from tlt.bench.coordinator import run


def test_quick_bench_record():
    t0 = time.monotonic()
    r = run(argparse.Namespace(quick=True, seed=0, json=None))
    assert time.monotonic() - t0 < 20
    json.dumps(r)  # JSON-able
    head = r["runs"][0]
    assert r["bench"] == "coordinator" and r["workers"] == 64 and head["coordinator"] == "process"
    assert head["rounds_played"] >= 1 and head["lost_workers"] == 0 and head["incomplete_rounds"] == 0
    assert head["latency_ms"]["paced"]["n"] > 0 and head["decision_ms"]["promote"]["n"] > 0
    assert head["latency_ms"]["paced"]["p50"] < 250          # sanity, not the goal (machine-dependent)
    assert any("goal p99" in line for line in r["summary"])
