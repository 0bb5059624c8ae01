"""`tlt bench headroom` and `tlt bench step-cost`: what bounds speculation (acceptance, step cost)."""

from __future__ import annotations

import json

import pytest
import torch

from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.generate import SamplingParams
from tlt.rollout.strategy import Arm
from tlt.rollout.target import TargetModel
from tlt.bench.headroom import OracleProposer
from tlt.cli import main


def test_oracle_drafts_are_the_targets_greedy_continuation(trained_target):
    model = TargetModel.from_pretrained(trained_target).eval()
    torch.manual_seed(0)
    prompts = [torch.randint(5, model.config.vocab_size, (n,)).tolist() for n in (7, 12, 4)]
    params = SamplingParams(max_new_tokens=25)  # greedy, no stop: every draft must be accepted
    ar = RolloutEngine(model, EngineConfig(max_batch=3, max_len=64)).generate(prompts, params)
    sd = RolloutEngine(model, EngineConfig(max_batch=3, max_len=64, arm=Arm(4, 1, 4)),
                       proposer=OracleProposer(model)).generate(prompts, params)
    assert sd.outputs == ar.outputs
    assert len(sd.accept_lengths) >= 3 * 4 and set(sd.accept_lengths) == {5}  # all 4 drafts + the bonus


def test_bench_headroom_quick(tmp_path, capsys):
    rec = tmp_path / "h.json"
    assert main(["-q", "bench", "headroom", "--quick", "--target-steps", "12", "--json", str(rec)]) == 0
    r = json.loads(rec.read_text())
    drafters = {"stale", "on-policy 5", "on-policy 20"}
    assert set(r["accept_length"]) == drafters | {f"{d}, shared noise" for d in drafters} | {"oracle"}
    assert set(r["shared_noise_gain"]) == drafters
    for name, row in r["accept_length"].items():
        assert set(row) == {"1", "3"} and all(al >= 1 for al in row.values()), name
        assert r["over_stale"][name]["3"] == pytest.approx(row["3"] / r["accept_length"]["stale"]["3"])
    assert 0 < r["target_top1_mass"] <= 1
    assert r["ceiling_over_stale"] == max(r["over_stale"]["oracle"].values())
    assert "-s12-" in r["target"]  # the target --target-steps trained
    assert "shared noise over deterministic drafts" in capsys.readouterr().out
    assert main(["-q", "bench", "headroom", "--target-steps", "-1"]) == 2
    assert "--target-steps=-1: must be >= 0" in capsys.readouterr().err


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


def test_bench_drafters_quick(tmp_path, capsys):
    rec = tmp_path / "d.json"
    assert main(["-q", "bench", "drafters", "--quick", "--json", str(rec)]) == 0
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
    from tlt.bench.drafters import structure_ceiling

    # [1, 2, 9 | 3]: the first verify commits 1, 2 and the sampled digit 9; the second, 3
    assert structure_ceiling([[1, 2, 9, 3]], {9}, depth=6) == 2.0
    assert structure_ceiling([[1, 2, 3, 4]], {9}, depth=2) == 4 / 2  # [1, 2 + bonus 3], [4]
    assert structure_ceiling([[9, 9]], {9}, depth=6) == 1.0


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
