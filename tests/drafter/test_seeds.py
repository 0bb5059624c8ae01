"""Every derived seed comes from tlt.drafter.seeds, with the values runs have always used (changing
one changes every run's tokens), and no formula is written anywhere else."""

from __future__ import annotations

import re
from pathlib import Path

from tlt.drafter import seeds

ROOT = Path(__file__).resolve().parents[2]


def test_seed_values_are_pinned():
    assert seeds.derive(5, 3) == 5 * 1_000_003 + 3 == 5_000_018
    assert seeds.replica_seed(2, 1) == 2 * 7919 + 1 == 15_839
    identity = dict(data_seed=1, step=2, index=3, sample=4, validate=False, prompt=[{"role": "user", "content": "hi"}])
    assert seeds.request_seed(**identity) == 1344270579756036132
    assert seeds.fallback_seed(3, "5f0e-uuid") == 10691112805167598562


def test_the_engine_and_the_replicas_use_them():
    from tlt.rollout.engine import EngineConfig, RolloutEngine
    from tlt.rollout.generate import SamplingParams
    from tlt.rollout.target import TargetModel
    from tlt.drafter.model_config import ModelConfig

    import torch

    torch.manual_seed(0)
    model = TargetModel(ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8)).eval()
    p = SamplingParams(temperature=1.0, max_new_tokens=6)
    eng = RolloutEngine(model, EngineConfig(max_batch=2, max_len=32, seed=7))
    assert eng.generate([[1, 2], [3, 4]], p).outputs == eng.generate(
        [[1, 2], [3, 4]], p, seeds=[seeds.derive(7, 0), seeds.derive(7, 1)]).outputs


def test_no_seed_formula_outside_the_seeds_module():
    pattern = re.compile(r"1_?000_?003|\* ?7919|1 << 63")
    found = [f"{p.relative_to(ROOT)}:{i}" for d in ("tlt", "rollout", "drafter", "coordinator")
             for p in (ROOT / d).rglob("*.py") if p.name != "seeds.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []
