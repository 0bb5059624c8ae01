"""The reference rollout engine: batched generation with elastic, tuned speculative decoding.

Owns the step loop over the running requests and their lifecycle; the queue, admission and
eviction order are its :class:`~tlt.rollout.scheduler.Scheduler`'s. Requests join between steps
(:meth:`RolloutEngine.add`: prefilled in chunks by :mod:`~tlt.rollout.prefill`, right-padded, into
the free KV rows after the running ones, possibly with tokens they made elsewhere), each step runs
one target pass over ``[last committed token] + draft tree`` per running request on the static KV
cache, verifies losslessly and compacts the accepted nodes' keys/values into place, and requests
leave between steps: finished (a stop token or their budget), aborted, or moved elsewhere with their state
(:class:`~tlt.rollout.request.RequestState`), by swap-remove of cache rows (survivors from the end
fill the holes). ``generate`` is add + step until done. Plain decoding is the same step with an
empty tree. Single-threaded: one thread owns an engine (the verl backend's batcher thread while a
generation runs). Speculation is elastic: the BEG-MAB tuner picks
the strategy per step, its "off" arm included at every batch size (so where speculation stops
paying is learned), optionally capped by ``elastic_threshold``; or a fixed arm. Nothing is handed
to the proposer while speculation is off: the engine keeps each request's tokens and writes the
target features into a buffer laid out like the KV cache
(:class:`~tlt.rollout.feature_store.FeatureStore`), and a proposer reads what it missed from there
(:class:`~tlt.rollout.draft_tree.ProposerInput`) when it is next asked.

Proposers are arms: the engine holds named proposers (``""``: the main one, e.g. EAGLE; e.g.
``"suffix"``: the model-free drafter) and the arm chosen for a step names the one that drafts.
Every arm the engine may run (the fixed one, or every arm of the tuner's buckets) is checked at
construction against ``max_draft_tokens`` and the proposers it names.

Host <-> device traffic: the running requests' state lives on the device
(:class:`~tlt.rollout.row_state.RowState`) and each step updates it there from the verifier's device
result; a step reads one packed result (committed tokens, their log-probs, counts) and makes at
most one upload (:class:`~tlt.rollout.step_upload.StepUpload`): with a paged cache, the table rows
of requests that took new blocks (about one step in ``block_size``), packed with the draft trees of a
host-side proposer (the model-free drafter's) or a drafter's row moves after requests left. Prefill
and the engine's own row compaction for leaving requests upload their indices; they are no step's
cost (:mod:`tlt.bench.transfer_count` counts all of it).

Sampling is coupled (:mod:`tlt.rollout.sampling`): a request's token at a position is a function of its
seed, the position and the target's logits, so speculative and plain decoding sample the same
tokens, and a request that leaves after ``k`` tokens and joins again (here or in another engine,
same seed) goes on with the tokens it would have drawn. A :class:`FeatureSink` receives every
leaving request's tokens and the target features this engine computed for them (last hidden state,
and EAGLE-3 layers), whatever proposer is active: the drafter's training data from the policy that
is rolling out. A request that joined with tokens another engine's sink already received is handed
over with those as context only (:attr:`RequestState.handed_over`): trained on once.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from collections.abc import Hashable
from typing import Protocol, Sequence

import torch

from tlt.drafter.seeds import derive
from tlt.rollout.draft_tree import DraftTree, Proposer, ProposerInput, right_pad
from tlt.rollout.engine_config import EngineConfig
from tlt.rollout.generate import SamplingParams
from tlt.rollout.graph_pool import destroy_dropped_graphs
from tlt.rollout.graphs import DEFAULT_CAPTURE_BATCH_SIZES, CaptureSizes
from tlt.rollout.attention import AttnMeta, default_splits, physical
from tlt.rollout.blocks import BlockPool
from tlt.rollout.feature_store import FeatureStore
from tlt.rollout.kv_cache import StaticKVCache, swap_remove, tree_ancestors
from tlt.rollout.pool_size import block_bytes, pool_blocks
from tlt.rollout.prefill import prefill_last_hidden
from tlt.rollout.request import Finished, RequestState
from tlt.rollout.row_state import RowState
from tlt.rollout.sampling import RowSampling, sample
from tlt.rollout.scheduler import Scheduler
from tlt.rollout.static_step import StaticTargetStep
from tlt.rollout.step_log import StepLog
from tlt.rollout.strategy import Arm
from tlt.rollout.target import TargetModel
from tlt.rollout.timing import Span
from tlt.rollout.step_upload import StepUpload
from tlt.rollout.transfers import intended_sync
from tlt.rollout.verify import stop_table, verify

log = logging.getLogger(__name__)


class Tuner(Protocol):
    """Picks each step's arm by batch size and learns from the step it ran (``tlt.rollout.tuner``)."""

    def all_arms(self) -> tuple[Arm, ...]:
        """Every arm it may choose (the engine checks each fits its cache and names a proposer)."""

    def choose(self, batch_size: int) -> Arm: ...

    def record(self, batch_size: int, arm: Arm, accepted_tokens: int, step_time_s: float) -> None: ...


class FeatureSink(Protocol):
    """Receives each leaving request (finished, aborted or moved) with the target features its
    rollout computed here."""

    aux_layers: tuple[int, ...]  # target layers whose inputs are captured beside the last hidden state

    def add(self, tokens: list[int], prompt_len: int, hidden: torch.Tensor, aux: torch.Tensor | None) -> None:
        """tokens: prompt + response, all T of them (the last is a label too: the target's
        prediction at T - 2 of the final token, usually the stop token); prompt_len: the first
        position whose token is a label (the prompt, and response tokens another sink already
        received, before it); hidden: [T - 1, H] post-norm last hidden state at every position but
        the last (whose token no forward was fed); aux: [T - 1, A*H] or None."""


@dataclasses.dataclass
class StepRecord:
    batch: int
    arm: str
    sd: bool
    accepted: int  # accepted draft tokens, summed over the batch
    committed: int  # tokens committed, summed over the batch
    seconds: float
    drafted: int = 0  # draft tokens proposed (valid tree nodes), summed over the batch
    draft_seconds: float = 0.0  # of ``seconds``: the proposer's share (catch-up + drafting)
    # Of ``seconds``: graph captures (the verify step's and the proposer's first uses of a shape),
    # the proposer's catch-up, and the host's own time (all but the wait in the step's one read for
    # the device: on a GPU, host_seconds near seconds means a host-bound step).
    capture_seconds: float = 0.0
    catch_up_seconds: float = 0.0
    host_seconds: float = 0.0
    # a paged cache: requests evicted before this step, and tokens re-prefilled at its admission
    # (evicted requests coming back)
    evicted: int = 0
    recomputed: int = 0
    # memory: KV positions the running rows hold at the step (their tokens so far), and with a paged
    # cache the blocks in use (the step's draft included)
    positions: int = 0
    blocks: int = 0


@dataclasses.dataclass
class RolloutResult:
    outputs: list[list[int]]  # response token ids per request, in input order
    steps: list[StepRecord]
    accept_lengths: list[int]  # committed tokens per request per speculative step
    seconds: float
    # log p(token) per response token under the target's logits / temperature (1 when greedy),
    # the quantity RL trainers recompute as old log-probs
    logprobs: list[list[float]] = dataclasses.field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


@dataclasses.dataclass
class _Live:
    """A request of the engine's current generation (host side)."""

    state: RequestState  # as it joined
    seq: list[int]  # prompt + tokens so far (the last one pending while it runs)
    logprobs: list[float]  # one per output token
    handed_over: int  # output tokens a sink received as labels

    def state_now(self) -> RequestState:
        plen = len(self.state.prompt)
        return dataclasses.replace(self.state, output=tuple(self.seq[plen:]), logprobs=tuple(self.logprobs),
                                   handed_over=self.handed_over)


def _features_of(hidden: bool, layers: tuple[int, ...], out) -> torch.Tensor | None:
    """What the engine keeps per position: [B, T, F] = the post-norm last hidden state (``hidden``:
    the sink or an EAGLE proposer reads it), then the inputs of ``layers``; None: nothing."""
    parts = ([out.hidden] if hidden else []) + [out.aux[i] for i in layers]
    return torch.cat(parts, -1) if parts else None


def reach(arm: Arm) -> int:
    """Positions past a request's tokens that a step of ``arm`` writes: the verified tree's nodes, and
    an EAGLE drafter's levels (``topk`` candidates each after the first, from the last pair on)."""
    return 0 if arm.is_off else max(arm.tokens_to_verify, (arm.depth - 1) * arm.topk)


class RolloutEngine:
    def __init__(self, target: TargetModel, cfg: EngineConfig = EngineConfig(), *,
                 proposer: Proposer | None = None, tuner: Tuner | None = None,
                 sink: FeatureSink | None = None, proposers: dict[str, Proposer] | None = None) -> None:
        """``proposer``: the main proposer (arms with ``proposer=""``); ``proposers``: more, by name."""
        named = {**({"": proposer} if proposer is not None else {}), **(proposers or {})}
        self.target, self.cfg, self.sink = target, cfg, sink
        self.proposers: dict[str, Proposer] = {}
        self.tuner: Tuner | None = None
        self._aux_layers: tuple[int, ...] = ()
        self._last_proposer: str | None = None  # the proposer that drafted the previous step (None: off)
        self.static_step: StaticTargetStep | None = None  # (built below, once the cache is)
        self._sized_block_bytes: int | None = None  # a pool sized by memory: the block bytes it was sized for
        self.set_proposers(named, tuner)
        mc = target.config
        self.device = target.embed_weight.device
        if self.device.type == "cuda":  # what dropped engines' graphs hold goes back before this one sizes its cache
            destroy_dropped_graphs()
        # rows layout: cache row r = running row r, of cfg.slots slots; paged: blocks of a BlockPool,
        # the last one scratch, each row's table in RowState.blocks [B, table_width]
        self.pool: BlockPool | None = None
        if cfg.block_size is not None:
            sized = self._block_bytes_sized()
            self.pool = BlockPool(pool_blocks(cfg, self.device, sized) + 1, cfg.block_size)
            if cfg.kv_bytes is not None or cfg.kv_fraction is not None:
                self._sized_block_bytes = sized
        self.table_width = -(-cfg.slots // cfg.block_size) if self.pool else 1
        self.cache = StaticKVCache(mc.num_hidden_layers, self.pool.capacity + 1 if self.pool else cfg.max_batch,
                                   mc.num_key_value_heads, cfg.block_size or cfg.slots, mc.head_dim,
                                   dtype=target.embed_weight.dtype, device=self.device)
        self.features = FeatureStore((self.cache.k.shape[1], self.cache.max_len), self.device)  # (rows | blocks, slots)
        self._generation = 0  # bumped when requests arrive at an idle engine (proposers start over)
        self.sched = Scheduler(cfg.max_batch, self.pool, cfg.eviction)  # the queue and admission
        self._rows: list[int] = []  # request id per running cache row
        self._state: RowState | None = None  # the running rows' device state
        # this generation's requests (running, and finished ones: the proposers' siblings), by id
        self._reqs: dict[int, _Live] = {}
        self._seqs: dict[int, list[int]] = {}  # prompt + committed tokens (the last one's KV is pending)
        self._plens: dict[int, int] = {}
        self._groups: dict[int, Hashable] = {}
        self.step_log = StepLog()  # step telemetry, by absolute step number, until its reader forgets it
        # hand-overs to the sink, by why the request left (finished, aborted, left, evicted: an evicted
        # request hands over again, its later positions, when it leaves for good)
        self.fed: collections.Counter[str] = collections.Counter()
        static = cfg.static_shapes if cfg.static_shapes is not None else self.device.type == "cuda"
        self.static_step: StaticTargetStep | None = self._new_static_step() if static else None

    def block_bytes(self) -> int:
        """Bytes a block of the paged pools takes (:func:`~tlt.rollout.pool_size.block_bytes`): the
        target's keys and values over every layer, the feature buffer's row (the last hidden state and
        the captured layers), and what the proposers keep per position in the engine's blocks (an EAGLE
        drafter's keys and values)."""
        mc = self.target.config
        feats = (mc.hidden_size if self._stores_hidden else 0) + mc.hidden_size * len(self._aux_layers)
        return block_bytes(mc, self.target.embed_weight.element_size(), self.cfg.block_size or self.cfg.slots, feats,
                           sum(p.kv_position_bytes for p in self.proposers.values()))

    def _block_bytes_sized(self) -> int:
        """The block bytes a pool sized by memory divides it by: :meth:`block_bytes` and the room
        ``draft_position_bytes`` keeps for proposers set later."""
        return self.block_bytes() + self.cfg.block_size * self.cfg.draft_position_bytes

    def _new_static_step(self) -> StaticTargetStep:
        sizes = tuple(c for c in DEFAULT_CAPTURE_BATCH_SIZES if c < self.cfg.max_batch) + (self.cfg.max_batch,)
        # the features as of now (set_proposers builds a new step when they change), not a method:
        # the step would hold the engine, and a dropped engine would keep its cache until a collection
        features = functools.partial(_features_of, self._stores_hidden, self._capture)
        return StaticTargetStep(self.target, self.cache, CaptureSizes(sizes),
                                self._capture, features, cuda_graphs=self.cfg.cuda_graphs,
                                attention=self.cfg.attention, capture_after=self.cfg.capture_after,
                                paged=(self.cfg.block_size, self.table_width, self.pool.scratch) if self.pool else None)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 groups: Sequence[Hashable] | None = None, seeds: Sequence[int] | None = None) -> RolloutResult:
        """Responses for ``prompts`` (GRPO ``groups``: requests sharing a prompt group id; ``seeds``:
        one sampling seed per request, default ``derive(cfg.seed, index)`` of :mod:`tlt.drafter.seeds`): :meth:`add` them
        to an idle engine and :meth:`step` until they all finished (more than ``max_batch`` requests:
        the rest join as rows free up)."""
        n = len(prompts)
        if n == 0:
            raise ValueError("generate needs at least one prompt")
        plist = list(params) if isinstance(params, Sequence) else [params] * n
        groups = list(groups) if groups is not None else list(range(n))
        if len(plist) != n or len(groups) != n:
            raise ValueError("params and groups must have one entry per prompt")
        if seeds is not None and len(seeds) != n:
            raise ValueError("seeds must have one entry per prompt")
        if self.active:
            raise RuntimeError(f"generate needs an idle engine: {self.running} requests run, {len(self.sched.queue)} "
                               "wait (step them, or abort them)")
        seeds = list(seeds) if seeds is not None else [derive(self.cfg.seed, i) for i in range(n)]
        t_start = time.perf_counter()
        rids = self.add([RequestState(tuple(p), sp, sd, g) for p, sp, sd, g in zip(prompts, plist, seeds, groups)])
        first = self.steps_run
        done: dict[int, Finished] = {}
        while len(done) < n:
            done.update((f.rid, f) for f in self.step())
        outs = [done[r].state for r in rids]
        res = RolloutResult([list(o.output) for o in outs], self.steps_since(first), self.accept_lengths_since(first),
                            time.perf_counter() - t_start, [list(o.logprobs) for o in outs])
        self.forget_steps(self.steps_run)
        return res

    # ------------------------------------------------------------------ request lifecycle
    def add(self, requests: Sequence[RequestState]) -> list[int]:
        """Queue requests; the next :meth:`step` prefills them into free KV rows (the running ones
        wait for that prefill, then decode with them), and later ones as rows free up. A request with
        tokens so far goes on from them (prefilled over prompt + tokens, same seed: token-identical
        to never having stopped). Returns their ids, in order. All are checked before any is queued."""
        for i, st in enumerate(requests):
            self.check(st, f"request {i}")
        if requests:
            self.restore_memory()
        return self.sched.add(requests)

    def check(self, st: RequestState, name: str = "the request") -> None:
        """ValueError if this engine cannot run ``st`` (what :meth:`add` checks)."""
        if not isinstance(st, RequestState):
            raise TypeError(f"{name}: a RequestState, got {type(st).__name__}")
        if st.done:
            raise ValueError(f"{name} already ended ({len(st.output)} of max_new_tokens="
                             f"{st.params.max_new_tokens} tokens, last {st.output[-1:]}): nothing to generate")
        vocab, ids = self.target.config.vocab_size, st.prompt + st.output
        if min(ids) < 0 or max(ids) >= vocab:  # (an embedding lookup fails on them)
            bad = [t for t in ids if not 0 <= t < vocab][:5]
            raise ValueError(f"{name}: token ids {bad} are outside the target's vocabulary 0..{vocab - 1}")
        if len(st.prompt) + st.params.max_new_tokens + 1 > self.cfg.max_len:
            raise ValueError(f"{name}: {len(st.prompt)} prompt tokens + max_new_tokens "
                             f"{st.params.max_new_tokens} exceed EngineConfig.max_len={self.cfg.max_len}")
        if self.pool is not None:
            draft = self.cfg.max_draft_tokens  # (>= every arm's reach: _check_arms)
            need = self.pool.blocks_for(len(st.prompt) + st.params.max_new_tokens + 1 + draft)
            if need > self.pool.capacity:
                raise ValueError(f"{name}: {len(st.prompt)} prompt tokens + max_new_tokens {st.params.max_new_tokens} "
                                 f"+ a draft of {draft} need {need} blocks of {self.pool.block_size} "
                                 f"positions; the pool holds {self.pool.capacity} (raise EngineConfig."
                                 f"{self._pool_key()}, or lower max_draft_tokens)")

    def _pool_key(self) -> str:
        """The EngineConfig key that sized the paged pool (one of them does: __post_init__)."""
        if self.cfg.kv_fraction is not None:
            return "kv_fraction (in verl: actor_rollout_ref.rollout.gpu_memory_utilization)"
        return "kv_bytes" if self.cfg.kv_bytes is not None else "kv_blocks"

    @property
    def running(self) -> int:
        """Requests decoding now (one KV row each)."""
        return len(self._rows)

    def progress(self) -> dict[int, int]:
        """Response tokens so far of each running request, by id (between steps)."""
        return {rid: len(self._reqs[rid].seq) - len(self._reqs[rid].state.prompt) for rid in self._rows}

    @property
    def active(self) -> bool:
        """Requests run or wait for a row."""
        return bool(self._rows or self.sched.queue)

    @property
    def lifecycle(self) -> collections.Counter[str]:
        """Requests that joined a running batch, left, were aborted or evicted, so far."""
        return self.sched.lifecycle

    @torch.no_grad()
    def step(self) -> list[Finished]:
        """Admit waiting requests into free rows (one prefill), run one step over the running ones,
        and return the requests that finished (a stop token, or their budget)."""
        out: list[Finished] = []
        self._admit(out)
        if self._rows:
            b = len(self._rows)
            arm = chosen = self._choose(b)
            upload = StepUpload(self.device)  # the step's one upload (flushed in _step)
            if self.pool is not None:
                arm = self._make_room(arm, upload)
            inp = ProposerInput(self._generation, tuple(self._rows), self._seqs, self._plens, self._groups, None,
                                Arm.off(), self._state.sampling, self._state, upload)
            # the tuner learns from the steps it chose: not a draft the pool could not hold, nor a
            # batch that evictions shrank (maybe into another bucket)
            tokens, lps, rec, acc = self._step(inp, arm, tuned=arm == chosen and len(self._rows) == b)
            rec.evicted, rec.recomputed = self.sched.step_counts()
            rec.positions = sum(len(self._seqs[r]) for r in inp.rows) - len(inp.rows)  # (pending tokens: no KV yet)
            rec.blocks = self.pool.used if self.pool is not None else 0
            self.step_log.append(rec, acc)
            self._commit(tokens, lps, range(len(self._rows)), out)
        return out

    def leave(self, rids: Sequence[int]) -> list[Finished]:
        """Running or waiting requests leave between steps, each with its state (reason ``left``):
        :meth:`add` it here or to another engine and it goes on token for token."""
        return self._remove(rids, "left")

    def abort(self, rids: Sequence[int] | None = None) -> list[Finished]:
        """Abort requests (None: every one, running or waiting) between steps: their KV rows are
        freed and each returns its partial output (reason ``aborted``)."""
        if rids is None:
            rids = list(self._rows) + [r for r, _ in self.sched.queue]
        return self._remove(rids, "aborted")

    def _remove(self, rids: Sequence[int], reason: str) -> list[Finished]:
        rids = list(rids)
        out = self.sched.remove(rids, self._rows, reason)
        row = {r: k for k, r in enumerate(self._rows)}
        self._retire({row[r]: reason for r in rids if r in row}, out)
        return out

    @property
    def steps_run(self) -> int:
        """Steps this engine ran (the absolute number of the next step)."""
        return self.step_log.steps_run

    @property
    def steps(self) -> list[StepRecord]:
        """The kept step records (see :meth:`forget_steps`), oldest first."""
        return self.step_log.kept

    def steps_since(self, first: int) -> list[StepRecord]:
        """The records of steps ``first`` (an absolute step number, :attr:`steps_run`) onward."""
        return self.step_log.since(first)

    def accept_lengths_since(self, first: int) -> list[int]:
        """Committed tokens per request per speculative step, over the steps from ``first`` on."""
        return self.step_log.accept_lengths_since(first)

    def forget_steps(self, before: int) -> None:
        """Drop the records of steps before ``before`` (their reader is done with them)."""
        self.step_log.forget(before)

    # ------------------------------------------------------------------ internals: rows
    def _admit(self, out: list[Finished]) -> None:
        """Prefill the requests the scheduler admits into the free rows after the running ones."""
        n = self.sched.admissible(len(self._rows))
        if not n:
            return
        if not self._rows and not self.sched.holds_evicted:  # an idle engine: a new generation (proposers start over)
            self._generation += 1
            self._last_proposer = None
            self._reqs.clear()
            self._seqs.clear()
            self._plens.clear()
            self._groups.clear()
        b0 = len(self._rows)
        before = self.sched.snapshot()
        batch = self.sched.take(n, b0)
        for rid, st in batch:
            self._reqs[rid] = _Live(st, list(st.prompt) + list(st.output), list(st.logprobs), st.handed_over)
            self._seqs[rid], self._plens[rid] = self._reqs[rid].seq, len(st.prompt)
            self._groups[rid] = st.group if st.group is not None else ("request", self._generation, rid)
        try:
            with intended_sync(self.device):  # prefill: uploads the requests, reads the first tokens
                tables = None
                if self.pool is not None:  # blocks for each prompt and the pending token's slot
                    for rid, st in batch:
                        self.pool.grow(rid, len(st.prompt) + len(st.output) + 1)
                    tables = torch.tensor(self.pool.table([rid for rid, _ in batch], self.table_width),
                                          dtype=torch.int32, device=self.device)
                first, first_lp, state = self._prefill([self._reqs[rid] for rid, _ in batch], b0, tables)
        except BaseException:  # (e.g. out of memory) the batch waits again as it was: nothing lost, no block held
            if self.pool is not None:
                for rid, _ in batch:
                    self.pool.release(rid)
            self.sched.restore(before)
            raise
        self._state = state if self._state is None or not self._rows else self._state.cat(state)
        self._rows += [rid for rid, _ in batch]
        fresh = [(k, [tok], [lp]) for k, (tok, lp, (_, st)) in enumerate(zip(first, first_lp, batch)) if not st.output]
        self._commit([t for _, t, _ in fresh], [x for _, _, x in fresh], [b0 + k for k, _, _ in fresh], out)

    def _make_room(self, arm: Arm, upload: StepUpload) -> Arm:
        """Blocks for every running row to hold the next step's tokens (its pending token and the
        arm's draft). Short of them: the step speculates not at all; still short: requests are evicted
        by the configured rule (never the last one) and go back to the queue with their state. The
        grown rows' tables go into the step's ``upload``. Returns the arm the step runs."""
        def need(a: Arm) -> dict[int, int]:
            return {rid: len(self._seqs[rid]) + reach(a) for rid in self._rows}

        if not arm.is_off and self.pool.shortfall(need(arm)):
            arm = Arm.off()  # first shrink the draft
        short = self.pool.shortfall(need(arm))
        if short:
            self._evict(self.sched.victims(self._rows, {rid: len(self._seqs[rid]) for rid in self._rows}, short))
        grown = [k for k, (rid, n) in enumerate(need(arm).items()) if self.pool.grow(rid, n)]
        if grown:  # [N, 1 + C]: each grown row's index, then its table
            table = self.pool.table([self._rows[k] for k in grown], self.table_width)
            upload.add([x for k, row in zip(grown, table) for x in (k, *row)], (len(grown), 1 + self.table_width),
                       lambda t: self._state.set_blocks(t[:, 0], t[:, 1:].to(torch.int32)))
        return arm

    def _evict(self, rids: list[int]) -> None:
        """Running requests leave the cache (features to the sink, blocks freed) and wait at the queue's
        front with their state and ids; :meth:`_admit` prefills them again."""
        row = {r: k for k, r in enumerate(self._rows)}
        left: list[Finished] = []
        self._retire({row[r]: "evicted" for r in rids}, left)
        self.sched.evicted(left)
        for p in self.proposers.values():  # what they kept of these requests (a drafter's KV) went with the blocks
            p.forget(rids)

    def _commit(self, tokens: list[list[int]], lps: list[list[float]], rows: Sequence[int],
                out: list[Finished]) -> None:
        """Append committed tokens to the requests in ``rows`` (row indices); retire finished ones."""
        gone: dict[int, str] = {}
        for k, toks, lp in zip(rows, tokens, lps):
            req = self._reqs[self._rows[k]]
            p = req.state.params
            for tok, x in zip(toks, lp):
                req.seq.append(tok)
                req.logprobs.append(x)
                if tok in p.stop_ids:
                    gone[k] = "stop"
                    break
                if len(req.seq) - len(req.state.prompt) >= p.max_new_tokens:
                    gone[k] = "length"
                    break
        self._retire(gone, out)

    def _retire(self, gone: dict[int, str], out: list[Finished]) -> None:
        """Rows ``gone`` (row index -> reason) leave: features to the sink, rows compacted."""
        if not gone:
            return
        keep = swap_remove(len(self._rows), set(gone))
        with intended_sync(self.device):  # leaving requests: index uploads for the state, cache, features
            for k in sorted(gone):
                rid = self._rows[k]
                req = self._reqs[rid]
                if self.sink is not None:
                    self._hand_over(k, req)
                    self.fed[gone[k]] += 1
                out.append(Finished(rid, req.state_now(), gone[k]))
            if len(keep):
                if self.pool is None:  # the rows layout: rows move (a paged row's table moves with its state)
                    self.cache.compact_rows(keep)
                    self.features.compact(keep)
                self._state = self._state.select(torch.tensor(keep, device=self.device))
        for k in gone:
            if self.pool is not None:
                self.pool.release(self._rows[k])
            self.sched.left_row(self._rows[k])
        self._rows = [self._rows[k] for k in keep]

    def close(self) -> None:
        """Give the captured graphs (the verify step's, the proposers') and the proposers' device
        memory (an EAGLE drafter's KV) back now, not at a collection that might run during another
        engine's capture."""
        if self.static_step is not None:
            self.static_step.close()
        for p in self.proposers.values():
            p.close()

    def release_memory(self) -> int:
        """Free the KV cache, the feature buffer and the captured graphs (the verify step's and the
        proposers', with an EAGLE drafter's KV) of an idle engine, between rollouts (verl's ``sleep``);
        returns the bytes of cache and features freed. :meth:`restore_memory`, or the next
        :meth:`add`, allocates them again; graphs are captured again as shapes come back."""
        if self.active:
            raise RuntimeError(f"release_memory needs an idle engine: {self.running} requests run, "
                               f"{len(self.sched.queue)} wait (let them finish, or abort them)")
        freed = (0 if self.cache.released else self.cache.release()) + self.features.release()
        self.close()
        if self.device.type == "cuda":  # with dropped engines' graphs, under CAPTURE_LOCK
            destroy_dropped_graphs()
        return freed

    def restore_memory(self) -> None:
        """Allocate the KV cache :meth:`release_memory` freed (no-op when nothing was); the feature
        buffer, the drafter's KV and the graphs come back at their first use."""
        if self.cache.released:
            self.cache.restore()

    @property
    def proposer(self) -> Proposer | None:
        """The main proposer (arms with ``proposer=""``)."""
        return self.proposers.get("")

    def set_proposers(self, proposers: dict[str, Proposer], tuner: Tuner | None) -> None:
        """Set the proposers and the tuner (between ``generate`` calls: the KV cache stays, the
        feature buffer is re-laid out at the next prefill if what is captured changed). Every arm
        the engine may run is checked against them; on a ValueError nothing changed."""
        if proposers and self.cfg.arm is None and tuner is None:
            raise ValueError("a proposer needs a strategy: set EngineConfig.arm or pass a tuner")
        for name, p in proposers.items():
            if not isinstance(p, Proposer):
                raise TypeError(f"proposer {name!r} is a {type(p).__name__}: subclass tlt.rollout.draft_tree.Proposer "
                                "(propose; capture_s, catch_up_s, kv_position_bytes, forget and close have defaults)")
        aux = {tuple(p.feature_layers) for p in proposers.values() if p.feature_layers}
        if self.sink is not None:
            aux.add(tuple(self.sink.aux_layers))
        if len(aux) > 1:
            raise ValueError(f"the proposers and the feature sink read different target layers {sorted(aux)}: give "
                             "them the same drafter's aux layers")
        old = self.proposers, self.tuner, self._aux_layers
        kept = (self._aux_layers, self._stores_hidden)
        self.proposers, self.tuner, self._aux_layers = dict(proposers), tuner, (aux.pop() if aux else ())
        try:
            self._check_arms()
            self._check_memory()
        except ValueError:
            self.proposers, self.tuner, self._aux_layers = old
            raise
        if self.static_step is not None and (self._aux_layers, self._stores_hidden) != kept:
            # the step's graphs produce the old features (a first EAGLE drafter reads the hidden state):
            # a new static step captures again on first use (capture time is no arm's cost)
            capture_s = self.static_step.capture_s
            self.static_step.close()
            self.static_step = self._new_static_step()
            self.static_step.capture_s = capture_s
            log.info("engine: the proposers read other target features: its graphs are captured again")
        for p in old[0].values():  # replaced proposers give their graphs' memory back now, not at a GC pass
            if all(p is not q for q in self.proposers.values()):
                p.close()

    def _check_memory(self) -> None:
        """Proposers set after construction fit the memory a pool sized by memory was sized for."""
        if self._sized_block_bytes is None or self.block_bytes() <= self._sized_block_bytes:
            return
        more = -(-(self.block_bytes() - self._sized_block_bytes) // self.cfg.block_size)
        raise ValueError(f"these proposers keep {self.block_bytes()} bytes per block of {self.cfg.block_size} "
                         f"positions, the pool was sized by memory for {self._sized_block_bytes}: build the "
                         f"engine with EngineConfig.draft_position_bytes >= {self.cfg.draft_position_bytes + more}")

    def _check_arms(self) -> None:
        """Every arm this engine may run fits its KV slots (a paged cache: its reach too, :func:`reach`)
        and names one of its proposers."""
        if not self.proposers:
            return
        arms = [self.cfg.arm] if self.cfg.arm is not None else list(self.tuner.all_arms() if self.tuner is not None else ())
        for arm in arms:
            if arm.is_off:
                continue
            if arm.tokens_to_verify > self.cfg.max_draft_tokens:
                raise ValueError(f"arm {arm} verifies {arm.tokens_to_verify} tokens but EngineConfig.max_draft_tokens="
                                 f"{self.cfg.max_draft_tokens}: raise max_draft_tokens or drop the arm")
            if arm.proposer not in self.proposers:
                raise ValueError(f"arm {arm} names proposer {arm.proposer!r}, the engine has "
                                 f"{sorted(self.proposers)}")
            if self.cfg.block_size is not None and reach(arm) > self.cfg.max_draft_tokens:
                raise ValueError(f"arm {arm}'s drafter writes {reach(arm)} positions past a request's tokens, more than "
                                 f"EngineConfig.max_draft_tokens={self.cfg.max_draft_tokens} that a paged cache's "
                                 "tables hold: raise max_draft_tokens or drop the arm")

    # ------------------------------------------------------------------ internals
    def _prefill(self, reqs: list["_Live"], row0: int, tables: torch.Tensor | None = None
                 ) -> tuple[list[int], list[float], RowState]:
        """Prefill joining requests into rows ``row0 ..`` (a paged cache: into their blocks, tables
        [B, C]): each over its prompt, or over prompt + tokens so far but the last (which is pending,
        as between two steps). Returns the pending tokens (sampled for fresh requests) and their
        log-probs, and the rows' device state."""
        ids_host = [r.seq[:-1] if r.state.output else r.seq for r in reqs]
        lens = torch.tensor([len(x) for x in ids_host], device=self.device)
        ids = right_pad(ids_host, device=self.device)  # [B, T]
        b = ids.shape[0]
        sampling = RowSampling.build([r.state.params for r in reqs], [r.state.seed for r in reqs], self.device)
        pending = torch.tensor([r.seq[-1] if r.state.output else -1 for r in reqs], device=self.device)  # [B]
        last = prefill_last_hidden(self.target, self.cache, ids, lens, [len(x) for x in ids_host],
                                   chunk=max(16, self.cfg.prefill_tokens // b), row0=row0, tables=tables,
                                   kernel=self.cfg.attention, scratch=self.pool.scratch if self.pool else 0,
                                   capture=self._capture, keep=self._keep_features)  # [B, H]
        logits = self.target.lm_head(last)[:, None]  # [B, 1, V]
        tok, lp = sample(logits, sampling, lens[:, None])  # a fresh request's first token sits at position len(prompt)
        tok = torch.where(pending[:, None] >= 0, pending[:, None], tok)
        host = torch.cat([tok.double(), lp.double()], 1).tolist()  # one host read
        state = RowState.start(ids, lens, tok[:, 0], stop_table([r.state.params.stop_ids for r in reqs], self.device),
                               sampling, self.cfg.slots, tables)
        # The pending token's KV (and feature) is written by the next step, as its tree root.
        return [int(r[0]) for r in host], [r[1] for r in host], state

    def _keep_features(self, out, meta: AttnMeta, c0: int) -> None:
        """A prefill chunk's features into the buffer at its rows' positions ``c0 ..``: the buffer is
        laid out like the KV cache, so the chunk's ``meta`` addresses it (rows or blocks alike)."""
        feats = self._features(out)
        if feats is None:
            return
        pos = torch.arange(c0, c0 + feats.shape[1], device=self.device).expand(feats.shape[0], -1)
        self.features.write(feats, meta.physical(pos), running=bool(self._rows))

    def _hand_over(self, row: int, req: "_Live") -> None:
        """A leaving request's tokens and their features, to the sink, before its row is compacted
        away; tokens handed over before go as context, not labels (never trained on twice)."""
        n = len(req.seq) - 1  # the pending token was never fed forward: no feature
        start = len(req.state.prompt) + req.handed_over
        if len(req.seq) <= start:
            return
        h = self.target.config.hidden_size
        if self.pool is None:
            feats = self.features.read(n, row=row)  # [n, H (+ A*H)]
        else:
            feats = self.features.read(n, blocks=self.pool.held(self._rows[row]), block_size=self.cfg.block_size)
        aux = feats[:, h:].contiguous() if self.sink.aux_layers else None
        self.sink.add(list(req.seq), start, feats[:, :h].contiguous(), aux)
        req.handed_over = len(req.seq) - len(req.state.prompt)

    @property
    def _capture(self) -> tuple[int, ...]:
        """Target layers whose inputs the forward records (the sink's and the proposers')."""
        return self._aux_layers

    @property
    def _stores_hidden(self) -> bool:
        return self.sink is not None or any(p.feature_layers == () for p in self.proposers.values())

    def _features(self, out) -> torch.Tensor | None:
        return _features_of(self._stores_hidden, self._capture, out)

    def _proposer_features(self, proposer: Proposer) -> torch.Tensor | None:
        """A proposer's view of the feature buffer (hidden, or the layers)."""
        return self.features.view(proposer.feature_layers, self.target.config.hidden_size, self._stores_hidden)

    def _budget_left(self, rid: int) -> int:
        """Tokens request ``rid`` may still commit (its output holds the pending token)."""
        return self._reqs[rid].state.params.max_new_tokens - (len(self._seqs[rid]) - self._plens[rid])

    def _speculate(self, b: int) -> bool:
        cap = self.cfg.elastic_threshold
        return bool(self.proposers) and (cap is None or b <= cap)

    def _move_accepted(self, path: torch.Tensor, roots: torch.Tensor, blocks: torch.Tensor | None, kept: bool) -> None:
        """Accepted nodes' keys/values (and features) right after each root, by fixed-size index
        tensors built on the device from the walked path [B, D]; run when the host's copy of the path
        (from the step's one read) shows a node off its depth. roots: [B] the roots' positions."""
        at = torch.arange(path.shape[1], device=self.device)  # [D]
        dst = roots[:, None] + 1 + at  # [B, D]
        src = roots[:, None] + 1 + torch.where(path >= 0, path, at)  # unaccepted depths: in place
        if self.pool is None:  # (row, slot)
            row = torch.arange(roots.shape[0], device=self.device)[:, None].expand_as(dst)
            src, dst = (row, src), (row, dst)
        else:  # (block, offset)
            src, dst = (physical(blocks, self.cfg.block_size, x, self.pool.scratch) for x in (src, dst))
        self.cache.move(src, dst)
        if kept:
            self.features.move(src, dst)

    def _choose(self, b: int) -> Arm:
        """This step's arm at batch ``b``: off while speculation is off, else the fixed arm or the tuner's."""
        if not self._speculate(b):
            return Arm.off()
        return self.cfg.arm if self.cfg.arm is not None else self.tuner.choose(b)

    def _propose(self, prop: Proposer, inp: ProposerInput, arm: Arm, drafting: Span) -> DraftTree:
        """The proposer's tree, timed by ``drafting``. The step's upload (the grown tables) is flushed
        before the proposer reads the tables, or by the proposer with its own data packed in
        (``packs_upload``); either way before the verify, and even if the proposer raises (the pool
        counted the grown blocks)."""
        if not prop.packs_upload:
            inp.upload.flush()
        drafting.start()
        try:
            return prop.propose(dataclasses.replace(inp, arm=arm, features=self._proposer_features(prop)))
        finally:
            inp.upload.flush()  # (nothing left when the proposer flushed it)
            drafting.stop()

    def _step(self, inp: ProposerInput, arm: Arm, tuned: bool):
        rows, st = inp.rows, inp.state
        b = len(rows)
        sd = self._speculate(b)
        t0 = time.perf_counter()
        switch_s = 0.0  # catching up what other arms committed: the switch's cost, not this arm's
        capture0 = self.static_step.capture_s if self.static_step is not None else 0.0
        drafting = Span(self.device)  # CUDA events on CUDA: the draft loop is launched asynchronously
        prop, prop_capture0 = None, 0.0
        if sd and not arm.is_off:
            prop = self.proposers[arm.proposer]
            prop_capture0 = prop.capture_s
            tree = self._propose(prop, inp, arm, drafting)
            switched = arm.proposer != self._last_proposer
            self._last_proposer = arm.proposer
        else:
            inp.upload.flush()  # the grown tables, for the verify
            tree = DraftTree.empty(b, self.device)
            self._last_proposer = None
        if self.static_step is not None:
            tree = tree.padded_to(arm.tokens_to_verify)
        n = tree.num_nodes
        limit = self.cfg.max_draft_tokens if self.pool is None else arm.tokens_to_verify  # (paged: the blocks held)
        if n > limit:  # arms were checked: only a proposer breaking its arm gets here
            raise RuntimeError(f"proposer {arm.proposer!r} drafted {n} > {limit} nodes for arm {arm} "
                               f"(max_draft_tokens={self.cfg.max_draft_tokens})")
        lengths = [len(inp.tokens[r]) for r in rows]  # committed incl. the pending one (host copy: shapes)
        roots = st.lens - 1  # [B] slot of the pending token
        ids = torch.cat([st.last[:, None], tree.tokens], 1)  # [B, 1 + N]
        parents = torch.cat([torch.full((b, 1), -1, device=self.device), tree.parents + 1], 1)
        parents[:, 1:] = torch.where(tree.valid, parents[:, 1:], -1)
        depth = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=self.device),
                           tree.depths() + 1], 1)
        tail = tree_ancestors(parents)  # [B, 1 + N, 1 + N]: what each node sees of the tree
        if self.static_step is not None:  # attention over the whole cache: a static shape; one graph on CUDA
            res = self.static_step.verify(ids, roots[:, None] + depth, roots, tail, tree, st.sampling, st.stops,
                                          min(arm.depth, n), self.features.buf, st.blocks)
            kept = self.features.buf is not None
        else:
            span = max(lengths) + n  # the largest slot + 1, known on the host
            kernel = self.cfg.attention
            splits = default_splits(b, self.target.config.num_key_value_heads, span, self.device, kernel,
                                    head_dim=self.target.config.head_dim)
            if self.pool is None:
                meta = AttnMeta.rows(roots, 1 + n, self.cache.max_len, tail=tail, span=span, kernel=kernel, splits=splits)
            else:
                meta = AttnMeta(st.blocks, self.cfg.block_size, torch.zeros_like(roots), roots, 1 + n, tail, span, splits,
                                scratch=self.pool.scratch, kernel=kernel)
            out = self.target(ids, roots[:, None] + depth, self.cache.backend(meta), capture=self._capture)
            feats = self._features(out)
            kept = feats is not None
            if kept:  # laid out like the KV cache: row, slot
                slots = roots[:, None] + torch.arange(1 + n, device=self.device)
                self.features.write(feats, meta.physical(slots), running=True)
            res = verify(out.logits, tree, st.sampling, roots[:, None] + depth + 1, st.stops, depth=min(arm.depth, n))
        if any(node != d for nodes in res.nodes for d, node in enumerate(nodes)):
            self._move_accepted(res.path, roots, st.blocks, kept)
        st.commit(res.committed, res.count)
        seconds = time.perf_counter() - t0  # the verifier's read synchronised with the device
        draft_s = drafting.seconds()
        catch_up_s = min(draft_s, prop.catch_up_s) if prop is not None else 0.0
        if prop is not None and switched:
            switch_s = catch_up_s
        # what each row keeps: a request's budget cuts the tokens past it (its stops end the walk)
        kept = [min(len(t), self._budget_left(r)) for t, r in zip(res.tokens, rows)]
        accepted = sum(min(len(x), k) for x, k in zip(res.nodes, kept))  # the bonus token comes last
        capture_s = self.static_step.capture_s - capture0 if self.static_step is not None else 0.0
        if prop is not None:
            capture_s += prop.capture_s - prop_capture0
        switch_s += capture_s  # a first use's graph capture is no arm's cost either
        if sd and tuned and self.tuner is not None and self.cfg.arm is None:
            self.tuner.record(b, arm, accepted, max(seconds - switch_s, 1e-9))
        rec = StepRecord(b, str(arm), sd and not arm.is_off, accepted, sum(kept), seconds,
                         res.drafted, draft_s, capture_s, catch_up_s, max(seconds - res.wait_s, 0.0))
        acc = kept if rec.sd else []
        return res.tokens, res.logprobs, rec, acc
