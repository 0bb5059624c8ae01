"""Pushes that cannot race: a spot session trains against its own copies of the frozen embedding
and LM head (a policy push copies into the target in place), and a drafter push loads the step the
driver names, not whatever is newest when a replica gets to it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'tlt-rollout[verl]')")

from tlt.drafter.checkpoint import TrainState, save_sync  # noqa: E402
from tlt.drafter.eagle import Drafter, DrafterConfig  # noqa: E402
from tlt.drafter.model_config import ModelConfig  # noqa: E402
from tlt.rollout.target import TargetModel  # noqa: E402
from tlt.integrations.verl.spot_wiring import session_weights  # noqa: E402
from tlt.integrations.verl.weight_sync import load_spot_drafter  # noqa: E402


def _target() -> TargetModel:
    torch.manual_seed(0)
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return TargetModel(cfg).eval()


def test_a_policy_push_never_writes_what_a_session_reads():
    model = _target()
    embed, head = session_weights(model)
    before = embed.clone(), head.clone()
    with torch.no_grad():  # what update_weights does: the new policy, copied in place
        model.embed_weight.add_(1.0)
        model.lm_head.weight.mul_(2.0)
    assert torch.equal(embed, before[0]) and torch.equal(head, before[1])
    assert embed.data_ptr() != model.embed_weight.data_ptr() and head.data_ptr() != model.lm_head.weight.data_ptr()


def test_a_drafter_push_loads_the_named_step(tmp_path):
    model = _target()
    cfg = DrafterConfig.for_target(model.config)
    frozen = (model.embed_weight, model.lm_head.weight)
    for step, value in ((3, 0.3), (4, 0.4)):  # step 4 lands while step 3 is being pushed
        d = Drafter(cfg, *frozen)
        with torch.no_grad():
            d.fc.weight.fill_(value)
        state = TrainState(d, torch.optim.AdamW(list(d.parameters())), frozen=frozen)
        save_sync(tmp_path, step, {"train": state})
    got, step = load_spot_drafter(tmp_path, cfg, *frozen, step=3)
    assert step == 3 and torch.allclose(got.fc.weight, torch.full_like(got.fc.weight, 0.3))
    assert load_spot_drafter(tmp_path, cfg, *frozen)[1] == 4  # no step named: the newest
