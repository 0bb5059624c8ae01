"""The engine's request lifecycle is lossless: requests that join a running generation, leave it and
go on in another engine, or are aborted and resubmitted, sample exactly the tokens (and log-probs)
of an uninterrupted plain run with the same seeds (coupled sampling, CPU fp32).

Covered: greedy and sampled decoding; plain decoding, EAGLE, EAGLE-3, the suffix drafter, chain and
tree arms, BEG-MAB over EAGLE and the suffix drafter; dynamic and static step shapes. Every test
counts the joins, leaves and aborts it made. The feature sink receives departed and aborted
requests: each response position exactly once over all the engines a request ran in.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tlt.drafter.eagle import Drafter
from tlt.rollout.eagle_proposer import EagleProposer
from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.generate import SamplingParams
from tlt.rollout.suffix import SuffixProposer
from tlt.rollout.request import RequestState
from tlt.rollout.strategy import Arm
from tlt.rollout.target import TargetModel
from tlt.rollout.tuner import BegMab, TunerConfig
from tlt.demo.corpus import CorpusConfig, make_corpus
from tlt.tokenizer import TextTokenizer

SEEDS = [21, 22, 23, 24, 25, 26]
ARMS = {"chain": Arm(4, 1, 4), "tree": Arm(3, 2, 6)}
SAMPLING = {"greedy": dict(temperature=0.0), "t1": dict(temperature=1.0)}


@pytest.fixture(scope="module")
def setup(trained_target):
    model = TargetModel.from_pretrained(trained_target)
    tok = TextTokenizer.from_pretrained(trained_target)
    prompts = [tok.chat_prompt([{"role": "user", "content": p.prompt}])
               for p in make_corpus(3, CorpusConfig(seed=9, median_steps=3))]
    return model, tok, [p for p in prompts for _ in range(2)]  # GRPO: 3 prompts x 2 samples


def _states(tok, prompts, sampling):
    # different budgets: the batch shrinks while others join
    return [RequestState(tuple(p), SamplingParams(max_new_tokens=24 + 6 * i, stop_ids=(tok.eos_id,),
                                                  **SAMPLING[sampling]), SEEDS[i], group=i // 2)
            for i, p in enumerate(prompts)]


def _reference(model, states):
    res = RolloutEngine(model, EngineConfig(max_batch=8, max_len=256)).generate(
        [s.prompt for s in states], [s.params for s in states], [s.group for s in states], [s.seed for s in states])
    return res.outputs, res.logprobs


# A paged cache of 8-position blocks; _paged() sizes it to hold the largest request and little more
PAGED = dict(block_size=8, max_draft_tokens=8)


def _paged(states, extra_blocks: int = 2) -> dict:
    """PAGED with a pool of the largest request's blocks and ``extra_blocks`` more: too small for the
    six requests at once, so they are evicted and prefilled again."""
    need = max(-(-(len(s.prompt) + s.params.max_new_tokens + 1 + PAGED["max_draft_tokens"]) // PAGED["block_size"])
               for s in states)
    return {**PAGED, "kv_blocks": need + extra_blocks}


def _engine(model, kind, arm, warm_drafters, static=False, sink=None, paged=None):
    cfg = dict(max_batch=8, max_len=256, static_shapes=static, **(paged or {}))
    if kind == "plain":
        return RolloutEngine(model, EngineConfig(**cfg), sink=sink)

    def eagle(method):
        d = Drafter.load(warm_drafters[method], model.embed_weight, model.lm_head.weight)
        return EagleProposer(d, max_batch=8, max_len=320, static_shapes=static)
    if kind == "begmab":
        tuner = BegMab(TunerConfig.for_device("cpu", proposers=("", "suffix"), seed=3, epsilon=0.5))
        return RolloutEngine(model, EngineConfig(**cfg), proposers={"": eagle("eagle"), "suffix": SuffixProposer()},
                             tuner=tuner, sink=sink)
    prop = SuffixProposer() if kind == "suffix" else eagle(kind)
    return RolloutEngine(model, EngineConfig(**cfg, arm=arm), proposer=prop, sink=sink)


def _run(engine, done):
    while engine.active:
        done.update((f.rid, f) for f in engine.step())


def _check(outs, ref):
    for (toks, lps), want, want_lp in zip(outs, *ref):
        assert list(toks) == want
        assert torch.allclose(torch.tensor(lps, dtype=torch.float64), torch.tensor(want_lp, dtype=torch.float64),
                              atol=1e-4)


def _join(model, kind, arm, drafters, states, static=False, paged=None):
    """Half the requests start; the rest join after three steps."""
    eng = _engine(model, kind, arm, drafters, static, paged=paged)
    done = {}
    first = eng.add(states[:3])
    for _ in range(3):
        done.update((f.rid, f) for f in eng.step())
    later = eng.add(states[3:])
    _run(eng, done)
    assert eng.lifecycle["joined"] == 3 or paged  # (a paged engine admits the rest as blocks free up)
    return [(done[r].state.output, done[r].state.logprobs) for r in first + later], eng


def _move(model, kind, arm, drafters, states, static=False, paged=None):
    """All start in A; after four steps three requests leave A and go on in B (fresh proposers),
    where two of them join B's running requests."""
    a, b = _engine(model, kind, arm, drafters, static, paged=paged), _engine(model, kind, arm, drafters, static, paged=paged)
    done_a, done_b = {}, {}
    rids = a.add(states)
    for _ in range(4):
        done_a.update((f.rid, f) for f in a.step())
    movers = [r for r in rids[::2] if r not in done_a]
    assert movers, "the budgets leave requests running after four steps"
    moved = a.leave(movers)
    assert all(f.reason == "left" and (f.state.output or paged) for f in moved)  # (paged: some wait unstarted)
    by_b = dict(zip([f.rid for f in moved], b.add([moved[0].state])))
    done_b.update((f.rid, f) for f in b.step())
    by_b.update(zip([f.rid for f in moved[1:]], b.add([f.state for f in moved[1:]])))
    _run(a, done_a)
    _run(b, done_b)
    assert a.lifecycle["left"] == len(movers) and (b.lifecycle["joined"] == len(movers) - 1 or paged)
    outs = []
    for r in rids:
        f = done_b[by_b[r]] if r in by_b else done_a[r]
        outs.append((f.state.output, f.state.logprobs))
    return outs, (a, b)


def _abort(model, kind, arm, drafters, states, verl_style, paged=None):
    """All start; after five steps every request is aborted, then resubmitted from its partial
    output: as its state (into the same engine), or as verl's partial rollout does it (prompt +
    partial output as a new prompt, the budget left, the same seed) into a fresh engine."""
    eng = _engine(model, kind, arm, drafters, paged=paged)
    done = {}
    rids = eng.add(states)
    for _ in range(5):
        done.update((f.rid, f) for f in eng.step())
    aborted = {f.rid: f for f in eng.abort()}
    assert not eng.active and aborted and all(f.reason == "aborted" for f in aborted.values())
    assert eng.lifecycle["aborted"] == len(aborted)
    if verl_style:
        eng = _engine(model, kind, arm, drafters, paged=paged)
        again = [dataclasses.replace(f.state, prompt=f.state.prompt + f.state.output, output=(), logprobs=(),
                                     params=dataclasses.replace(f.state.params, max_new_tokens=f.state.params.max_new_tokens
                                                                - len(f.state.output)), handed_over=0)
                 for f in aborted.values()]
    else:
        again = [f.state for f in aborted.values()]
    new = dict(zip(aborted, eng.add(again)))
    redone = {}
    _run(eng, redone)
    outs = []
    for r in rids:
        if r in done:
            outs.append((done[r].state.output, done[r].state.logprobs))
            continue
        f = redone[new[r]]
        if verl_style:  # the partial output, then what the resubmission generated
            part = aborted[r].state
            outs.append((part.output + f.state.output, part.logprobs + f.state.logprobs))
        else:
            outs.append((f.state.output, f.state.logprobs))
    return outs


@pytest.mark.parametrize("sampling", sorted(SAMPLING))
@pytest.mark.parametrize("kind,arm", [("plain", "chain")] + [(k, a) for k in ("eagle", "eagle3", "suffix")
                                                             for a in sorted(ARMS)])  # plain runs no arm
def test_join_leave_abort_are_token_identical(setup, warm_drafters, kind, arm, sampling):
    model, tok, prompts = setup
    states = _states(tok, prompts, sampling)
    ref = _reference(model, states)
    outs, eng = _join(model, kind, ARMS[arm], warm_drafters, states)
    _check(outs, ref)
    outs, (a, b) = _move(model, kind, ARMS[arm], warm_drafters, states)
    _check(outs, ref)
    _check(_abort(model, kind, ARMS[arm], warm_drafters, states, verl_style=False), ref)
    _check(_abort(model, kind, ARMS[arm], warm_drafters, states, verl_style=True), ref)
    if kind != "plain":  # drafts were accepted in the engines requests moved between
        for e in (eng, a, b):
            assert sum(e.accept_lengths_since(0)) > len(e.accept_lengths_since(0))


@pytest.mark.parametrize("sampling", sorted(SAMPLING))
def test_lifecycle_under_begmab_and_static_shapes(setup, warm_drafters, sampling):
    model, tok, prompts = setup
    states = _states(tok, prompts, sampling)
    ref = _reference(model, states)
    outs, eng = _join(model, "begmab", None, warm_drafters, states)
    _check(outs, ref)
    arms = {s.arm for s in eng.steps}
    assert any(a.endswith("@suffix") for a in arms) and any(a.startswith("d") and "@" not in a for a in arms), arms
    outs, _ = _move(model, "begmab", None, warm_drafters, states)
    _check(outs, ref)
    _check(_abort(model, "begmab", None, warm_drafters, states, verl_style=False), ref)
    # static step shapes (what CUDA graphs need): padding follows the batch as requests join and leave
    outs, eng = _join(model, "eagle", ARMS["tree"], warm_drafters, states, static=True)
    _check(outs, ref)
    assert eng.proposer.static_proposals > 0
    outs, _ = _move(model, "eagle", ARMS["chain"], warm_drafters, states, static=True)
    _check(outs, ref)


@pytest.mark.parametrize("sampling", sorted(SAMPLING))
@pytest.mark.parametrize("kind,arm", [("plain", "chain"), ("eagle", "chain"), ("eagle3", "tree"), ("suffix", "tree"),
                                      ("begmab", None)])
def test_evictions_are_token_identical(setup, warm_drafters, kind, arm, sampling):
    """A paged cache too small for every request at once: requests are evicted and prefilled again,
    alone and mixed with joins, moves and aborts, and sample the uninterrupted run's tokens."""
    model, tok, prompts = setup
    states = _states(tok, prompts, sampling)
    ref = _reference(model, states)
    arm, paged = ARMS[arm] if arm else None, _paged(states)
    outs, eng = _join(model, kind, arm, warm_drafters, states, paged=paged)
    _check(outs, ref)
    assert eng.lifecycle["evicted"] > 0 and sum(s.recomputed for s in eng.steps) > 0
    outs, (a, b) = _move(model, kind, arm, warm_drafters, states, paged=paged)
    _check(outs, ref)
    _check(_abort(model, kind, arm, warm_drafters, states, verl_style=False, paged=paged), ref)
    outs, eng = _join(model, kind, arm, warm_drafters, states, static=True, paged=paged)
    _check(outs, ref)
    assert eng.lifecycle["evicted"] > 0
    if kind != "plain":
        assert sum(eng.accept_lengths_since(0)) > len(eng.accept_lengths_since(0))


def test_a_pool_holding_one_request_at_a_time_finishes_every_request(setup, warm_drafters):
    """No request is evicted forever: with blocks for the largest request's budget and no more, the
    last running request is never evicted, so every request finishes, with its uninterrupted tokens,
    and every block comes back."""
    model, tok, prompts = setup
    states = _states(tok, prompts, "t1")
    ref = _reference(model, states)
    outs, eng = _join(model, "eagle", ARMS["chain"], warm_drafters, states, paged=_paged(states, extra_blocks=0))
    _check(outs, ref)
    assert eng.lifecycle["evicted"] > 0 and not eng.active and eng.pool.free == eng.pool.capacity


def test_a_failed_admission_loses_no_request_and_holds_no_block(setup):
    """A prefill that fails (out of memory, say) as requests join, one of them back from an
    eviction: the batch waits again as it was, the pool holds the running rows' blocks only, and
    once the fault is gone every request samples the uninterrupted run's tokens."""
    model, tok, prompts = setup
    states = _states(tok, prompts, "t1")
    ref = _reference(model, states)
    eng = _engine(model, "plain", None, None, paged=_paged(states))
    real, faults = eng._prefill, []

    def prefill(reqs, row0, tables=None):
        if any(r.state.output for r in reqs) and not faults:  # a request back from an eviction joins
            faults.append(len(reqs))
            raise RuntimeError("out of memory")
        return real(reqs, row0, tables)

    eng._prefill = prefill
    rids, done, steps = eng.add(states[:3]), {}, 0
    while eng.active:
        steps += 1
        if steps == 4:  # the rest join a running batch (as in _join: the pool runs short)
            rids += eng.add(states[3:])
        waiting, running = list(eng.sched.queue), list(eng._rows)
        try:
            done.update((f.rid, f) for f in eng.step())
        except RuntimeError as e:
            assert "out of memory" in str(e)
            assert eng.sched.queue == waiting and eng._rows == running and eng.sched.holds_evicted
            assert eng.pool.used == sum(len(eng.pool.held(r)) for r in running)
    assert faults and eng.pool.used == 0
    _check([(done[r].state.output, done[r].state.logprobs) for r in rids], ref)


class RecordingSink:
    aux_layers = ()

    def __init__(self):
        self.samples = []  # (tokens, first trained position, hidden)

    def add(self, tokens, prompt_len, hidden, aux):
        self.samples.append((list(tokens), prompt_len, hidden))


def test_departed_and_aborted_requests_reach_the_sink_once(setup, warm_drafters):
    """A's sink gets a moved request's first part and B's the rest (the first part as context):
    over both, every response position is trained on once, with the features an uninterrupted
    run computes. An aborted request hands over what it has."""
    model, tok, _ = setup
    prompts = [tok.chat_prompt([{"role": "user", "content": p.prompt}])  # distinct: a sample names its request
               for p in make_corpus(6, CorpusConfig(seed=10, median_steps=3))]
    states = _states(tok, prompts, "t1")
    whole = RecordingSink()
    RolloutEngine(model, EngineConfig(max_batch=8, max_len=256), sink=whole).generate(
        [s.prompt for s in states], [s.params for s in states], seeds=[s.seed for s in states])
    sink_a, sink_b = RecordingSink(), RecordingSink()
    a = RolloutEngine(model, EngineConfig(max_batch=8, max_len=256), sink=sink_a)
    b = RolloutEngine(model, EngineConfig(max_batch=8, max_len=256), sink=sink_b)
    rids = a.add(states)
    for _ in range(6):
        a.step()
    moved = a.leave([r for r in rids[1::2] if r in a._rows])
    assert moved and all(f.state.handed_over == len(f.state.output) for f in moved)
    b.add([f.state for f in moved])
    _run(b, {})
    a.step()
    aborted = a.abort()
    assert aborted and a.lifecycle["aborted"] == len(aborted) and a.lifecycle["left"] == len(moved)
    assert len(sink_b.samples) == len(moved)
    assert len(sink_a.samples) >= len(moved) + len(aborted)  # and those that finished in A
    trained: dict[int, list[int]] = {}  # per uninterrupted sample: every position trained on
    for toks, start, hidden in sink_a.samples + sink_b.samples:
        k = next(i for i, (t, _, _) in enumerate(whole.samples) if t[:len(toks)] == toks)
        assert torch.allclose(hidden, whole.samples[k][2][:len(toks) - 1], atol=1e-4)  # what an uninterrupted run computes
        trained.setdefault(k, []).extend(range(start, len(toks)))
    for positions in trained.values():
        assert len(positions) == len(set(positions))  # never twice
    for f in moved:  # a moved request: every response position, over both engines
        k = next(i for i, (t, _, _) in enumerate(whole.samples) if t[:len(f.state.prompt) + len(f.state.output) - 1]
                 == list(f.state.prompt + f.state.output[:-1]))
        assert sorted(trained[k]) == list(range(len(f.state.prompt), len(whole.samples[k][0])))


def test_lifecycle_errors_are_clear(setup):
    model, tok, prompts = setup
    eng = RolloutEngine(model, EngineConfig(max_batch=2, max_len=64))
    p = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match="already ended"):
        eng.add([RequestState((1, 2), p, 0, output=(5, 6, 7, 8), logprobs=(0.0,) * 4)])
    with pytest.raises(ValueError, match="max_len"):
        eng.add([RequestState(tuple(range(1, 70)), p, 0)])
    with pytest.raises(ValueError, match="log-probs"):
        RequestState((1,), p, 0, output=(3,))
    with pytest.raises(ValueError, match="not running or waiting"):
        eng.leave([123])
    vocab = model.config.vocab_size
    for bad in ((1, vocab), (-1, 2)):  # refused at add, not failing a prefill others share
        with pytest.raises(ValueError, match="outside the target's vocabulary"):
            eng.add([RequestState(bad, p, 0)])
    with pytest.raises(ValueError, match="seed"):
        RequestState((1, 2), p, None)
    with pytest.raises(ValueError, match="stop_ids"):
        SamplingParams(max_new_tokens=4, stop_ids=(-1,))
    rids = eng.add([RequestState((1, 2, 3), p, s) for s in range(3)])  # one more than max_batch: it waits
    eng.step()
    assert eng.running == 2 and eng.active
    with pytest.raises(RuntimeError, match="idle engine"):
        eng.generate([[1, 2]], p)
    gone = eng.abort([rids[2]])  # a waiting request leaves with nothing generated
    assert gone[0].state.output == () and gone[0].reason == "aborted"
    done = {}
    _run(eng, done)
    assert set(done) == set(rids[:2]) and all(len(f.state.output) == 4 for f in done.values())


def test_evicted_requests_reach_the_sink_once(setup):
    """A paged cache too small for its requests: each eviction hands the request's features over, its
    re-prefill takes them as context only, so over the rollout every response position of every
    request is trained on exactly once, with the features an uninterrupted run computes."""
    model, tok, _ = setup
    prompts = [tok.chat_prompt([{"role": "user", "content": p.prompt}])  # distinct: a sample names its request
               for p in make_corpus(6, CorpusConfig(seed=10, median_steps=3))]
    states = _states(tok, prompts, "t1")
    args = ([s.prompt for s in states], [s.params for s in states])
    whole, sink = RecordingSink(), RecordingSink()
    RolloutEngine(model, EngineConfig(max_batch=8, max_len=256), sink=whole).generate(
        *args, seeds=[s.seed for s in states])
    eng = RolloutEngine(model, EngineConfig(max_batch=8, max_len=256, **_paged(states)), sink=sink)
    eng.generate(*args, seeds=[s.seed for s in states])
    assert eng.lifecycle["evicted"] > 0 and eng.fed["evicted"] > 0
    trained: dict[int, list[int]] = {}
    for toks, start, hidden in sink.samples:
        k = next(i for i, (t, _, _) in enumerate(whole.samples) if t[:len(toks)] == toks)
        assert torch.allclose(hidden, whole.samples[k][2][:len(toks) - 1], atol=1e-4)
        trained.setdefault(k, []).extend(range(start, len(toks)))
    for k, (toks, start, _) in enumerate(whole.samples):  # every position once: none lost, none doubled
        assert sorted(trained[k]) == list(range(start, len(toks)))


@pytest.mark.parametrize("paged", [False, True])
def test_memory_released_between_rollouts_comes_back_token_identical(setup, warm_drafters, paged):
    """verl's sleep between rollouts: an idle engine frees its KV cache, its feature buffer and its
    EAGLE drafter's KV (their storage is empty), refuses to while requests run, and the next rollout
    allocates them again and samples the tokens an engine that never slept samples."""
    model, tok, prompts = setup
    states = _states(tok, prompts, "t1")
    ref = _reference(model, states)
    eng = _engine(model, "eagle", ARMS["chain"], warm_drafters, sink=RecordingSink(),
                  paged=_paged(states, extra_blocks=40) if paged else None)
    args = ([s.prompt for s in states], [s.params for s in states], [s.group for s in states], [s.seed for s in states])
    eng.generate(*args)
    rid = eng.add([states[0]])[0]
    with pytest.raises(RuntimeError, match="idle engine"):
        eng.release_memory()
    eng.abort([rid])
    held = eng.cache.k.nbytes + eng.cache.v.nbytes + eng.features.buf.nbytes
    assert eng.release_memory() == held and eng.release_memory() == 0  # a second sleep frees nothing more
    assert eng.cache.released and eng.proposer.cache.released and eng.features.buf is None
    assert eng.cache.k.untyped_storage().nbytes() == 0 == eng.proposer.cache.k.untyped_storage().nbytes()
    res = eng.generate(*args)  # woken by the rollout's requests
    assert not eng.cache.released and not eng.proposer.cache.released
    _check(zip(res.outputs, res.logprobs), ref)
    assert sum(res.accept_lengths) > len(res.accept_lengths)  # the drafter drafted from its new KV
    eng.release_memory()
    eng.restore_memory()  # verl's wake_up: allocated before the requests come
    assert not eng.cache.released
    res = eng.generate(*args)
    _check(zip(res.outputs, res.logprobs), ref)
