"""The rollout engine: greedy parity with autoregressive decoding for every strategy, elastic SD."""

from __future__ import annotations

import random

import pytest
import torch

from tlt.drafter.eagle import Drafter
from tlt.rollout.draft_tree import DraftTree, Proposer
from tlt.rollout.eagle_proposer import EagleProposer
from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.generate import SamplingParams, generate
from tlt.rollout.request import RequestState
from tlt.rollout.suffix import SuffixProposer
from tlt.rollout.strategy import Arm
from tlt.rollout.target import TargetModel
from tlt.demo.corpus import CorpusConfig, make_corpus
from tlt.tokenizer import TextTokenizer

ARMS = [Arm(1, 1, 1), Arm(4, 1, 4), Arm(3, 2, 6), Arm(5, 4, 16)]


@pytest.fixture(scope="module")
def setup(trained_target):
    model = TargetModel.from_pretrained(trained_target)
    tok = TextTokenizer.from_pretrained(trained_target)
    prompts = [tok.chat_prompt([{"role": "user", "content": p.prompt}])
               for p in make_corpus(8, CorpusConfig(seed=5, median_steps=3))]
    # Different lengths per request: the batch shrinks as they finish (the long tail).
    params = [SamplingParams(max_new_tokens=12 + 9 * i, stop_ids=(tok.eos_id,)) for i in range(8)]
    return model, prompts, params


def _ar(model, prompts, params):
    return RolloutEngine(model, EngineConfig(max_batch=8, max_len=512)).generate(prompts, params).outputs


def test_ar_engine_matches_reference_generate(setup):
    model, prompts, params = setup
    ours = _ar(model, prompts, params)
    for i, p in enumerate(prompts):
        assert ours[i] == generate(model, [p], params[i])[0]


class CorruptOracle(Proposer):
    """Drafts the known continuation with wrong siblings and wrong tokens mixed in (test-only)."""

    feature_layers = None

    def __init__(self, ref, seed=0):
        self.ref, self.rng = ref, random.Random(seed)

    def propose(self, inp):
        rows, pars, arm = [], [], inp.arm
        for r in inp.rows:
            toks, par, prev = [], [], -1
            pos = len(inp.tokens[r]) - inp.prompt_lens[r]  # committed response tokens
            for x in self.ref[r][pos: pos + arm.depth]:
                if arm.topk > 1 and self.rng.random() < 0.4:
                    toks.append(x + 1)
                    par.append(prev)
                toks.append(x if self.rng.random() > 0.15 else x + 2)
                par.append(prev)
                prev = len(toks) - 1
            rows.append(toks)
            pars.append(par)
        tree = DraftTree.chains(rows)
        for i, par in enumerate(pars):
            tree.parents[i, : len(par)] = torch.tensor(par, dtype=torch.long)
        return tree


@pytest.mark.parametrize("arm", ARMS, ids=str)
def test_greedy_parity_with_adversarial_trees(setup, arm):
    model, prompts, params = setup
    ref = _ar(model, prompts, params)
    eng = RolloutEngine(model, EngineConfig(max_batch=8, max_len=512, arm=arm), proposer=CorruptOracle(ref))
    res = eng.generate(prompts, params)
    assert res.outputs == ref
    assert max(res.accept_lengths) > 1  # drafts really were accepted


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_parity_eagle(setup, warm_drafters, method, batch):
    model, prompts, params = setup
    prompts, params = prompts[:batch], params[:batch]
    ref = _ar(model, prompts, params)
    drafter = Drafter.load(warm_drafters[method], model.embed_weight, model.lm_head.weight)
    for arm in ARMS:
        prop = EagleProposer(drafter, max_batch=8, max_len=600)
        res = RolloutEngine(model, EngineConfig(max_batch=8, max_len=512, arm=arm), proposer=prop).generate(
            prompts, params)
        assert res.outputs == ref, arm
        al = sum(res.accept_lengths) / len(res.accept_lengths)
        print(f"{method} bs={batch} {arm}: accept length {al:.2f}")
        assert al > 1.3


@pytest.mark.parametrize("arm", [Arm(4, 1, 4), Arm(4, 2, 8)], ids=str)
def test_greedy_parity_suffix_with_siblings(setup, arm):
    model, prompts, params = setup
    # GRPO: 2 prompts x 4 samples each (greedy siblings are identical: later ones copy earlier ones).
    ps = [prompts[0]] * 4 + [prompts[1]] * 4
    pa = [SamplingParams(max_new_tokens=20 + 10 * i, stop_ids=params[0].stop_ids) for i in range(8)]
    ref = _ar(model, ps, pa)
    res = RolloutEngine(model, EngineConfig(max_batch=8, max_len=512, arm=arm), proposer=SuffixProposer()).generate(
        ps, pa, groups=[0] * 4 + [1] * 4)
    assert res.outputs == ref


@pytest.mark.parametrize("window", [16, 10_000])
def test_elastic_switch_catches_up_only_what_was_missed(setup, warm_drafters, window):
    model, prompts, params = setup
    ref = _ar(model, prompts, params)
    drafter = Drafter.load(warm_drafters["eagle"], model.embed_weight, model.lm_head.weight)
    prop = EagleProposer(drafter, max_batch=8, max_len=600, catch_up_window=window, start_window=window)
    catch_ups = []
    real = prop._host_catch_up

    def spy(inp):
        missed = {r: len(inp.tokens[r]) - 1 - prop.seen[r] for r in prop.rows}
        out = real(inp)
        catch_ups.append((missed, dict(prop.floor)))
        return out

    prop._host_catch_up = spy
    arm = Arm(3, 1, 3)
    res = RolloutEngine(model, EngineConfig(max_batch=8, max_len=512, arm=arm, elastic_threshold=3),
                        proposer=prop).generate(prompts, params)
    assert res.outputs == ref  # lossless whatever the drafter saw
    assert all(s.batch <= 3 for s in res.steps if s.sd)
    assert any(s.sd for s in res.steps) and any(not s.sd for s in res.steps)
    # First SD step: each request missed its prompt and output so far; the drafter runs at most
    # `window` of those pairs (older ones are skipped and stay masked) ...
    missed, floor = catch_ups[0]
    assert all(n > 20 for n in missed.values())
    assert all(f == (n - window if n > window else 0) for f, n in zip(floor.values(), missed.values()))
    # ... afterwards only the tokens the previous step committed (at most depth + 1).
    assert all(n <= arm.depth + 1 for c, _ in catch_ups[1:] for n in c.values())
    total_pairs = sum(len(p) - 1 + len(o) for p, o in zip(prompts, ref))
    skipped = sum(catch_ups[0][1].values())
    assert prop.pairs_processed <= total_pairs - skipped  # nothing is ever recomputed
    if window < 20:
        assert skipped > 0
    else:
        assert skipped == 0


def test_bad_requests_are_clear_errors(setup):
    model, prompts, params = setup
    eng = RolloutEngine(model, EngineConfig(max_batch=2, max_len=64))
    with pytest.raises(ValueError, match="at least one"):
        eng.generate([], params[0])
    with pytest.raises(ValueError, match="max_len"):
        eng.generate([prompts[0]], SamplingParams(max_new_tokens=200))
    with pytest.raises(ValueError, match="empty"):
        eng.generate([[]], params[0])
    # NaN sampled at T=1 beside a sampled batch mate and greedily beside a greedy one; below 1e-6,
    # fp32 logits / T overflowed into NaN log-probs and token 0
    for t in (float("nan"), -1.0, 1e-39, float("inf")):
        with pytest.raises(ValueError, match=rf"temperature must be 0 \(greedy\) or a finite number >= 1e-06, got {t}"):
            SamplingParams(temperature=t)
    assert SamplingParams(temperature=1e-6).temperature == 1e-6
    with pytest.raises(ValueError, match="strategy"):
        RolloutEngine(model, EngineConfig(), proposer=SuffixProposer())

    class DuckTyped:  # propose() alone: the engine also reads capture_s, catch_up_s, forget and close
        feature_layers = None

        def propose(self, inp):
            return DraftTree.empty(len(inp.rows))

    with pytest.raises(TypeError, match="'duck'.*subclass tlt.rollout.draft_tree.Proposer"):
        RolloutEngine(model, EngineConfig(arm=Arm(2, 1, 2)), proposers={"duck": DuckTyped()})


def test_eagle_trees_are_topological():
    """The proposer's trees list every parent before its children (the verifier and the tree mask
    rely on it; checked here rather than by a device read per step)."""
    import torch

    from tlt.drafter.eagle import Drafter, DrafterConfig
    from tlt.drafter.model_config import ModelConfig
    from tlt.rollout.draft_tree import ProposerInput
    from tlt.rollout.eagle_proposer import EagleProposer
    from tlt.rollout.strategy import Arm
    from tlt.rollout.target import TargetModel

    torch.manual_seed(1)
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    target = TargetModel(cfg).eval()
    drafter = Drafter(DrafterConfig.for_target(cfg), target.embed_weight, target.lm_head.weight).eval()
    tokens = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    features = torch.randn(3, 8, 32)  # [rows, positions, F]: position t predicted token t + 1
    for g, arm in enumerate((Arm(4, 2, 8), Arm(5, 4, 16), Arm(3, 3, 9))):
        prop = EagleProposer(drafter, max_batch=3, max_len=64)
        tree = prop.propose(ProposerInput(g, (0, 1, 2), tokens, [2, 1, 3], [0, 0, 1], features, arm))
        idx = torch.arange(tree.parents.shape[1])
        assert tree.parents.shape == (3, arm.tokens_to_verify)
        assert bool((tree.parents < idx).all()) and bool((tree.parents >= -1).all())


def test_swap_remove_moves_only_rows_that_fill_holes():
    import torch

    from tlt.rollout.kv_cache import StaticKVCache, swap_remove

    assert swap_remove(6, {0, 2}) == [4, 1, 5, 3]  # survivors 4 and 5 fill holes 0 and 2
    assert swap_remove(5, {3, 4}) == [0, 1, 2]  # holes past the new end: nothing moves
    assert swap_remove(3, {0, 1, 2}) == [] and swap_remove(2, set()) == [0, 1]
    cache = StaticKVCache(1, 6, 1, 4, 2)
    cache.k[:, :, 0, 0, 0] = torch.arange(6.0)
    cache.compact_rows(swap_remove(6, {0, 2}))
    assert cache.k[0, :4, 0, 0, 0].tolist() == [4.0, 1.0, 5.0, 3.0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_prefill_in_chunks_is_token_identical(setup, warm_drafters, temperature):
    """Prompts of different lengths prefilled 16 tokens per forward (rows leave the chunks as their
    prompts end), then EAGLE speculation from the features those chunks kept: the tokens of a
    prefill in one forward, and of the plain loop. Only the prompts' last tokens reach the LM head."""
    model, prompts, _ = setup
    prompts = [p[: 8 + 7 * i] for i, p in enumerate(prompts[:6])]
    params = [SamplingParams(max_new_tokens=20, temperature=temperature)] * 6
    seeds = list(range(6))
    whole = RolloutEngine(model, EngineConfig(max_batch=8, max_len=512)).generate(prompts, params, seeds=seeds)
    heads = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: heads.append(i[0].shape))
    try:
        drafter = Drafter.load(warm_drafters["eagle"], model.embed_weight, model.lm_head.weight)
        eng = RolloutEngine(model, EngineConfig(max_batch=8, max_len=512, arm=Arm(3, 1, 3), prefill_tokens=16),
                            proposer=EagleProposer(drafter, max_batch=8, max_len=600))
        eng.add([RequestState(
            tuple(p), sp, s) for p, sp, s in zip(prompts, params, seeds)])
        eng.step()  # the prefill (and the first step)
        assert heads[0] == (6, model.config.hidden_size)  # the prefill's LM head: one position per prompt
    finally:
        hook.remove()
    chunked = RolloutEngine(model, EngineConfig(max_batch=8, max_len=512, arm=Arm(3, 1, 3), prefill_tokens=16),
                            proposer=EagleProposer(drafter, max_batch=8, max_len=600)).generate(prompts, params, seeds=seeds)
    assert chunked.outputs == whole.outputs and sum(chunked.accept_lengths) > len(chunked.accept_lengths)


@pytest.mark.parametrize("bad", [dict(max_draft_tokens=-3), dict(max_draft_tokens=2, arm=Arm(8, 4, 32)),
                                 dict(elastic_threshold=-1), dict(prefill_tokens=8), dict(attention="flash"),
                                 dict(capture_after=0), dict(block_size=0), dict(kv_blocks=4),
                                 dict(block_size=16, kv_blocks=4, kv_bytes=10), dict(block_size=16, kv_fraction=1.5),
                                 dict(block_size=16, eviction="oldest")])
def test_engine_config_refuses_each_bad_value(bad):
    with pytest.raises(ValueError):
        EngineConfig(**bad)


def test_step_records_count_only_the_tokens_a_request_keeps(setup):
    """A draft accepted past a request's budget is cut by the host; the step's committed, accepted
    and accept-length figures (the tuner's reward, the benches' accept length) count only what
    stays. They counted the whole accepted draft: 17 committed for 8 kept tokens."""
    model, prompts, _ = setup
    ref = _ar(model, prompts, [SamplingParams(max_new_tokens=40)] * len(prompts))
    short = [SamplingParams(max_new_tokens=3)] * len(prompts)
    res = RolloutEngine(model, EngineConfig(max_batch=8, max_len=512, arm=Arm(6, 1, 6)),
                        proposer=CorruptOracle(ref)).generate(prompts, short)
    assert res.outputs == [r[:3] for r in ref]
    committed = sum(s.committed for s in res.steps)
    assert committed == sum(map(len, res.outputs)) - len(prompts)  # the prefill samples each first token
    assert sum(res.accept_lengths) == committed and max(res.accept_lengths) <= 2
    assert all(s.accepted <= s.committed for s in res.steps)


def test_a_step_the_pool_could_not_speculate_is_not_the_tuners():
    """A paged pool short of a draft's room runs the step without speculation (or evicts): the
    tuner learns only from steps that ran its choice. It was fed the forced off arm, which its
    bucket did not offer, and raised mid-step, after the device had committed the step."""
    from tlt.rollout.tuner import BegMab, TunerConfig
    from tests.rollout.test_transfers import _models

    target, _ = _models()
    with torch.no_grad():  # varied tokens from a random target
        for p in target.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.4)
    prompts = [[1, 2, 3, 1, 2, 3], [4, 5, 4, 5], [6, 7, 6, 7], [8, 9, 8]]
    params = SamplingParams(max_new_tokens=20)
    plain = RolloutEngine(target, EngineConfig(max_batch=4, max_len=64)).generate(prompts, params)
    only = Arm(4, 1, 4, "suffix")
    tuner = BegMab(TunerConfig(buckets=((64, (only,)),)))
    eng = RolloutEngine(target, EngineConfig(max_batch=4, max_len=64, max_draft_tokens=8, block_size=4,
                                             kv_blocks=12), tuner=tuner, proposers={"suffix": SuffixProposer()})
    res = eng.generate(prompts, params)
    assert res.outputs == plain.outputs
    arms = {s.arm for s in res.steps}
    assert "off" in arms and str(only) in arms  # the pool forced some steps off
    assert tuner.stats()["bs<=64"][str(only)]["count"] == sum(s.arm == str(only) for s in res.steps) > 0
