"""RollPacker's tail batching in the ``tlt`` trainer: which prompts a round launches, trains and queues.

Owns the plan of rounds and the queue of dropped prompts (:class:`TailBatcher`), the choice of
what a short round trains (:func:`choose`) and the stop reason of a dropped request
(:data:`DROPPED`). No Ray, no verl: the trainer (:mod:`.trainer`) and the round's driver
(:mod:`.tail_round`) carry it out.

The rule (RollPacker, "tail batching"; ``tlt.tail.batching``), with P0 = ``data.train_batch_size``
prompts and R0 = ``rollout.n`` responses trained per step:

- a **short round** launches ``ceil(prompt_factor * P0)`` fresh prompts with
  ``ceil(response_factor * R0)`` responses each. A prompt finishes at its R0-th finished response;
  the first P0 prompts to finish are trained, each with its first R0 finished responses. Then every
  request still running is dropped (its partial output is never trained) and the prompts not
  trained join the queue;
- a **long round** runs P0 queued prompts (oldest first) with R0 responses each, to the end. It
  starts once ``long_round_at`` prompts have queued (0: P0);
- **the epoch's end (the flush)**: when fewer fresh prompts remain in the epoch than a short round
  launches and the queue is below the trigger, rounds of P0 prompts (the queue first, then the
  remaining fresh ones) run to the end, like long rounds. An epoch has N = k * P0 prompts
  (verl's sampler drops the last partial batch), so it ends after exactly k steps with every
  prompt trained once and the queue empty, as without tail batching.

Nothing migrates and nothing aborted is resumed: a dropped prompt is generated again from its
start in a later round, by the policy of that step, so training stays on-policy. Every trained
group has exactly R0 finished responses.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

DROPPED = "tlt_dropped"  # a dropped request's stop reason (verl's client resubmits "aborted" ones)
MARKERS = "tlt_tail"  # the TransferQueue partition where the tlt_agent loop reports each response's end
SHORT_ROUND_KEY = "tlt_short_round"  # batch marker: this round's responses report their end

Columns = dict[str, Any]  # a dataloader batch: column -> tensor [N, ...] or numpy array [N]


def n_rows(cols: Columns) -> int:
    return len(next(iter(cols.values()))) if cols else 0


def take(cols: Columns, idx: Sequence[int]) -> Columns:
    """Rows ``idx`` of ``cols``, in that order."""
    out = {}
    for k, v in cols.items():
        if isinstance(v, torch.Tensor):
            out[k] = v[torch.as_tensor(list(idx), dtype=torch.long)]
        elif isinstance(v, np.ndarray):
            out[k] = v[np.asarray(list(idx), dtype=np.int64)]
        else:
            raise TypeError(f"dataloader column {k!r} is a {type(v).__name__}; tail batching handles tensors and "
                            "numpy arrays")
    return out


def cat(a: Columns, b: Columns) -> Columns:
    if not a:
        return dict(b)
    if not b:
        return dict(a)
    if set(a) != set(b):
        raise ValueError(f"dataloader batches differ in columns: {sorted(set(a) ^ set(b))}")
    return {k: torch.cat([a[k], b[k]]) if isinstance(a[k], torch.Tensor) else np.concatenate([a[k], b[k]])
            for k in a}


@dataclasses.dataclass(frozen=True)
class Round:
    kind: str  # short | long | flush
    prompts: Columns  # the prompts launched, as the dataloader gave them
    n: int  # responses launched per prompt
    keep_prompts: int  # P0: prompts trained
    keep_responses: int  # R0: responses trained per prompt

    @property
    def requests(self) -> int:
        return n_rows(self.prompts) * self.n


@dataclasses.dataclass(frozen=True)
class Done:
    """One response's end, as the tlt_agent loop reported it."""

    uid: str
    sample: int
    dropped: bool
    t: float  # wall-clock seconds (time.time()) at the end
    length: int  # tokens generated (for a dropped one: before the drop)


@dataclasses.dataclass(frozen=True)
class Choice:
    kept: dict[str, list[int]]  # uid -> the sample indices trained (R0 each), in the order P0 finished
    dropped_uids: list[str]  # the prompts that go to the queue, in launch order


def choose(uids: Sequence[str], done: Sequence[Done], p0: int, r0: int) -> Choice | None:
    """The first ``p0`` prompts (of ``uids``, in launch order) to finish ``r0`` responses, each with
    its first ``r0`` finished ones; None while fewer than ``p0`` have. A prompt finishes at its
    ``r0``-th finished response (the agent loops' clocks; ties in launch and sample order). Dropped
    responses never count."""
    order = {u: i for i, u in enumerate(uids)}
    by_uid: dict[str, list[Done]] = {}
    for d in done:
        if not d.dropped and d.uid in order:
            by_uid.setdefault(d.uid, []).append(d)
    finished = []
    for u, ds in by_uid.items():
        if len(ds) >= r0:
            first = sorted(ds, key=lambda d: (d.t, d.sample))[:r0]
            finished.append((first[-1].t, order[u], u, sorted(d.sample for d in first)))
    if len(finished) < p0:
        return None
    kept = {u: samples for _, _, u, samples in sorted(finished)[:p0]}
    return Choice(kept=kept, dropped_uids=[u for u in uids if u not in kept])


class TailBatcher:
    """The rounds of tail batching over verl's dataloader (see the module's rule).

    ``fetch()`` returns the next dataloader batch (``batch_rows`` prompts, as columns);
    ``fetches_per_epoch`` of them make an epoch. Owned by the trainer's driver thread: not
    thread-safe. :meth:`state` / :meth:`restore` carry the queue, the fetched prompts not launched
    yet and the epoch's position across a checkpoint.
    """

    def __init__(self, *, prompt_factor: float, response_factor: float, long_round_at: int, p0: int, r0: int,
                 batch_rows: int, fetches_per_epoch: int, fetch: Callable[[], Columns]) -> None:
        if fetches_per_epoch < 1:
            raise ValueError(f"the training set holds no full batch of {batch_rows} prompts: tail batching "
                             "needs at least one per epoch")
        self.p0, self.r0 = p0, r0
        self.short_prompts = math.ceil(prompt_factor * p0 - 1e-9)
        self.short_responses = math.ceil(response_factor * r0 - 1e-9)
        self.long_at = long_round_at or p0
        self.batch_rows, self.fetches_per_epoch, self.fetch = batch_rows, fetches_per_epoch, fetch
        self.queue: Columns = {}  # dropped prompts, oldest first
        self.pool: Columns = {}  # fetched this epoch, not launched yet
        self.fetched = 0  # dataloader batches fetched this epoch
        self.epoch = 0
        self.rounds = 0

    # ------------------------------------------------------------------ plan
    def fresh_left(self) -> int:
        return n_rows(self.pool) + (self.fetches_per_epoch - self.fetched) * self.batch_rows

    def _draw(self, n: int) -> Columns:
        """The next ``n`` fresh prompts of this epoch."""
        while n_rows(self.pool) < n:
            if self.fetched >= self.fetches_per_epoch:
                raise RuntimeError(f"tail batching: the epoch has {n_rows(self.pool)} fresh prompts left, "
                                   f"{n} asked for")
            self.pool = cat(self.pool, self.fetch())
            self.fetched += 1
        rows = n_rows(self.pool)
        out, self.pool = take(self.pool, range(n)), take(self.pool, range(n, rows))
        return out

    def _pop_queue(self, n: int) -> Columns:
        rows = n_rows(self.queue)
        n = min(n, rows)
        out, self.queue = take(self.queue, range(n)), take(self.queue, range(n, rows))
        return out if n else {}

    def next_round(self) -> Round:
        """The next round to launch (a long round once the queue holds ``long_round_at`` prompts,
        else a short one while the epoch has enough fresh prompts, else the flush)."""
        self.rounds += 1
        if n_rows(self.queue) >= self.long_at:
            return Round("long", self._pop_queue(self.p0), self.r0, self.p0, self.r0)
        if self.fresh_left() >= self.short_prompts:
            return Round("short", self._draw(self.short_prompts), self.short_responses, self.p0, self.r0)
        queued = self._pop_queue(self.p0)
        prompts = cat(queued, self._draw(self.p0 - n_rows(queued)))
        return Round("flush", prompts, self.r0, self.p0, self.r0)

    def settle(self, rnd: Round, dropped: Sequence[int] = ()) -> None:
        """The round ended: its prompts at positions ``dropped`` join the queue (a short round's
        prompts not trained); an epoch whose prompts are all trained ends here."""
        if dropped:
            if rnd.kind != "short":
                raise ValueError(f"a {rnd.kind} round trains every prompt it launches; {len(dropped)} dropped")
            self.queue = cat(self.queue, take(rnd.prompts, dropped))
        if self.fetched == self.fetches_per_epoch and not n_rows(self.pool) and not n_rows(self.queue):
            self.fetched, self.epoch = 0, self.epoch + 1

    # ------------------------------------------------------------------ checkpoint
    def state(self) -> dict:
        return {"queue": self.queue, "pool": self.pool, "fetched": self.fetched, "epoch": self.epoch,
                "rounds": self.rounds}

    def restore(self, state: dict) -> None:
        self.queue, self.pool = dict(state["queue"]), dict(state["pool"])
        self.fetched, self.epoch, self.rounds = int(state["fetched"]), int(state["epoch"]), int(state["rounds"])
