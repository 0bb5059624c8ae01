"""The replica's engine assembly (no Ray): proposers as arms, in-place drafter swaps, history."""

from __future__ import annotations

from drafter.eagle import Drafter
from rollout.generate import SamplingParams
from rollout.target import TargetModel
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
