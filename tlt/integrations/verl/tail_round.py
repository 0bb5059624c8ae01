"""Tail batching carried out in the trainer's driver: each step's round, its batch, its end, its record.

Owns the driver's side (:class:`RoundDriver`, which the ``tlt`` trainer calls from its hooks: the
round planned in ``prepare_step``, its batch built in ``_next_train_batch``, a short round finished
in ``on_sample_begin`` by :func:`finish_short_round`, the sampled batch checked in
``_balance_batch``) and what a step's record says (:func:`round_record`). The rule and the queue
are :mod:`.tail_batching`'s.

Order (the owner of each step in brackets):
1. every response of the round reports its end to the ``tlt_tail`` TransferQueue partition [the
   ``tlt_agent`` loop, before verl stores the response];
2. once P0 prompts have R0 finished responses each, every replica drops its requests
   (``drop_requests``: running and queued ones return their partial output with stop reason
   :data:`~tlt.integrations.verl.tail_batching.DROPPED`, which verl's client does not resubmit,
   and later arrivals return at once, dropped) [this driver];
3. the driver waits until every prompt of the round has its terminal status, which verl's agent
   loop publishes only after all of the prompt's responses are stored [verl's agent loop];
4. the choice is made again from the reports, now complete (the first P0 by the agent loops'
   clocks); the rows not trained are cleared from TransferQueue (the dropped prompts' groups, the
   trained prompts' extra responses, the reports), the trained groups are marked finished (a
   sibling that failed while dropped does not fail its group), and the replicas accept requests
   again (``resume_generation``) [this driver].
verl's replay buffer then finds exactly the P0 trained groups; the trainer checks that the batch
it samples is exactly the kept rows.
"""

from __future__ import annotations

import collections
import logging
import statistics
import time
import uuid
from collections.abc import Callable, Sequence

import numpy as np
import ray

from tlt.integrations.verl.config import BatchingSection
from tlt.integrations.verl.tail_batching import (
    MARKERS,
    SHORT_ROUND_KEY,
    Choice,
    Columns,
    Done,
    Round,
    TailBatcher,
    choose,
    n_rows,
)

log = logging.getLogger(__name__)


def _list(partition: str) -> dict[str, dict]:
    import transfer_queue as tq

    try:
        data = tq.kv_list(partition_id=partition)
    except (KeyError, ValueError):  # no such partition yet
        return {}
    return (data or {}).get(partition, {}) or {}


def read_done(uids: set[str]) -> list[Done]:
    """The round's reported response ends (key ``{uid}_{sample}``)."""
    out = []
    for key, tag in _list(MARKERS).items():
        uid, _, sample = key.rpartition("_")
        # TransferQueue creates a key, then sets its tag (two calls): a key without one is on its way
        if uid in uids and "t" in tag:
            out.append(Done(uid, int(sample), bool(tag.get("dropped")), float(tag["t"]), int(tag.get("length", 0))))
    return out


def _terminal(uids: set[str]) -> bool:
    tags = _list("train")
    return all(tags.get(u, {}).get("status") in ("finished", "failure") for u in uids)


def finish_short_round(rnd: Round, uids: Sequence[str], servers: Callable[[], list], *, poll_s: float,
                       timeout_s: float = 24 * 3600.0, before_drop: Callable[[], None] | None = None
                       ) -> tuple[Choice, list[Done], dict]:
    """Carry out steps 2-4 of the module's order for the short round ``rnd`` (``uids``: its
    prompts' uids in launch order). Returns the choice, the reports and the timings."""
    import transfer_queue as tq

    t0 = time.monotonic()
    want = set(uids)
    while True:
        choice = choose(uids, read_done(want), rnd.keep_prompts, rnd.keep_responses)
        if choice is not None:
            break
        if _terminal(want):  # everything ended and still too few finished: failed requests
            choice = choose(uids, read_done(want), rnd.keep_prompts, rnd.keep_responses)
            if choice is None:
                raise RuntimeError(f"tail batching: the short round's {len(uids)} prompts all ended, fewer than "
                                   f"{rnd.keep_prompts} with {rnd.keep_responses} finished responses (failed "
                                   "requests: see the agent loop's log)")
            break
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"tail batching: no {rnd.keep_prompts} prompts finished within {timeout_s:.0f}s")
        time.sleep(poll_s)
    t_keep = time.monotonic()
    if before_drop is not None:
        before_drop()
    handles = servers()
    try:  # (a replica whose drop failed leaves the others dropping every request: all resume)
        dropped = sum(ray.get([s.drop_requests.remote() for s in handles], timeout=300))
        while not _terminal(want):
            if time.monotonic() - t_keep > timeout_s:
                raise RuntimeError(f"tail batching: the dropped round's prompts did not all end within "
                                   f"{timeout_s:.0f}s (an agent loop worker lost?)")
            time.sleep(poll_s)
        t_settled = time.monotonic()
        done = read_done(want)
        choice = choose(uids, done, rnd.keep_prompts, rnd.keep_responses)
        if choice is None:  # cannot be: the reports only grew
            raise RuntimeError("tail batching: the reports lost finished responses")
        rows = [k for k in _list("train") if k.split("_", 1)[0] in want and k not in want]
        clear = list(choice.dropped_uids)
        for k in rows:
            uid, sample, _ = k.rsplit("_", 2)
            if uid not in choice.kept or int(sample) not in choice.kept[uid]:
                clear.append(k)
        if clear:
            tq.kv_clear(keys=clear, partition_id="train")
        markers = [f"{d.uid}_{d.sample}" for d in done]
        if markers:
            tq.kv_clear(keys=markers, partition_id=MARKERS)
        kept = list(choice.kept)
        tq.kv_batch_put(keys=kept, partition_id="train", tags=[{"status": "finished"} for _ in kept])
    finally:
        ray.get([s.resume_generation.remote() for s in handles], timeout=300)
    timings = {"keep_s": t_keep - t0, "drop_s": t_settled - t_keep, "dropped_in_flight": int(dropped)}
    return choice, done, timings


def kept_keys(choice: Choice) -> set[str]:
    """verl's trajectory keys (``{uid}_{sample}_0``) of the responses a short round trains."""
    return {f"{u}_{s}_0" for u, samples in choice.kept.items() for s in samples}


def round_record(rnd: Round, *, queued_after: int, epoch: int, uids: Sequence[str] = (),
                 choice: Choice | None = None, done: Sequence[Done] = (), timings: dict | None = None) -> dict:
    """The step record's ``tail_batching`` field: the round, what it launched (dataset indices),
    kept and dropped ((index, sample) pairs), and the lengths (kept responses; finished responses
    not kept; dropped ones' partial lengths). ``uids``: the round's, in launch order."""
    index = [int(i) for i in rnd.prompts["index"]] if "index" in rnd.prompts else []
    rec = {"round": rnd.kind, "launched_prompts": n_rows(rnd.prompts), "responses_per_prompt": rnd.n,
           "trained_prompts": rnd.keep_prompts, "queued_after": queued_after, "epoch": epoch,
           "launched_indices": index, **(timings or {})}
    if choice is None:
        return rec
    at = dict(zip(uids, index))  # uid -> dataset index
    kept = {(u, s) for u, samples in choice.kept.items() for s in samples}
    rec["kept_responses"] = sorted([at.get(u, -1), s] for u, s in kept)
    rec["dropped_responses"] = sorted([at.get(d.uid, -1), d.sample] for d in done if d.dropped)
    kept_len = [d.length for d in done if (d.uid, d.sample) in kept]
    unkept = [d.length for d in done if not d.dropped and (d.uid, d.sample) not in kept]
    partial = [d.length for d in done if d.dropped]
    tokens = sum(d.length for d in done)
    rec.update(dropped_prompts=len(choice.dropped_uids), kept_lengths=kept_len, finished_not_kept_lengths=unkept,
               dropped_partial_lengths=partial, tokens=tokens, dropped_tokens=sum(partial),
               dropped_share=sum(partial) / tokens if tokens else 0.0,
               thrown_away_tokens=sum(unkept) + sum(partial),
               thrown_away_share=(sum(unkept) + sum(partial)) / tokens if tokens else 0.0,
               kept_median=statistics.median(kept_len) if kept_len else None)
    return rec


class RoundDriver:
    """The ``tlt`` trainer's tail batching, one round per RL step (driver thread only).

    ``fetch()``: the next dataloader batch as columns; ``servers()``: the replicas' actors.
    """

    def __init__(self, cfg: BatchingSection, *, p0: int, r0: int, fetches_per_epoch: int,
                 fetch: Callable[[], Columns], servers: Callable[[], list], poll_s: float) -> None:
        self.batcher = TailBatcher(prompt_factor=cfg.prompt_factor, response_factor=cfg.response_factor,
                                   long_round_at=cfg.long_round_at, p0=p0, r0=r0, batch_rows=p0,
                                   fetches_per_epoch=fetches_per_epoch, fetch=fetch)
        self.servers, self.poll_s = servers, poll_s
        self.round: Round | None = None
        self.uids: list[str] = []
        self.kept: set[str] | None = None  # the trajectory keys the step trains (short rounds)
        self.record: dict = {}

    def plan(self) -> Round:
        """``prepare_step``: the step's round (the batch is built from it next)."""
        self.round = self.batcher.next_round()
        self.kept, self.record, self.uids = None, {}, []
        return self.round

    def batch(self, step: int):
        """``_next_train_batch``: the round's prompts as verl's batch (fresh uids, the responses to
        launch per prompt, the short-round marker the tlt_agent loop reports under)."""
        from verl.utils import tensordict_utils as tu

        if self.round is None or self.uids:
            raise RuntimeError("tail batching: a second batch was asked for in one step (verl refills failed "
                               "groups with trainer.v1.sampler.sync_refill_failed_groups; turn it off)")
        cols = dict(self.round.prompts)
        self.uids = [str(uuid.uuid4()) for _ in range(n_rows(cols))]
        cols["uid"] = np.array(self.uids, dtype=object)
        batch = tu.get_tensordict(cols)
        tu.assign_non_tensor_data(batch, "global_steps", step)
        tu.assign_non_tensor_data(batch, "__rollout_n__", self.round.n)  # verl's per-batch override of rollout.n
        if self.round.kind == "short":
            tu.assign_non_tensor_data(batch, SHORT_ROUND_KEY, True)
        return batch

    def before_sample(self, before_drop: Callable[[], None] | None = None) -> None:
        """``on_sample_begin``: a short round ends here (the module's order); any round settles."""
        rnd = self.round
        if rnd is None:
            return
        epoch = self.batcher.epoch  # the round's (settling may end it)
        if rnd.kind != "short":
            self.batcher.settle(rnd)
            self.record = round_record(rnd, queued_after=n_rows(self.batcher.queue), epoch=epoch)
            return
        choice, done, timings = finish_short_round(rnd, self.uids, self.servers, poll_s=self.poll_s,
                                                   before_drop=before_drop)
        dropped = set(choice.dropped_uids)
        self.batcher.settle(rnd, [i for i, u in enumerate(self.uids) if u in dropped])
        self.kept = kept_keys(choice)
        self.record = round_record(rnd, queued_after=n_rows(self.batcher.queue), epoch=epoch, uids=self.uids,
                                   choice=choice, done=done, timings=timings)
        log.info("tail batching: short round kept %d of %d prompts after %.1fs; %d queued", len(choice.kept),
                 len(self.uids), timings["keep_s"], n_rows(self.batcher.queue))

    def check(self, keys: Sequence[str]) -> None:
        """``_balance_batch``: the sampled batch is the round's trained responses, R0 per prompt."""
        rnd = self.round
        if rnd is None:
            return
        got = set(keys)
        if self.kept is not None and got != self.kept:
            raise RuntimeError(f"tail batching: the sampled batch ({len(got)} responses) is not the short round's "
                               f"{len(self.kept)} kept ones ({len(got - self.kept)} not kept, "
                               f"{len(self.kept - got)} missing)")
        per_uid = collections.Counter(k.rsplit("_", 2)[0] for k in got)  # verl's keys: {uid}_{sample}_{output}
        if len(per_uid) != rnd.keep_prompts or set(per_uid.values()) != {rnd.keep_responses}:
            raise RuntimeError(f"tail batching: {rnd.kind} round trains {len(per_uid)} prompts with "
                               f"{sorted(set(per_uid.values()))} responses; {rnd.keep_prompts} x "
                               f"{rnd.keep_responses} expected")
        self.round = None

    def state(self) -> dict:
        return self.batcher.state()

    def restore(self, state: dict) -> None:
        self.batcher.restore(state)

    def resume(self, state: dict | None, step: int) -> None:
        """A resumed run at ``step``: its checkpointed state; without one (a checkpoint saved without
        tail batching, whose steps each fetched one batch), the epoch's position, with a warning."""
        if state is not None:
            self.restore(state)
        elif step > 1:
            self.batcher.fetched = (step - 1) % self.batcher.fetches_per_epoch
            log.warning("tlt: the checkpoint holds no tail batching state (saved without it): tail batching "
                        "starts at the epoch's batch %d", self.batcher.fetched)
