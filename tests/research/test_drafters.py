"""`python examples/research/drafters.py`: the model-free and EAGLE drafters side by side."""

from __future__ import annotations

import json

import drafters
from _run import main
from drafters import run, structure_ceiling


def test_bench_drafters_quick(tmp_path, capsys):
    rec = tmp_path / "d.json"
    assert main(run, drafters.__doc__, ["-q", "--quick", "--json", str(rec)]) == 0
    r = json.loads(rec.read_text())
    assert set(r["variants"]) == {"suffix, siblings only", "suffix + history", "suffix + history + global",
                                  "EAGLE (warm-up)", "BEG-MAB: EAGLE + suffix", "union: EAGLE + suffix"}
    for name, row in r["variants"].items():
        assert set(row) == ({"tree"} if name.startswith("union") else {"chain", "tree"})  # a union has 2 paths
        for shape in row:
            assert row[shape]["accept_length"] >= 1.0 and row[shape]["verifies"] > 0, (name, shape)
            assert all(us > 0 for us in row[shape]["us_per_propose_per_request"].values())
    assert r["variants"]["suffix + history"]["chain"]["history"]["responses"] > 0
    assert 1.0 <= r["text_ceiling"]["chain"] <= 7.0  # at most depth 6 + the bonus token
    assert "x siblings-only" in capsys.readouterr().out


def test_text_ceiling_counts_each_digit_as_a_miss():
    # [1, 2, 9 | 3]: the first verify commits 1, 2 and the sampled digit 9; the second, 3
    assert structure_ceiling([[1, 2, 9, 3]], {9}, depth=6) == 2.0
    assert structure_ceiling([[1, 2, 3, 4]], {9}, depth=2) == 4 / 2  # [1, 2 + bonus 3], [4]
    assert structure_ceiling([[9, 9]], {9}, depth=6) == 1.0
