"""The replica's engine assembly (no Ray): proposers as arms, in-place drafter swaps, history."""

from __future__ import annotations

import pytest
import torch

from tlt.drafter.eagle import Drafter, DrafterConfig
from tlt.drafter.model_config import ModelConfig
from tlt.rollout.generate import SamplingParams, generate
from tlt.rollout.target import TargetModel
from tlt.rollout.tuner import TunerConfig
from tlt.demo.corpus import CorpusConfig, make_corpus
from tlt.integrations.verl.assembly import ReplicaEngine
from tlt.integrations.verl.config import TLTConfig
from tlt.tokenizer import TextTokenizer


def test_a_drafter_swap_touches_only_the_drafter(trained_target, warm_drafters):
    model = TargetModel.from_pretrained(trained_target)
    tok = TextTokenizer.from_pretrained(trained_target)
    prompts = [tok.chat_prompt([{"role": "user", "content": p.prompt}])
               for p in make_corpus(2, CorpusConfig(seed=3, median_steps=2))]
    cfg = TLTConfig.from_mapping({"engine": {"max_batch": 4}})
    rep = ReplicaEngine(model, cfg, max_len=200, seed=0, rank=0)
    assert rep.proposer_name == "ngram" and set(rep.engine.proposers) == {"suffix"}
    params = SamplingParams(temperature=1.0, max_new_tokens=24, stop_ids=(tok.eos_id,))
    ref = rep.engine.generate(prompts, params, seeds=[1, 2]).outputs
    assert rep.add_history(1, list(zip(prompts, ref))) == 2
    engine, cache, suffix = rep.engine, rep.engine.cache, rep.suffix
    d = Drafter.load(warm_drafters["eagle"], model.embed_weight, model.lm_head.weight)
    rep.set_drafter(d)  # the first drafter: EAGLE arms join the suffix arms, a new tuner
    assert rep.engine is engine and engine.cache is cache and engine.proposers["suffix"] is suffix
    assert rep.proposer_name == "eagle" and {a.proposer for _, arms in engine.tuner.config.buckets for a in arms} \
        == {"", "suffix"}
    tuner = engine.tuner
    for arm in tuner.arms(2):
        tuner.record(2, arm, 0, 0.01)
    rep.set_drafter(Drafter.load(warm_drafters["eagle"], model.embed_weight, model.lm_head.weight))
    assert engine.tuner is tuner and tuner.best(2) is None  # same arms: EAGLE's estimates forgotten
    assert all(a.proposer == "suffix" or a.is_off for a in tuner._estimate[tuner.bucket_index(2)])
    assert engine.generate(prompts, params, seeds=[1, 2]).outputs == ref  # lossless after the swaps


def test_a_fixed_strategy_drafts_with_the_drafter_the_replica_has(trained_target, warm_drafters):
    """``tlt.speculation.arm`` without a warm-up drafter drafts with the suffix drafter (it used
    to refuse in the replica's constructor, inside Ray); with one, with EAGLE. No tuner either way."""
    model = TargetModel.from_pretrained(trained_target)
    cfg = TLTConfig.from_mapping({"engine": {"max_batch": 4}, "speculation": {"arm": "4,1,4"}})
    rep = ReplicaEngine(model, cfg, max_len=200, seed=0, rank=0)
    assert str(rep.engine.cfg.arm) == "d4k1v4@suffix" and rep.engine.tuner is None
    d = Drafter.load(warm_drafters["eagle"], model.embed_weight, model.lm_head.weight)
    rep = ReplicaEngine(model, cfg, max_len=200, seed=0, rank=0, drafter=d)
    assert str(rep.engine.cfg.arm) == "d4k1v4" and rep.engine.tuner is None
    out = rep.engine.generate([[1, 5, 7]], SamplingParams(temperature=0.0, max_new_tokens=8), seeds=[1])
    assert len(out.outputs[0]) == 8 and all(s.arm == "d4k1v4" for s in out.steps if s.sd)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with pytest -m gpu on a GPU machine)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replica_engine_on_a_gpu(dtype):
    """On a GPU the replica's engine runs static shapes (graph replay), the GPU tuner arms and a
    CUDA drafter; fp32 output equals the reference loop token for token (bf16: near-ties may
    differ between forward shapes, so it only has to run and stay in range); a drafter swap keeps
    the engine, its cache and its graphs."""
    torch.manual_seed(0)
    cfg = ModelConfig(model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    model = TargetModel(cfg).to(device="cuda", dtype=dtype).eval()
    tlt = TLTConfig.from_mapping({"engine": {"max_batch": 4}})
    rep = ReplicaEngine(model, tlt, max_len=96, seed=0, rank=0, device="cuda")
    assert rep.engine.static_step is not None and rep.engine.tuner.config == TunerConfig.for_device(
        "cuda", proposers=("suffix",), seed=0)
    prompts = [[1 + i, 5, 9, 2 + i, 7] * 3 for i in range(3)]
    params = SamplingParams(temperature=0.0, max_new_tokens=32)
    out = rep.engine.generate(prompts, params, seeds=[1, 2, 3]).outputs
    if dtype == torch.float32:
        assert out == generate(model, prompts, params, seeds=[1, 2, 3])
    assert all(len(o) == 32 and max(o) < cfg.vocab_size for o in out)
    engine, cache = rep.engine, rep.engine.cache
    drafter = Drafter(DrafterConfig.for_target(cfg), model.embed_weight, model.lm_head.weight).to(device="cuda",
                                                                                                 dtype=dtype)
    rep.set_drafter(drafter.eval())  # the first drafter reads the hidden state: graphs captured again
    assert rep.engine is engine and engine.cache is cache and rep.proposer_name == "eagle"
    again = engine.generate(prompts, params, seeds=[1, 2, 3]).outputs
    if dtype == torch.float32:
        assert again == out
    step, replays = engine.static_step, engine.static_step.replays
    rep.set_drafter(drafter.eval())  # a new drafter of the same kind keeps the step and its graphs
    assert engine.static_step is step and step.pool is not None
    third = engine.generate(prompts, params, seeds=[1, 2, 3]).outputs
    if dtype == torch.float32:
        assert third == again
    assert step.replays > replays
