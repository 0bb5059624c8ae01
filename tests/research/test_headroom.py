"""`python examples/research/headroom.py`: how much an adapted drafter can buy (acceptance ceilings)."""

from __future__ import annotations

import collections
import json

import pytest
import torch

import headroom
from _run import main
from headroom import OracleProposer, run
from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.generate import SamplingParams
from tlt.rollout.strategy import Arm
from tlt.rollout.target import TargetModel


def test_oracle_drafts_are_the_targets_greedy_continuation(trained_target):
    model = TargetModel.from_pretrained(trained_target).eval()
    torch.manual_seed(0)
    prompts = [torch.randint(5, model.config.vocab_size, (n,)).tolist() for n in (7, 12, 4)]
    params = SamplingParams(max_new_tokens=25)  # greedy, no stop: every draft must be accepted
    ar = RolloutEngine(model, EngineConfig(max_batch=3, max_len=64)).generate(prompts, params)
    sd = RolloutEngine(model, EngineConfig(max_batch=3, max_len=64, arm=Arm(4, 1, 4)),
                       proposer=OracleProposer(model)).generate(prompts, params)
    assert sd.outputs == ar.outputs
    # all 4 drafts + the bonus, but each request's last step: its budget (24 tokens after the
    # prefill's) keeps 4 of its 5
    assert collections.Counter(sd.accept_lengths) == {5: 3 * 4, 4: 3}


def test_bench_headroom_quick(tmp_path, capsys):
    rec = tmp_path / "h.json"
    assert main(run, headroom.__doc__, ["-q", "--quick", "--target-steps", "12", "--json", str(rec)]) == 0
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
    with pytest.raises(SystemExit):
        main(run, headroom.__doc__, ["--target-steps", "-1"])
    assert "--target-steps=-1" in capsys.readouterr().err
