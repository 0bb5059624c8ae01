"""`tlt bench step-cost`: what bounds speculation in time (the step's cost)."""

from __future__ import annotations

import json

import pytest

from tlt.cli import main


def test_bench_step_cost_quick(tmp_path, capsys):
    rec = tmp_path / "s.json"
    assert main(["-q", "bench", "step-cost", "--quick", "--json", str(rec)]) == 0
    r = json.loads(rec.read_text())
    assert r["shape"] == "demo" and set(r["by_batch"]) == {"1", "4"}
    for b in r["by_batch"].values():
        assert b["lossless"] and b["sd_step_ms"] > b["draft_ms"] > 0
        assert b["all_accepted_limit"] == pytest.approx(5 * b["ar_step_ms"] / b["sd_step_ms"])
        assert b["draft_level_vs_plain"] == pytest.approx(b["draft_ms"] / 4 / b["ar_step_ms"])
    assert "with all 4 drafts accepted at most" in capsys.readouterr().out
    assert main(["-q", "bench", "step-cost", "--prompt-len", "-3"]) == 2
    assert "--prompt-len=-3: must be >= 0" in capsys.readouterr().err
    assert main(["-q", "bench", "step-cost", "--shape", "gpt-9"]) == 2
    assert "--shape 'gpt-9': use auto, demo or one of" in capsys.readouterr().err


def test_bench_step_cost_on_a_paged_cache(tmp_path, capsys):
    """--block-size: the long-context step on a paged cache (token-identical in fp32); a short run
    or a negative size is refused, naming the flag."""
    rec = tmp_path / "p.json"
    assert main(["-q", "bench", "step-cost", "--shape", "demo", "--prompt-len", "2048", "--new-tokens", "8",
                 "--batches", "2", "--block-size", "16", "--json", str(rec)]) == 0
    r = json.loads(rec.read_text())
    assert r["block_size"] == 16 and r["by_batch"]["2"]["lossless"] and r["by_batch"]["2"]["ar_step_ms"] > 0
    assert "a paged KV cache of 16-position blocks" in capsys.readouterr().out
    assert main(["-q", "bench", "step-cost", "--shape", "demo", "--block-size", "16"]) == 2
    assert "--block-size 16: the paged cache is timed in long-context runs" in capsys.readouterr().err
    assert main(["-q", "bench", "step-cost", "--block-size", "-1"]) == 2
    assert "--block-size=-1: must be >= 0" in capsys.readouterr().err
