"""Coupled sampling: speculative rollouts sample exactly the tokens plain decoding samples.

- Token identity (CPU fp32): for the same seeds, sampled speculative outputs equal plain decoding
  (the engine's and the reference loop's) for EAGLE, EAGLE-3 and n-gram drafts, chains and trees,
  at temperature 1 and with top-k / top-p, with and without shared-noise drafting.
- Statistics beyond the per-position chi-square tests (tests/rollout/test_sampling_lossless.py):
  the joint law of two consecutive tokens, and the independence of siblings (same prompt,
  consecutive seeds). A keyed hash that correlates positions or siblings must fail them.
- The hash itself: 32-bit arithmetic without int64 overflow, uniform bits.
"""

from __future__ import annotations

import pytest
import torch

from tlt.drafter.eagle import Drafter
from tlt.rollout import sampling
from tlt.rollout.eagle_proposer import EagleProposer
from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.generate import SamplingParams, generate
from tlt.rollout.suffix import SuffixProposer
from tlt.rollout.strategy import Arm
from tlt.rollout.target import TargetModel
from tests.rollout.test_sampling_lossless import V, _target, chi2_critical, chi_square, probs_from_logits
from tlt.demo.corpus import CorpusConfig, make_corpus
from tlt.tokenizer import TextTokenizer

PARAMS = {"t1": dict(temperature=1.0), "t0.8-k20-p0.9": dict(temperature=0.8, top_k=20, top_p=0.9)}
ARMS = [Arm(4, 1, 4), Arm(3, 2, 6)]


@pytest.fixture(scope="module")
def setup(trained_target):
    model = TargetModel.from_pretrained(trained_target)
    tok = TextTokenizer.from_pretrained(trained_target)
    prompts = [tok.chat_prompt([{"role": "user", "content": p.prompt}])
               for p in make_corpus(3, CorpusConfig(seed=5, median_steps=3))]
    return model, tok, [p for p in prompts for _ in range(2)]  # GRPO: 3 prompts x 2 samples


def _params(tok, name):
    return SamplingParams(max_new_tokens=48, stop_ids=(tok.eos_id,), **PARAMS[name])


SEEDS = [11, 12, 13, 14, 15, 16]


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_plain_engine_equals_reference_loop(setup, name):
    model, tok, prompts = setup
    p = _params(tok, name)
    eng = RolloutEngine(model, EngineConfig(max_batch=8, max_len=256)).generate(prompts, p, seeds=SEEDS)
    assert eng.outputs == generate(model, prompts, p, seeds=SEEDS)
    assert len({tuple(o) for o in eng.outputs}) > 3  # siblings differ: a seed per sample


@pytest.mark.parametrize("name", sorted(PARAMS))
@pytest.mark.parametrize("proposer", ["eagle", "eagle3", "eagle-no-noise", "suffix"])
def test_sampled_speculation_is_token_identical(setup, warm_drafters, name, proposer):
    model, tok, prompts = setup
    p = _params(tok, name)
    ref = RolloutEngine(model, EngineConfig(max_batch=8, max_len=256)).generate(prompts, p, seeds=SEEDS)
    groups = [i // 2 for i in range(len(prompts))]
    for arm in ARMS:
        if proposer == "suffix":
            prop = SuffixProposer()
        else:
            d = Drafter.load(warm_drafters[proposer.split("-")[0]], model.embed_weight, model.lm_head.weight)
            prop = EagleProposer(d, max_batch=8, max_len=320, shared_noise=not proposer.endswith("no-noise"))
        res = RolloutEngine(model, EngineConfig(max_batch=8, max_len=256, arm=arm), proposer=prop).generate(
            prompts, p, groups, seeds=SEEDS)
        assert res.outputs == ref.outputs, arm
        for a, b in zip(res.logprobs, ref.logprobs):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4), arm
        assert sum(res.accept_lengths) > len(res.accept_lengths)  # drafts were accepted


# ---------------------------------------------------------------- statistics (V = 12 target)
BATCH, ROUNDS = 64, 40


def _draws(model, prompt, params, first_seed):
    """Outputs of BATCH requests of one prompt with consecutive seeds (siblings)."""
    eng = RolloutEngine(model, EngineConfig(max_batch=BATCH, max_len=16))
    return eng.generate([prompt] * BATCH, params, seeds=range(first_seed, first_seed + BATCH)).outputs


def _joint_stats(model, prompt, params) -> dict[str, tuple[float, float]]:
    """(statistic, critical value) of the consecutive-token joint test and the sibling test."""
    pair = torch.zeros(V, V)  # (token 0, token 1) of one request
    sib = torch.zeros(V, V)  # (token 0 of sample 2i, token 0 of sample 2i + 1)
    for rnd in range(ROUNDS):
        outs = _draws(model, prompt, params, rnd * BATCH)
        for o in outs:
            pair[o[0], o[1]] += 1
        for a, b in zip(outs[0::2], outs[1::2]):
            sib[a[0], b[0]] += 1
    with torch.no_grad():
        p0 = probs_from_logits(model(torch.tensor([prompt])).logits[0, -1], params)  # [V]
        p1 = probs_from_logits(model(torch.tensor([prompt + [v] for v in range(V)])).logits[:, -1], params)
    out = {}
    for name, counts, exact in (("consecutive", pair, p0[:, None] * p1), ("siblings", sib, p0[:, None] * p0[None])):
        stat, df = chi_square(counts.flatten(), exact.flatten())
        out[name] = (stat, chi2_critical(df))
    return out


_GUMBEL = sampling.gumbel


def _position_blind_gumbel(keys, positions, token_ids):  # test-only: noise shared by all positions
    return _GUMBEL(keys, torch.zeros_like(positions), token_ids)


def _sibling_blind_gumbel(keys, positions, token_ids):  # test-only: every request gets row 0's key
    return _GUMBEL(keys[:1].expand_as(keys), positions, token_ids)


@pytest.mark.slow
def test_joint_laws_hold_and_a_correlating_hash_fails_them(monkeypatch):
    model = _target()
    prompt, params = [3, 1, 4, 1, 5], SamplingParams(temperature=1.0, max_new_tokens=2)
    good = _joint_stats(model, prompt, params)
    print("keyed hash", good)
    assert all(stat < crit for stat, crit in good.values()), good
    monkeypatch.setattr(sampling, "gumbel", _position_blind_gumbel)
    blind = _joint_stats(model, prompt, params)
    print("position-blind", blind)
    assert blind["consecutive"][0] > blind["consecutive"][1], blind
    monkeypatch.setattr(sampling, "gumbel", _sibling_blind_gumbel)
    shared = _joint_stats(model, prompt, params)
    print("sibling-blind", shared)
    assert shared["siblings"][0] > shared["siblings"][1], shared


def test_hash_is_32_bit_and_uniform():
    x = torch.arange(1 << 16, dtype=torch.long) * 65_521 + (1 << 32) - (1 << 20)  # values near 2^32 too
    h = sampling.mix32(x & 0xFFFFFFFF)
    assert int(h.min()) >= 0 and int(h.max()) < (1 << 32)
    for bit in range(32):  # every output bit is about fair
        assert abs(float(((h >> bit) & 1).float().mean()) - 0.5) < 0.01, bit
    keys = sampling.request_keys([0, 1, -1, (1 << 64) - 1, 1 << 63])
    assert keys[2] == keys[3] and len(set(keys.tolist())) == 4  # seeds are taken mod 2^64
    g = sampling.gumbel(keys[:2], torch.tensor([[5, 6], [5, 6]]), sampling.vocab_hash(1000, torch.device("cpu")))
    assert abs(float(g.mean()) - 0.5772) < 0.05 and abs(float(g.var()) - 1.645) < 0.15  # Gumbel(0, 1)


def test_noisy_argmax_chunks_agree():
    torch.manual_seed(0)
    scores = torch.randn(3, 2, 5000)
    keys, pos = sampling.request_keys([1, 2, 3]), torch.tensor([[7, 8]] * 3)
    whole = (scores + sampling.gumbel(keys, pos, sampling.vocab_hash(5000, torch.device("cpu")))).argmax(-1)
    old = sampling._CHUNK_ELEMENTS
    try:
        sampling._CHUNK_ELEMENTS = 700  # many chunks
        assert torch.equal(sampling.noisy_argmax(scores, keys, pos), whole)
    finally:
        sampling._CHUNK_ELEMENTS = old


# ---------------------------------------------------------------- features handed to the sink
class _Sink:
    def __init__(self, aux_layers=()):
        self.aux_layers, self.got = tuple(aux_layers), []

    def add(self, tokens, prompt_len, hidden, aux):
        self.got.append((list(tokens), prompt_len, hidden, aux))


@pytest.mark.parametrize("proposer", ["none", "suffix", "eagle", "eagle3"])
def test_rollout_features_equal_a_direct_forward(setup, warm_drafters, proposer):
    """Every finished request reaches the sink with all its tokens (the last, usually the stop
    token, a label too) and the features its rollout computed for every token but the last; they
    equal a direct forward of the same weights."""
    model, tok, prompts = setup
    p = _params(tok, "t1")
    prop, aux = None, ()
    if proposer == "suffix":
        prop = SuffixProposer()
    elif proposer.startswith("eagle"):
        d = Drafter.load(warm_drafters[proposer], model.embed_weight, model.lm_head.weight)
        prop, aux = EagleProposer(d, max_batch=8, max_len=320), d.feature_layers
    sink = _Sink(aux or (1, 2))  # without an EAGLE-3 proposer the sink still captures its own layers
    res = RolloutEngine(model, EngineConfig(max_batch=8, max_len=256, arm=Arm(3, 2, 6) if prop else None),
                        proposer=prop, sink=sink).generate(prompts, p, [i // 2 for i in range(6)], seeds=SEEDS)
    assert sorted(t for t, *_ in sink.got) == sorted(q + o for q, o in zip(prompts, res.outputs))
    for tokens, plen, hidden, got_aux in sink.got:
        assert tokens[:plen] in prompts  # the prompt length the sink was told
        with torch.no_grad():
            ref = model(torch.tensor([tokens[:-1]]), capture=sink.aux_layers)  # the last was never fed
        assert torch.allclose(hidden, ref.hidden[0], atol=1e-4), (hidden - ref.hidden[0]).abs().max()
        want = torch.cat([ref.aux[i][0] for i in sink.aux_layers], -1)
        assert torch.allclose(got_aux, want, atol=1e-4), (got_aux - want).abs().max()


def test_a_sink_and_an_eagle3_proposer_must_agree_on_layers(setup, warm_drafters):
    model, _, _ = setup
    d = Drafter.load(warm_drafters["eagle3"], model.embed_weight, model.lm_head.weight)
    with pytest.raises(ValueError, match="aux layers"):
        RolloutEngine(model, EngineConfig(arm=Arm(2, 1, 2)), proposer=EagleProposer(d, max_batch=8, max_len=64),
                      sink=_Sink((0,)))
