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
    assert rep.proposer_name == "suffix" and set(rep.engine.proposers) == {"suffix"}
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


def _near_tie_violations(model, prompts, out, ref, ulps: int = 4) -> list[str]:
    """Where ``out`` first leaves the reference ``ref``, the reference's token must win by at most
    ``ulps`` bf16 steps of the top logit: a near tie that another forward shape may round the other
    way (bf16 only). Returns the violations."""
    bad = []
    for p, o, r in zip(prompts, out, ref):
        i = next((k for k, (a, b) in enumerate(zip(o, r)) if a != b), None)
        if i is None:
            bad += [f"lengths {len(o)} vs {len(r)}"] if len(o) != len(r) else []
            continue
        device = model.embed_weight.device
        with torch.no_grad():
            logits = model(torch.tensor([p + r[:i]], device=device)).logits.float()[0, -1]  # [V]
        top = logits.max()
        step = 2.0 ** (torch.floor(torch.log2(top.abs())).item() - 7)  # one bf16 ulp at the top logit
        margin = (logits[r[i]] - logits[o[i]]).item()
        if o[i] >= logits.numel() or margin > ulps * step:
            bad.append(f"position {i}: token {o[i]} trails the reference's {r[i]} by {margin:.4f} (> {ulps} ulps)")
    return bad


@pytest.mark.parametrize("seed", [0, 2, 6])  # 2 and 6 leave the reference at a near tie
def test_bf16_output_leaves_the_reference_only_at_near_ties(seed):
    """bf16 on a CPU (dynamic shapes): the speculative engine's greedy output follows the reference loop
    until a near tie, and the check rejects an output with a wrong token in it."""
    torch.manual_seed(seed)
    cfg = ModelConfig(model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    model = TargetModel(cfg).to(dtype=torch.bfloat16).eval()
    drafter = Drafter(DrafterConfig.for_target(cfg), model.embed_weight, model.lm_head.weight).to(dtype=torch.bfloat16)
    tlt = TLTConfig.from_mapping({"engine": {"max_batch": 4}, "speculation": {"arm": "4,1,4"}})
    rep = ReplicaEngine(model, tlt, max_len=96, seed=0, rank=0, drafter=drafter.eval())
    prompts = [[1 + i, 5, 9, 2 + i, 7] * 3 for i in range(3)]
    params = SamplingParams(temperature=0.0, max_new_tokens=32)
    res = rep.engine.generate(prompts, params, seeds=[1, 2, 3])
    out, ref = res.outputs, generate(model, prompts, params, seeds=[1, 2, 3])
    assert all(s.sd for s in res.steps)
    assert _near_tie_violations(model, prompts, out, ref) == []
    with torch.no_grad():  # the reference's least likely token at position 3 of the first response
        worst = int(model(torch.tensor([prompts[0] + ref[0][:3]])).logits[0, -1].argmin())
    wrong = [ref[0][:3] + [worst] + ref[0][4:], *ref[1:]]
    assert len(_near_tie_violations(model, prompts, wrong, ref)) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with pytest -m gpu on a GPU machine)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replica_engine_on_a_gpu(dtype):
    """On a GPU the replica's engine runs static shapes (graph replay), the GPU tuner arms and a
    CUDA drafter; fp32 output equals the reference loop token for token, bf16 output leaves it only
    at near ties (forward shapes round differently); a drafter swap keeps the engine, its cache and
    its graphs."""
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
    ref = generate(model, prompts, params, seeds=[1, 2, 3])
    if dtype == torch.float32:
        assert out == ref
    assert all(len(o) == 32 for o in out) and _near_tie_violations(model, prompts, out, ref) == []
    engine, cache = rep.engine, rep.engine.cache
    drafter = Drafter(DrafterConfig.for_target(cfg), model.embed_weight, model.lm_head.weight).to(device="cuda",
                                                                                                 dtype=dtype)
    rep.set_drafter(drafter.eval())  # the first drafter reads the hidden state: graphs captured again
    assert rep.engine is engine and engine.cache is cache and rep.proposer_name == "eagle"
    again = engine.generate(prompts, params, seeds=[1, 2, 3]).outputs
    if dtype == torch.float32:
        assert again == out
    assert _near_tie_violations(model, prompts, again, ref) == []
    step, replays = engine.static_step, engine.static_step.replays
    rep.set_drafter(drafter.eval())  # a new drafter of the same kind keeps the step and its graphs
    assert engine.static_step is step and step.pool is not None
    third = engine.generate(prompts, params, seeds=[1, 2, 3]).outputs
    if dtype == torch.float32:
        assert third == again
    assert _near_tie_violations(model, prompts, third, ref) == []
    assert step.replays > replays


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("with_sink", [False, True], ids=["no-sink", "sink"])
def test_the_room_kept_for_a_later_drafter_is_what_it_adds(method, with_sink):
    """``drafter_room`` (what a pool sized by memory keeps for the drafter spot training will push)
    equals what that drafter adds per position to the engine's blocks: its keys and values, and the
    features it reads that nothing stored (a sink already stores the same drafter's)."""
    import types

    from tlt.rollout.eagle_proposer import EagleProposer
    from tlt.rollout.engine import EngineConfig, RolloutEngine
    from tlt.rollout.strategy import Arm
    from tlt.integrations.verl.assembly import drafter_room

    torch.manual_seed(0)
    mc = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    target = TargetModel(mc).eval()
    dc = DrafterConfig.for_target(mc, method)
    drafter = Drafter(dc, target.embed_weight, target.lm_head.weight).eval()
    sink = types.SimpleNamespace(aux_layers=dc.aux_layers, add=lambda *a: None) if with_sink else None
    cfg = EngineConfig(max_batch=2, max_len=64, block_size=8, kv_bytes=1 << 20, arm=Arm(3, 1, 3))
    before = RolloutEngine(target, cfg, sink=sink)
    after = RolloutEngine(target, cfg, sink=sink, proposer=EagleProposer(drafter, max_batch=2, max_len=128))
    assert (after.block_bytes() - before.block_bytes()) // 8 == drafter_room(target, dc, sink) > 0


def test_a_refused_drafter_changes_nothing_in_the_replica_engine():
    """The engine refuses a drafter (its memory has no room): the replica engine keeps its drafter,
    its tuner and the tuner's statistics."""
    torch.manual_seed(0)
    mc = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = TargetModel(mc).eval()
    drafter = Drafter(DrafterConfig.for_target(mc), model.embed_weight, model.lm_head.weight).eval()
    rep = ReplicaEngine(model, TLTConfig.from_mapping({"engine": {"max_batch": 2}}), max_len=64, seed=0, rank=0,
                        drafter=drafter)
    tuner = rep.engine.tuner
    for arm in tuner.arms(2):
        tuner.record(2, arm, 0, 0.01)
    best = tuner.best(2)

    def refuse(proposers, tuner):
        raise ValueError("no room")

    rep.engine.set_proposers = refuse
    with pytest.raises(ValueError, match="no room"):
        rep.set_drafter(Drafter(DrafterConfig.for_target(mc), model.embed_weight, model.lm_head.weight))
    assert rep.drafter is drafter and rep.engine.tuner is tuner and tuner.best(2) == best is not None
