"""`python examples/research/tuner_surface.py` (quick): structure and sanity of the simulated BEG-MAB vs oracle comparison."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from tlt.rollout.strategy import Arm
from tuner_surface import Surface, run, simulate, static


@pytest.fixture(scope="module")
def record():
    return run(argparse.Namespace(quick=True, seed=0, json=None))


def test_record_structure(record):
    assert record["bench"] == "tuner" and record["quick"] is True and record["seed"] == 0
    assert set(record["scenarios"]) == {"stationary", "shift_down", "shift_up"}
    assert record["summary"] and all(isinstance(line, str) for line in record["summary"])
    assert any("% of the oracle" in line for line in record["summary"])
    json.dumps(record)  # JSON-able
    for sc in record["scenarios"].values():
        names = set(sc["variants"])
        assert {"oracle", "oracle_bucket", "oracle_elastic", "oracle_grid", "begmab", "begmab_elastic32",
                "begmab_uniform_explore", "ar"} <= names
        assert any(n.startswith("static:") for n in names)
        assert "bs<=12" in sc["tuner_stats_seed0"]


def test_numbers_are_finite_and_consistent(record):
    for name, sc in record["scenarios"].items():
        v = sc["variants"]
        tokens = {x["tokens"] for x in v.values()}
        assert len(tokens) == 1, f"{name}: variants committed different token totals"
        for key, x in v.items():
            assert math.isfinite(x["wall_s"]) and x["wall_s"] > 0, (name, key)
            assert math.isfinite(x["goodput_tok_s"]) and x["goodput_tok_s"] > 0, (name, key)
        assert v["ar"]["sd_steps"] == 0
        for k in ("begmab_pct_of_oracle", "begmab_pct_of_oracle_bucket", "gain_vs_ar",
                  "gain_vs_best_static", "gain_vs_engine_default", "gain_vs_fixed_elastic32"):
            assert math.isfinite(sc[k]), (name, k)


def test_oracle_beats_every_variant_within_noise(record):
    for name, sc in record["scenarios"].items():
        gp = {k: x["goodput_tok_s"] for k, x in sc["variants"].items()}
        for key, g in gp.items():
            if key != "oracle_grid":  # a superset of the oracle's arms
                assert g <= 1.03 * gp["oracle"], (name, key, g, gp["oracle"])
            if key.endswith("elastic32"):  # behind the same fixed switch
                assert g <= 1.03 * gp["oracle_elastic"], (name, key)
        # the learned threshold beats a fixed one where speculation still pays above 32 requests
        assert gp["begmab"] > gp["begmab_elastic32"] and gp["oracle"] >= gp["oracle_elastic"]
        assert gp["oracle_grid"] >= 0.99 * gp["oracle"]


def test_ar_is_slowest_or_close(record):
    # Among the adaptive variants and the best static arm (a fixed deep chain with a stale drafter
    # may legitimately be slower than AR: that is what adaptivity is for).
    for name, sc in record["scenarios"].items():
        gp = {k: x["goodput_tok_s"] for k, x in sc["variants"].items()}
        others = [g for k, g in gp.items() if k.startswith(("oracle", "begmab"))]
        others.append(gp["static:" + sc["best_static"]])
        assert gp["ar"] <= 1.03 * min(others), (name, gp)
        assert sc["gain_vs_ar"] > 1.0


def test_surface_model_sanity():
    s = Surface()
    deep, chain = Arm(8, 4, 32), Arm(4, 1, 4)
    # more acceptance -> more accepted tokens; a tree beats a chain at equal alpha
    assert s.expected_accepted(deep, 0.8) > s.expected_accepted(deep, 0.4) > 0
    assert s.expected_accepted(deep, 0.8) > s.expected_accepted(chain, 0.8)
    assert s.expected_accepted(Arm.off(), 0.8) == 0
    # small batches: speculation pays; very large batches: a deep tree loses to AR
    assert s.rate(1, deep, 0.8, 1000) > 2 * s.rate(1, Arm.off(), 0.8, 1000)
    assert s.rate(256, deep, 0.8, 256_000) < s.rate(256, Arm.off(), 0.8, 256_000)


def test_simulate_commits_every_token_and_is_seeded():
    lengths = [5, 40, 300]
    out = simulate(lengths, 16, static(Arm(6, 4, 16)), lambda *a: None, Surface(), (0.8, 0.4), 3)
    again = simulate(lengths, 16, static(Arm(6, 4, 16)), lambda *a: None, Surface(), (0.8, 0.4), 3)
    assert out == again and out["tokens"] == sum(lengths)
    ar = simulate(lengths, 16, static(Arm.off()), lambda *a: None, Surface(), (0.8, 0.4), 3)
    assert ar["steps"] == max(lengths) and out["steps"] < ar["steps"]
