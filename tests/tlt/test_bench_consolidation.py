"""``tlt bench consolidation --from DIR ...`` pools paired demo runs: hand-made records, known ratios."""

from __future__ import annotations

import json

from tlt.cli import main


def _run(root, i, c_rollout, e_rollout, c_train, e_train):
    """Run ``i``: arm C (consolidation on) and arm E (off) at these per-step figures, B as stale."""
    run = root / f"run-{i}"
    for arm, rollout, train, al in (("B", 3.0, 0.0, 1.5), ("C", c_rollout, c_train, 2.0), ("E", e_rollout, e_train, 2.5)):
        (run / f"arm-{arm}").mkdir(parents=True)
        rows = [{"step": s, "tlt/rollout_s": rollout, "timing_s/step": rollout + 1.0, "replica_train_s": [train, 0.0],
                 "tlt/drafter_version": float(s), "tlt/spec_verifies": 10.0, "tlt/spec_committed": 10.0 * al,
                 "tlt/tail_moves": 2.0 if arm == "C" else 0.0} for s in range(1, 5)]
        (run / f"arm-{arm}" / "tlt_steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run / f"arm-{arm}" / "tlt_responses.jsonl").write_text("".join(
            json.dumps({"step": s, "index": k, "sample": 0, "sha1": f"{s}-{k}"}) + "\n"
            for s in range(1, 5) for k in range(4)))
    return run


def test_paired_runs_pool_by_step(tmp_path, capsys):
    runs = [_run(tmp_path, 1, 2.0, 2.0, 1.0, 0.5), _run(tmp_path, 2, 2.0, 4.0, 2.0, 0.5)]
    out = tmp_path / "rec.json"
    assert main(["-q", "bench", "consolidation", "--from", *map(str, runs), "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    p = rec["pooled"]
    assert p["steps"] == 6  # steps 2-4 of each run
    assert p["rollout_time_ratio_e_over_c"] == (3 * 2.0 + 3 * 4.0) / (3 * 2.0 + 3 * 2.0)
    assert p["spot_training_ratio_c_over_e"] == 3.0 and p["moves_per_step_c"] == 2.0
    assert p["accept_length_ratio_spot_vs_stale"] == 2.0 / 1.5 and p["accept_length_ratio_spot_vs_stale_e"] == 2.5 / 1.5
    lo, hi = p["rollout_time_ratio_e_over_c_ci90"]
    assert 1.0 <= lo <= p["rollout_time_ratio_e_over_c"] <= hi <= 2.0  # resampled steps: between the runs' ratios
    spread = rec["across_runs"]["rollout_time_ratio_e_over_c"]
    assert (spread["min"], spread["max"], spread["runs"]) == (1.0, 2.0, 2)
    assert [r["matched"] for r in rec["runs"]] == [16, 16]
    assert "identical responses C vs E: 100.0%, 100.0%" in capsys.readouterr().out
