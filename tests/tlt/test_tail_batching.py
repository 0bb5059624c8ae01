"""Tail batching's rule (tlt.integrations.verl.tail_batching), without Ray or verl.

Over several epochs of a shuffled dataloader, with random finishing times and drops: every prompt
is trained exactly once per epoch (the flush at the epoch's end included), every trained group has
exactly R0 finished responses, an epoch takes as many steps as without tail batching, and a state
saved mid-epoch (queue not empty) goes on as if nothing had stopped. The choice takes the first P0
prompts to finish R0 responses and never counts a dropped response. The driver's end of a round
(tail_round) resumes every replica whatever fails, with the replicas and Ray's ``get`` stood in.
"""

from __future__ import annotations

import pickle
import random
import sys
import types

import numpy as np
import pytest
import torch

from tlt.integrations.verl.tail_batching import Choice, Done, Round, TailBatcher, cat, choose, n_rows, take


class Loader:
    """A shuffled dataloader over ``n`` prompts, ``rows`` per batch, drop_last (verl's sampler)."""

    def __init__(self, n: int, rows: int, seed: int = 0) -> None:
        self.n, self.rows, self.rng, self.it, self.fetches = n, rows, random.Random(seed), iter(()), 0

    def _epoch(self):
        order = list(range(self.n))
        self.rng.shuffle(order)
        for k in range(self.n // self.rows):
            idx = order[k * self.rows:(k + 1) * self.rows]
            yield {"index": np.array(idx), "raw_prompt": np.array([{"p": i} for i in idx], dtype=object),
                   "input_ids": torch.tensor([[i, i + 1] for i in idx])}

    def fetch(self):
        self.fetches += 1
        try:
            return next(self.it)
        except StopIteration:
            self.it = self._epoch()
            return next(self.it)


def _batcher(loader: Loader, p0: int, r0: int, pf: float, rf: float, at: int = 0) -> TailBatcher:
    return TailBatcher(prompt_factor=pf, response_factor=rf, long_round_at=at, p0=p0, r0=r0, batch_rows=p0,
                       fetches_per_epoch=loader.n // p0, fetch=loader.fetch)


def _play(b: TailBatcher, rng: random.Random, trained: list[list[int]]) -> str:
    """One step: the round launched, its responses end at random times (some dropped), the first
    P0 prompts are trained; returns the round's kind."""
    rnd = b.next_round()
    idx = [int(i) for i in rnd.prompts["index"]]
    assert [row[0] for row in rnd.prompts["input_ids"].tolist()] == idx  # columns stay aligned
    uids = [f"u{i}" for i in idx]
    if rnd.kind == "short":
        done = [Done(u, s, rng.random() < 0.2, rng.random(), rng.randint(1, 50)) for u in uids for s in range(rnd.n)]
        while (choice := choose(uids, done, rnd.keep_prompts, rnd.keep_responses)) is None:
            done = [dataclass_replace(d, dropped=False) for d in done]  # a rerun where fewer drop
        for u, samples in choice.kept.items():
            assert len(samples) == rnd.keep_responses == len(set(samples))
            assert all(not d.dropped for d in done if d.uid == u and d.sample in samples)
        trained.append([i for i, u in zip(idx, uids) if u in choice.kept])
        b.settle(rnd, [k for k, u in enumerate(uids) if u not in choice.kept])
    else:
        assert rnd.n == rnd.keep_responses and len(idx) == rnd.keep_prompts
        trained.append(idx)
        b.settle(rnd)
    assert len(trained[-1]) == rnd.keep_prompts
    return rnd.kind


def dataclass_replace(d: Done, **kw) -> Done:
    import dataclasses

    return dataclasses.replace(d, **kw)


@pytest.mark.parametrize("n, p0, r0, pf, rf, at", [
    (32, 8, 4, 2.0, 1.5, 0),    # the demo's shape: short, long, short, long
    (40, 8, 2, 1.5, 2.0, 0),    # a queue that grows by half a step: long rounds every other step
    (48, 4, 3, 3.0, 1.0, 12),   # a long round waits for three steps' worth of queued prompts
    (24, 8, 4, 1.0, 1.0, 0),    # factors 1: every round keeps all it launched
])
def test_every_prompt_trained_once_per_epoch_with_r0_responses(n, p0, r0, pf, rf, at):
    loader = Loader(n, p0, seed=n)
    b = _batcher(loader, p0, r0, pf, rf, at)
    rng = random.Random(7)
    steps_per_epoch = n // p0
    kinds = []
    for epoch in range(3):
        trained: list[list[int]] = []
        for _ in range(steps_per_epoch):
            kinds.append(_play(b, rng, trained))
        flat = sorted(i for t in trained for i in t)
        assert flat == list(range(n)), f"epoch {epoch}: trained {flat}"
        assert n_rows(b.queue) == 0 and n_rows(b.pool) == 0 and b.fetched == 0 and b.epoch == epoch + 1
    assert loader.fetches == 3 * steps_per_epoch  # the dataloader's epochs line up with the trainer's
    if pf > 1:
        assert {"short", "long"} <= set(kinds)


def test_choice_is_the_first_p0_to_finish_r0_and_never_counts_a_drop():
    uids = ["a", "b", "c"]
    done = [Done("a", 0, False, 1.0, 5), Done("a", 1, False, 9.0, 5), Done("a", 2, False, 2.0, 5),
            Done("b", 0, False, 1.5, 5), Done("b", 1, True, 0.5, 2), Done("b", 2, False, 4.0, 5),
            Done("c", 0, False, 0.1, 5)]
    got = choose(uids, done, 2, 2)
    # a finishes at 2.0 (samples 0, 2); b at 4.0 (its dropped sample 1 at 0.5 does not count); c never
    assert got == Choice(kept={"a": [0, 2], "b": [0, 2]}, dropped_uids=["c"])
    assert choose(uids, done, 3, 2) is None
    assert choose(uids, done, 1, 2).kept == {"a": [0, 2]}
    # had b's dropped response counted, b would have finished first (at 1.5)
    assert choose(uids, [dataclass_replace(d, dropped=False) for d in done], 1, 2).kept == {"b": [0, 1]}


def test_state_saved_with_a_queue_resumes_the_epoch():
    """Stop after the first short round (the queue holds the dropped prompts), pickle the state as
    the checkpoint does, and go on in a new batcher over a dataloader at the same position: the
    epoch still trains every prompt once; the run without the stop trains the same prompts."""
    n, p0, r0 = 32, 8, 4
    rng = random.Random(3)
    whole, trained = _batcher(Loader(n, p0, seed=1), p0, r0, 2.0, 1.5), []
    for _ in range(n // p0):
        _play(whole, rng, trained)

    rng = random.Random(3)
    loader = Loader(n, p0, seed=1)
    first, before = _batcher(loader, p0, r0, 2.0, 1.5), []
    assert _play(first, rng, before) == "short"
    assert n_rows(first.queue) == 8
    state = pickle.loads(pickle.dumps(first.state()))
    resumed = _batcher(loader, p0, r0, 2.0, 1.5)  # verl's dataloader state: the same iterator position
    resumed.restore(state)
    after = []
    kinds = [_play(resumed, rng, after) for _ in range(n // p0 - 1)]
    assert kinds[0] == "long"  # the queue saved at the checkpoint runs next
    assert sorted(i for t in before + after for i in t) == list(range(n))
    assert before + after == trained


def test_empty_state_after_restore_loses_the_queue():
    """The check above fails when the queue is not part of the state: the epoch misses prompts."""
    n, p0 = 32, 8
    rng = random.Random(3)
    loader = Loader(n, p0, seed=1)
    first, before = _batcher(loader, p0, 4, 2.0, 1.5), []
    _play(first, rng, before)
    state = first.state()
    state["queue"] = {}
    resumed = _batcher(loader, p0, 4, 2.0, 1.5)
    resumed.restore(state)
    for _ in range(n // p0 - 1):
        _play(resumed, rng, before)
    assert sorted(i for t in before for i in t) != list(range(n))  # 8 prompts lost, the next epoch begun early
    assert resumed.epoch == 1


def test_columns_take_and_cat_keep_rows_aligned():
    a = {"x": torch.arange(4), "y": np.array(list("abcd"), dtype=object)}
    b = {"x": torch.arange(4, 6), "y": np.array(list("ef"), dtype=object)}
    c = cat(a, b)
    t = take(c, [5, 0, 3])
    assert t["x"].tolist() == [5, 0, 3] and list(t["y"]) == ["f", "a", "d"]
    with pytest.raises(ValueError, match="columns"):
        cat(a, {"x": torch.arange(1)})


def test_a_replica_whose_drop_fails_leaves_no_replica_dropping(monkeypatch):
    """The drop reaches every replica; one fails (a timeout): the replicas that dropped must not
    go on refusing every request, so the round's end resumes them all before it raises."""
    pytest.importorskip("ray", reason="the verl extra is not installed (pip install 'tlt-rollout[verl]')")
    from tlt.integrations.verl import tail_round

    class Replica:  # a Ray actor handle's shape: replica.method.remote() -> a reference
        def __init__(self, rank: int) -> None:
            self.drop_requests = types.SimpleNamespace(remote=lambda: ("drop", rank))
            self.resume_generation = types.SimpleNamespace(remote=lambda: ("resume", rank))

    calls = []

    def get(refs, timeout):
        calls.append(refs)
        if refs[0][0] == "drop":
            raise TimeoutError("replica 1 did not drop within 300 s")
        return [None] * len(refs)

    monkeypatch.setattr(tail_round, "ray", types.SimpleNamespace(get=get))
    monkeypatch.setattr(tail_round, "read_done", lambda want: [Done("a", 0, False, 1.0, 5)])
    monkeypatch.setitem(sys.modules, "transfer_queue", types.SimpleNamespace())  # (nothing reaches it)
    replicas = [Replica(0), Replica(1)]
    with pytest.raises(TimeoutError, match="did not drop"):
        tail_round.finish_short_round(Round("short", {}, 1, 1, 1), ["a"], lambda: replicas, poll_s=0.01)
    assert calls == [[("drop", 0), ("drop", 1)], [("resume", 0), ("resume", 1)]]
