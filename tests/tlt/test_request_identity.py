"""Request identity in verl runs: seeds from what identifies a request, duplicates refused, a
canonical batch order, and the sampling-parameter translation of the tlt rollout."""

from __future__ import annotations

import numpy as np
import pytest

from tlt.drafter.seeds import fallback_seed, request_seed
from tlt.integrations.verl.requests import canonical_order, duplicate_requests, engine_params, plain

MSG = [{"role": "user", "content": "Compute 1 + 2."}]


def _seed(**kw):
    base = dict(data_seed=1, step=3, index=7, sample=0, validate=False, prompt=MSG)
    return request_seed(**{**base, **kw})


def test_seeds_depend_on_every_part_of_a_requests_identity_and_nothing_else():
    s = _seed()
    assert s == _seed() and 0 <= s < 1 << 63  # stable across processes and runs: no hash randomisation
    others = [_seed(data_seed=2), _seed(step=4), _seed(index=8), _seed(sample=1), _seed(validate=True),
              _seed(prompt=[{"role": "user", "content": "Compute 1 + 3."}])]
    assert len({s, *others}) == 1 + len(others)
    siblings = [_seed(sample=i) for i in range(64)]
    assert len(set(siblings)) == 64
    # verl hands the agent loop numpy arrays of message dicts: the same prompt, the same seed
    assert _seed(prompt=plain(np.array(MSG, dtype=object))) == s


def test_a_request_without_a_seed_keeps_one_per_request_id():
    """The fallback seed follows the request id (stable for a caller that keeps it, as verl's client
    does under rollout.full_determinism), and never falls in request_seed's 63-bit range."""
    a = fallback_seed(3, "5f0e-uuid")
    assert a == fallback_seed(3, "5f0e-uuid") and a >> 63 == 1
    assert len({a, fallback_seed(3, "5f0e-uuie"), fallback_seed(4, "5f0e-uuid")}) == 3


def test_duplicate_index_and_prompt_is_found():
    other = [{"role": "user", "content": "Compute 2 + 2."}]
    assert duplicate_requests([0, 1, 2], [MSG, MSG, other]) == []  # same prompt, distinct indices
    assert duplicate_requests([0, 0], [MSG, other]) == []  # verl's index 0 default, distinct prompts
    dups = duplicate_requests([5, 5, 6], [MSG, np.array(MSG, dtype=object), other])
    assert [i for i, _ in dups] == [5]


def test_canonical_order_ignores_arrival():
    uid_index = {"u-a": 3, "u-b": 0}
    keys = ["u-a_1_0", "u-b_1_0", "u-a_0_0", "u-b_0_0", "u-b_0_1"]
    order = canonical_order(keys, uid_index)
    assert [keys[i] for i in order] == ["u-b_0_0", "u-b_0_1", "u-b_1_0", "u-a_0_0", "u-a_1_0"]
    shuffled = [keys[i] for i in (4, 2, 0, 3, 1)]
    assert [shuffled[i] for i in canonical_order(shuffled, uid_index)] == [keys[i] for i in order]


def test_engine_params_honour_the_seed_and_refuse_lossy_settings():
    params, seed = engine_params({"temperature": 1.0, "top_k": -1, "seed": 42, "logprobs": True}, prompt_len=10,
                                 max_len=64, response_length=32, eos_ids=(2,))
    assert seed == 42 and params.temperature == 1.0 and params.top_k == 0 and params.stop_ids == (2,)
    assert engine_params({}, prompt_len=10, max_len=64, response_length=32, eos_ids=())[1] is None
    with pytest.raises(ValueError, match="seed"):
        engine_params({"seed": "7"}, prompt_len=10, max_len=64, response_length=32, eos_ids=())
    with pytest.raises(ValueError, match="repetition_penalty"):
        engine_params({"repetition_penalty": 1.1}, prompt_len=10, max_len=64, response_length=32, eos_ids=())
    with pytest.raises(ValueError, match="no room"):
        engine_params({}, prompt_len=63, max_len=64, response_length=32, eos_ids=())


def test_the_replica_stops_on_generation_config_stop_tokens(tmp_path):
    """An instruct model lists its turn end only in generation_config.json (Llama-3's <|eot_id|>);
    the replica stops there too, as vLLM and SGLang do, so the tlt rollout's responses are theirs."""
    import json

    import torch

    from tlt.drafter.model_config import ModelConfig
    from tlt.rollout.engine import EngineConfig, RolloutEngine
    from tlt.rollout.target import TargetModel

    torch.manual_seed(0)
    TargetModel(ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            eos_token_id=63)).save_pretrained(tmp_path)

    def respond(model):  # as TLTServer.generate builds a greedy request's parameters
        params, _ = engine_params({"temperature": 0}, prompt_len=3, max_len=64, response_length=24,
                                  eos_ids=tuple(model.config.eos_ids))
        return RolloutEngine(model, EngineConfig(max_batch=1, max_len=64, max_draft_tokens=0)).generate(
            [[1, 2, 3]], params).outputs[0]

    free = respond(TargetModel.from_pretrained(tmp_path))
    stop = free[5]
    assert stop != 63 and stop not in free[:5]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [63, stop]}))
    model = TargetModel.from_pretrained(tmp_path)
    assert model.config.eos_ids == (63, stop)
    assert respond(model) == free[:6]  # the stop token is the response's last
