"""History-aware model-free drafting and proposers as arms.

- :class:`tlt.rollout.history.ResponseHistory`: each prompt's last visits, however long ago, bounded per
  prompt, in prompts and globally, rebuildable from its pairs (a restarted replica).
- The suffix drafter drafts a prompt's earlier responses: with the seeds of an earlier epoch it
  drafts exactly what the target samples; sampled outputs stay token-identical to plain decoding.
- The engine runs several proposers as arms, checks every arm at construction, swaps proposers
  without rebuilding, and does not charge a proposer's catch-up after another one's steps.
"""

from __future__ import annotations

import pytest
import torch

from tlt.drafter.eagle import Drafter
from tlt.rollout.eagle_proposer import EagleProposer
from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.generate import SamplingParams
from tlt.rollout.history import HistoryConfig, ResponseHistory
from tlt.rollout.suffix import SuffixProposer
from tlt.rollout.strategy import Arm
from tlt.rollout.target import TargetModel
from tlt.rollout.tuner import BegMab, TunerConfig
from tlt.demo.corpus import CorpusConfig, make_corpus
from tlt.tokenizer import TextTokenizer


def test_history_keeps_each_prompts_last_visits_however_long_ago_bounded_everywhere():
    h = ResponseHistory(HistoryConfig(visits=2, per_prompt=3, max_prompts=2, global_tokens=40))
    p, q, r = [1, 2, 3], [4, 5], [6]
    h.add(1, [(p, [10, 11]), (q, [20])])
    h.add(2, [(p, [12]), (p, [13]), (p, [14])])
    assert h.stats()["responses"] == 4  # p keeps its newest 3, q still has step 1's
    h.add(9, [(q, [21, 22])])  # q returns 8 steps later (the next epoch): both its visits are kept
    kept = h.pairs()
    assert [(s, r) for s, k, r in kept if k == p] == [(2, [12]), (2, [13]), (2, [14])]
    assert [(s, r) for s, k, r in kept if k == q] == [(1, [20]), (9, [21, 22])]
    h.add(10, [(q, [23])])  # a third visit: q's first one leaves
    assert [(s, r) for s, k, r in h.pairs() if k == q] == [(9, [21, 22]), (10, [23])]
    assert h.stats()["global_tokens"] <= 40
    kept = h.pairs()
    rebuilt = ResponseHistory(HistoryConfig(visits=2, per_prompt=3, max_prompts=2, global_tokens=40))
    for step in sorted({s for s, _, _ in kept}):
        rebuilt.add(step, [(k, r) for s, k, r in kept if s == step])
    assert rebuilt.pairs() == kept
    assert rebuilt.sources(tuple(p))[0].tokens == h.sources(tuple(p))[0].tokens  # the pool: from what is kept
    h.add(11, [(r, [30])])  # a third prompt: the least recently visited one (p) goes
    assert {tuple(k) for _, k, _ in h.pairs()} == {tuple(q), tuple(r)}
    assert h.sources(tuple(p)) == [h.sources(tuple(r))[-1]]  # p drafts from the global pool only
    for bad in ({"visits": -1}, {"per_prompt": 0}, {"max_prompts": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            HistoryConfig(**bad)


def test_the_global_pool_drafts_without_per_prompt_history():
    """visits=0 (no prompt's own responses) leaves the pool across prompts on, as the verl keys
    ``history_visits: 0`` and ``history_global_tokens`` say; both 0: no history at all."""
    from tlt.integrations.verl.config import TLTConfig

    h = ResponseHistory(HistoryConfig(visits=0, global_tokens=40))
    h.add(1, [([1, 2, 3], [10, 11]), ([4, 5], [20])])
    assert h.pairs() == [] and h.stats()["global_tokens"] > 0
    assert len(h.sources((1, 2, 3))) == 1 and h.sources((1, 2, 3)) == h.sources((9,))  # the pool only
    spec = TLTConfig.from_mapping({"speculation": {"history_visits": 0}}).speculation
    assert spec.history_config() == HistoryConfig(visits=0, global_tokens=8192)
    both = {"speculation": {"history_visits": 0, "history_global_tokens": 0}}
    assert TLTConfig.from_mapping(both).speculation.history_config() is None


@pytest.fixture(scope="module")
def setup(trained_target):
    model = TargetModel.from_pretrained(trained_target)
    tok = TextTokenizer.from_pretrained(trained_target)
    prompts = [tok.chat_prompt([{"role": "user", "content": p.prompt}])
               for p in make_corpus(4, CorpusConfig(seed=9, median_steps=3))]
    params = SamplingParams(temperature=1.0, max_new_tokens=40, stop_ids=(tok.eos_id,))
    return model, [p for p in prompts for _ in range(2)], params


def _suffix_engine(model, history, arm=Arm(8, 1, 8)):
    return RolloutEngine(model, EngineConfig(max_batch=8, max_len=200, arm=arm),
                         proposers={"suffix": SuffixProposer(history=history)})


def test_a_prompts_history_drafts_what_the_target_samples_again(setup):
    """Epoch 2 with epoch 1's seeds samples epoch 1's responses (coupled sampling): the history
    drafter proposes them, nearly every draft is accepted, and the tokens stay exact."""
    model, prompts, params = setup
    seeds = list(range(100, 108))
    plain = RolloutEngine(model, EngineConfig(max_batch=8, max_len=200)).generate(prompts, params, seeds=seeds)
    groups = [i // 2 for i in range(8)]
    without = _suffix_engine(model, None, Arm(8, 1, 8, "suffix")).generate(prompts, params, groups, seeds)
    h = ResponseHistory()
    h.add(1, list(zip(prompts, plain.outputs)))
    with_history = _suffix_engine(model, h, Arm(8, 1, 8, "suffix")).generate(prompts, params, groups, seeds)
    assert without.outputs == plain.outputs == with_history.outputs
    al_without = sum(without.accept_lengths) / len(without.accept_lengths)
    al_with = sum(with_history.accept_lengths) / len(with_history.accept_lengths)
    print(f"suffix drafter AL: siblings only {al_without:.2f}, with the prompt's history {al_with:.2f}")
    assert al_with > 5.0 and al_with > 2 * al_without
    # new seeds: other samples, still exact, still helped by the shared structure
    other = list(range(200, 208))
    ref = RolloutEngine(model, EngineConfig(max_batch=8, max_len=200)).generate(prompts, params, seeds=other)
    assert _suffix_engine(model, h, Arm(4, 2, 8, "suffix")).generate(prompts, params, groups, other).outputs == \
        ref.outputs
    greedy = SamplingParams(max_new_tokens=40, stop_ids=params.stop_ids)  # and greedy: identical tokens
    ref = RolloutEngine(model, EngineConfig(max_batch=8, max_len=200)).generate(prompts, greedy).outputs
    for arm in (Arm(8, 1, 8, "suffix"), Arm(4, 2, 8, "suffix")):
        assert _suffix_engine(model, h, arm).generate(prompts, greedy, groups).outputs == ref


def test_engine_runs_eagle_and_suffix_as_arms_and_checks_them(setup, warm_drafters):
    model, prompts, params = setup
    d = Drafter.load(warm_drafters["eagle"], model.embed_weight, model.lm_head.weight)
    eagle = EagleProposer(d, max_batch=8, max_len=260)
    tuner = BegMab(TunerConfig.for_device("cpu", proposers=("", "suffix"), seed=1))
    eng = RolloutEngine(model, EngineConfig(max_batch=8, max_len=200), proposers={"": eagle, "suffix": SuffixProposer()},
                        tuner=tuner)
    seeds = list(range(8))
    ref = RolloutEngine(model, EngineConfig(max_batch=8, max_len=200)).generate(prompts, params, seeds=seeds)
    res = eng.generate(prompts, params, [i // 2 for i in range(8)], seeds)
    assert res.outputs == ref.outputs
    used = {s.arm.split("@")[1] if "@" in s.arm else "eagle" for s in res.steps if s.sd}
    assert used == {"eagle", "suffix"}, used  # both were tried (untried arms come first)
    cache = eng.cache
    eng.set_proposers({"suffix": SuffixProposer()}, BegMab(TunerConfig.for_device("cpu", proposers=("suffix",))))
    assert eng.cache is cache and eng.generate(prompts, params, seeds=seeds).outputs == ref.outputs  # no rebuild
    with pytest.raises(ValueError, match="names proposer ''"):  # EAGLE arms without an EAGLE proposer
        RolloutEngine(model, EngineConfig(max_batch=8, max_len=200), proposers={"suffix": SuffixProposer()},
                      tuner=BegMab(TunerConfig.for_device("cpu", proposers=("", "suffix"))))
    with pytest.raises(ValueError, match="max_draft_tokens=2"):  # the tuner's arms verify up to 8 tokens
        RolloutEngine(model, EngineConfig(max_batch=8, max_len=200, max_draft_tokens=2), proposer=eagle,
                      tuner=BegMab(TunerConfig.for_device("cpu")))


class _SlowCatchUp(SuffixProposer):
    """The suffix drafter reporting a slow catch-up (test-only): the engine must not charge it
    to the arm after a switch from another proposer."""

    def propose(self, inp):
        tree = super().propose(inp)
        self.catch_up_s = 0.5
        return tree


class _Recorder(BegMab):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.seen = []

    def record(self, batch_size, arm, accepted, seconds):
        self.seen.append((str(arm), seconds))
        super().record(batch_size, arm, accepted, seconds)


def test_catch_up_after_another_proposers_steps_is_not_charged(setup):
    model, prompts, params = setup
    arms = (Arm(4, 1, 4, "a"), Arm(4, 1, 4, "b"))
    tuner = _Recorder(TunerConfig(buckets=((64, arms),), epsilon=0.0))
    eng = RolloutEngine(model, EngineConfig(max_batch=8, max_len=200),
                        proposers={"a": _SlowCatchUp(), "b": SuffixProposer()}, tuner=tuner)
    eng.generate(prompts, params, seeds=list(range(8)))
    times = [t for arm, t in tuner.seen if arm.endswith("@a")]
    assert times and max(times[:1]) < 0.5  # its first step follows a prefill / another arm: no charge


def test_tuner_forgets_a_swapped_drafters_arms_only():
    tuner = BegMab(TunerConfig.for_device("cpu", proposers=("", "suffix")))
    for arm in tuner.arms(1):
        tuner.record(1, arm, 0, 0.01)
    assert tuner.best(1) is not None
    assert tuner.forget("") == sum(1 for _, arms in tuner.config.buckets for a in arms if a.proposer == "" and not a.is_off)
    assert tuner.best(1) is None  # its EAGLE arms are untried again
    assert all(a.proposer != "" or a.is_off for a in tuner._estimate[tuner.bucket_index(1)])


def test_history_memory_per_thousand_prompts():
    """What the history costs, for the docs: 1,000 prompts x 8 responses of 150 tokens, one step."""
    import tracemalloc

    gen = torch.Generator().manual_seed(0)
    pairs = [([1, 2, 3, i % 97, i // 97], torch.randint(3, 500, (150,), generator=gen).tolist())
             for i in range(1000) for _ in range(8)]
    tracemalloc.start()
    h = ResponseHistory(HistoryConfig(global_tokens=8192))
    h.add(1, pairs)
    for i in range(1000):  # each prompt's corpus is indexed when first asked for
        h.sources((1, 2, 3, i % 97, i // 97))
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"history: {used / 2**20:.1f} MiB per 1,000 prompts x 8 responses x 150 tokens (indexed)")
    assert used < 1 << 30


def test_history_corpora_are_indexed_once_across_generations_and_bounded(monkeypatch):
    """A replica runs many engine generations per RL step over the same corpora: each is indexed
    once (re-indexing the global pool per generation cost ~0.1 s each and slowed the demo's arm B
    by a third), and the kept tables stay under TABLE_TOKENS history tokens."""
    from tlt.rollout.draft_tree import ProposerInput

    h = ResponseHistory(HistoryConfig(visits=1, global_tokens=80))  # the pool: the newest response
    prop = SuffixProposer(history=h)
    tables: dict[int, tuple] = {}  # id(corpus) -> (corpus, kept alive: ids stay unique; its first table)
    real = prop._corpus_table

    def spy(corpus):
        table = real(corpus)
        assert tables.setdefault(id(corpus), (corpus, table))[1] is table, "a corpus was indexed again"
        return table

    monkeypatch.setattr(prop, "_corpus_table", spy)
    for step in range(6):
        h.add(step, [([1, 2, step % 5], list(range(10, 60)))])
        for g in range(3):  # three generations (engine batches) in one RL step
            prompts = [[1, 2, step % 5]] * 2
            prop.propose(ProposerInput(10 * step + g, (0, 1), prompts, [3, 3], [0, 0], None, Arm(3, 1, 3)))
    assert len(tables) == 12  # each step: the prompt's corpus and the global pool, indexed once
    monkeypatch.setattr(SuffixProposer, "TABLE_TOKENS", 100)  # a new step's corpora evict the old ones
    h.add(6, [([1, 2, 9], list(range(10, 40)))])
    prop.propose(ProposerInput(99, (0, 1), [[1, 2, 9]] * 2, [3, 3], [0, 0], None, Arm(3, 1, 3)))
    assert len(prop._tables) == 2 and prop._table_tokens <= 100
