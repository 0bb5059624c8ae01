"""Spot trainer: preemptible FSDP2 drafter training on the ranks the coordinator lent to a session.

Owns one training session on one rank: forming the session's process group (membership and port
change from session to session), building the drafter on the target's frozen embedding / LM head
(shared by reference, replicated, never sharded or saved), sharding the drafter's trainable
modules with FSDP2, resuming from the latest selective checkpoint (written by any world size),
the packed TTT training loop, preemption between chunks of a micro-step, and the final checkpoint.
It is the project's only drafter training loop: the offline warm-up is a one-rank session of it.
What a session is given and returns (spec, config, result, preemption flag) is :mod:`tlt.drafter.session`.

Agreement: every micro-step starts with one tiny all-reduce (MAX) of ``[stop, no_data, chunks]``
so all ranks stop at the same boundary even when the preemption request reaches them at different
times (a rank leaving alone would hang the others in the next FSDP collective), and run the same
number of chunks.

Preemption granularity: with ``preempt_s`` set, a micro-step's samples are trained in chunks of
whole samples sized from this rank's measured tokens/s to take about ``preempt_s`` each, with a
stop all-reduce before every chunk, between its TTT steps and before its backward (a chunk
stopped there is dropped; not the session's first chunk, so every session that starts training
applies at least one), and before a periodic checkpoint (skipped: the final one covers it). So
the flag -> loop-exit latency is about one chunk, or one TTT step or backward of a sample longer
than a chunk, not one micro-step. A rank with fewer chunks than the agreed count runs empty
(fully masked) ones. The loss of a chunked micro-step is the mean of its chunks' global losses. A
step stopped after some of its chunks is not thrown away: the gradient of the chunks trained
(reduced after each chunk) is rescaled to their mean and applied.

Loss: the global TTT loss of the union of all ranks' samples. Per step ``j`` the summed losses
and valid-position counts are all-reduced, and each rank back-propagates
``sum_j decay**j * loss_sum_j(rank) * world / count_j(global)``; FSDP averages gradients over
ranks, so the update equals one process training on all samples (up to float summation order).

Data: ``next_batch(world_size * token_budget)`` must return the same list on every rank (e.g. a
seeded draw from the shared DataBuffer); rank ``r`` trains on a token-balanced shard of it. With
``local_data`` each rank draws ``token_budget`` tokens from its own buffer instead (the verl
integration: every replica holds the features of the sequences its worker computed). A list that
leaves some rank without samples ends the session (``no_data``) on every rank. A deterministic
stream (the warm-up's seeded epochs, :mod:`tlt.drafter.offline_train`) may have a ``seek(samples)`` method:
it is called once after the resume with the number of samples the resumed state had consumed, so
an interrupted and resumed run trains on exactly the batches an uninterrupted one would.

Work lost to a kill: at most one checkpoint ``interval`` plus the steps of a save still in flight.

First session: with no checkpoint yet, a session starts from ``init_from``; a warm-up directory's
optimizer state comes with it (:mod:`tlt.drafter.resume_state`).

Warm resume: a session's end keeps this rank's shards (weights and optimizer state) in process
memory (a :class:`~tlt.drafter.resume_state.WarmStore` its owner passes in; a replica that loads a
newer drafter prefetches it into the same store). The
next session resumes from them instead of reading the checkpoint when every rank agrees they are
the newest complete checkpoint and fit (same world size and rank, or a one-rank state each rank cuts
its shard from). That skips the DCP read, the largest fixed cost of a short session on a CPU. A
multi-rank session that ends on the step of a one-rank state held here keeps that state (it fits
any next membership).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from tlt.drafter.async_checkpoint import AsyncCheckpointer
from tlt.drafter.checkpoint import TrainState, latest, load
from tlt.drafter.eagle import WEIGHTS_NAME, Drafter, DrafterConfig
from tlt.drafter.packing import FeatureSample, empty_like, pack, shard_samples, split_chunks
from tlt.drafter.rendezvous import RendezvousAborted, rendezvous
from tlt.drafter.session import STOP_REASONS, NextBatch, PreemptFlag, SessionResult, SessionSpec, SpotConfig
from tlt.drafter.ttt import TTTConfig, ttt_forward
from tlt.drafter.resume_state import WarmStore, restore, snapshot, usable, warmup_state

log = logging.getLogger(__name__)

__all__ = ["STOP_REASONS", "NextBatch", "PreemptFlag", "SessionResult", "SessionSpec", "SpotConfig", "SpotTrainer",
           "run_session"]

_FIRST_CHUNK_TOKENS = 64  # chunk size before any throughput was measured (one busy-CPU chunk < 0.1 s)


class SpotTrainer:
    """One rank of one training session; ``run`` forms the group, trains, checkpoints, leaves."""

    def __init__(self, *, spec: SessionSpec, config: SpotConfig, drafter_config: DrafterConfig,
                 embed_weight: torch.Tensor, head_weight: torch.Tensor, checkpoint_root: str | Path,
                 init_from: str | Path | Mapping[str, torch.Tensor] | None = None,
                 tokens_per_s: float | None = None, warm_store: WarmStore | None = None) -> None:
        """``warm_store``: where this rank's state is kept between its owner's sessions (None: no
        warm resume; every session reads the checkpoint)."""
        self.spec, self.cfg, self.drafter_config = spec, config, drafter_config
        self.warm_store = warm_store
        self.tokens_per_s = tokens_per_s  # chunk sizing; e.g. the previous session's measurement
        self.embed_weight, self.head_weight = embed_weight, head_weight
        self.root = Path(checkpoint_root)
        # First weights while no checkpoint exists (a drafter directory or a state dict); None: seeded init.
        self.init_from = init_from if init_from is None or isinstance(init_from, Mapping) else Path(init_from)
        self.device = embed_weight.device
        self.drafter: Drafter | None = None  # built by run(); kept for inspection afterwards
        self.warm = False  # run() resumed from this process's memory instead of the checkpoint
        self._scored = [0.0, 0.0]  # this session's greedy-chain accepts, positions (held-out figure)

    # ------------------------------------------------------------------ session lifecycle
    def _init_group(self, should_stop: Callable[[], bool]) -> dist.ProcessGroup:
        if dist.is_initialized():
            raise RuntimeError("a process group is already initialized in this process; the "
                               "previous session must end (destroy_process_group) first")
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.set_device(self.device)
        s = self.spec
        store = rendezvous(s.master_addr, s.master_port, s.rank, s.world_size, session_id=s.session_id,
                           timeout_s=self.cfg.rendezvous_timeout_s, store_timeout_s=self.cfg.timeout_s,
                           should_stop=should_stop)
        dist.init_process_group(
            "cpu:gloo,cuda:nccl" if cuda else "gloo", store=store, rank=s.rank,
            world_size=s.world_size, timeout=datetime.timedelta(seconds=self.cfg.timeout_s),
            device_id=self.device if cuda else None)
        try:
            # DCP's writer thread gets a group of its own, bounded like the session's (torch's
            # default for a new group is 30 minutes: a dead peer held a save, and the STOP, that long)
            return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.cfg.timeout_s))
        except BaseException:  # a peer died in between: leave no group behind for the next session
            dist.destroy_process_group()
            raise

    def _build(self) -> tuple[Drafter, torch.optim.Optimizer]:
        torch.manual_seed(self.cfg.seed)  # identical full init on every rank before sharding
        d = Drafter(self.drafter_config, self.embed_weight, self.head_weight)
        if self.init_from is not None and latest(self.root) is None:
            init = (self.init_from if isinstance(self.init_from, Mapping)
                    else load_file(str(self.init_from / WEIGHTS_NAME)))
            missing, unexpected = d.load_state_dict(init, strict=False)
            if missing or unexpected:
                raise ValueError(f"init_from={self.init_from}: weights do not match the drafter "
                                 f"config (missing {missing[:4]}, unexpected {unexpected[:4]})")
        d = d.to(self.device)
        cuda = self.device.type == "cuda"
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if cuda and self.cfg.mixed_precision else MixedPrecisionPolicy())
        mesh = init_device_mesh(self.device.type, (self.spec.world_size,))
        # One FSDP unit per trainable module: each is entered through its own forward, so the
        # TTT loop's repeated calls (and EAGLE-3's logits() outside forward) re-unshard as needed.
        for name in ("fc", "norm", "lm_head"):
            if hasattr(d, name):
                fully_shard(getattr(d, name), mesh=mesh, mp_policy=mp)
        for layer in d.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(d, mesh=mesh, mp_policy=mp)
        params = list(d.parameters())
        if d.embed_weight is not self.embed_weight or d.target_head_weight is not self.head_weight \
                or any(p is self.embed_weight or p is self.head_weight for p in params):
            raise RuntimeError("the target's embedding / LM head must stay shared by reference and "
                               "out of the drafter's parameters")
        opt = torch.optim.AdamW(params, lr=self.cfg.lr, betas=self.cfg.betas,
                                weight_decay=self.cfg.weight_decay)
        return d, opt

    def _resume(self, d: Drafter, opt: torch.optim.Optimizer, state: TrainState, pg) -> int:
        """Resume from the newest checkpoint; a first session continues the warm-up's optimizer
        state behind ``init_from`` (:func:`~tlt.drafter.resume_state.warmup_state`), its schedule at 0."""
        step, self.warm = self._read(self.root, d, opt, state, pg)
        init = warmup_state(self.init_from) if isinstance(self.init_from, Path) else None
        if step is None and init is not None:
            self._read(init, d, opt, state, pg)
            state.step, state.progress["samples"] = 0, 0
            for g in opt.param_groups:  # the moments are the warm-up's, the settings this config's
                g.update(betas=self.cfg.betas, weight_decay=self.cfg.weight_decay)
        return step or 0

    def _read(self, root: Path, d: Drafter, opt: torch.optim.Optimizer, state: TrainState,
              pg) -> tuple[int | None, bool]:
        """The newest checkpoint under ``root`` into ``d``, ``opt`` and ``state``: from this
        process's memory when every rank holds it (one all-reduce), else read. Returns its step
        (None: no checkpoint) and whether it came from memory."""
        w, s = (self.warm_store.get(root) if self.warm_store is not None else None), self.spec
        agree = torch.tensor([float(usable(w, d, latest(root), s.world_size, s.rank))])
        dist.all_reduce(agree, op=dist.ReduceOp.MIN)
        if not agree[0]:
            return load(root, {"train": state}, process_group=pg), False
        restore(w, d, opt, s.world_size, s.rank)
        state.step, state.progress["samples"] = w.step, w.samples
        return w.step, True

    def _overlap_staging(self) -> bool:
        if self.cfg.overlap_staging is None:
            return self.device.type == "cuda"
        return self.cfg.overlap_staging

    def run(self, next_batch: NextBatch, should_stop: Callable[[], bool],
            on_step: Callable[[int, float], None] | None = None) -> SessionResult:
        """Train until ``should_stop()`` (on any rank), ``max_steps`` or no data; then checkpoint.
        ``on_step(step, loss)`` is called after every optimizer step (e.g. a progress bar).

        ``should_stop`` is polled during the rendezvous, after the group formed, after the drafter
        is built (agreed by all ranks, so a stop during set-up skips the rest of it) and before
        every micro-step; a :class:`PreemptFlag` also lets the latency from its ``set()`` be
        measured. A session stopped before training returns at once (``preempted``, no steps)
        with nothing to save.
        """
        self._t0 = time.monotonic()
        try:
            ckpt_pg = self._init_group(should_stop)
        except RendezvousAborted as e:
            log.info("session %s rank %d: %s", self.spec.session_id, self.spec.rank, e)
            return self._stopped_before_training(should_stop)
        self._t_formed = time.monotonic()
        try:
            if self._agreed_stop(should_stop):
                return self._stopped_before_training(should_stop)
            d, opt = self._build()
            self.drafter = d
            state = TrainState(d, opt, frozen=(self.embed_weight, self.head_weight),
                               progress={"world_size": self.spec.world_size, "samples": 0})
            ckpt = AsyncCheckpointer(self.root, keep_last=self.cfg.keep_last, process_group=ckpt_pg,
                                     overlap_staging=self._overlap_staging())
            try:
                if self._agreed_stop(should_stop):  # skip reading the checkpoint
                    return self._stopped_before_training(should_stop)
                start = self._resume(d, opt, state, ckpt_pg)
                state.progress["world_size"] = self.spec.world_size  # who writes the next one
                if hasattr(next_batch, "seek"):
                    next_batch.seek(state.progress["samples"])
                if start:
                    log.info("session %s rank %d: resumed from step %d", self.spec.session_id,
                             self.spec.rank, start)
                self._t_ready = time.monotonic()
                return self._loop(d, opt, state, ckpt, start, next_batch, should_stop, on_step)
            finally:
                ckpt.close()
        finally:
            dist.destroy_process_group()

    def _agreed_stop(self, should_stop: Callable[[], bool], gaps: list[float] | None = None) -> bool:
        """One stop check, agreed by all ranks (the next collective stays in step); in the
        training loop (``gaps`` given) it also notes the interval since the previous check."""
        flag = torch.tensor([float(self._check(gaps, should_stop) if gaps is not None else should_stop())])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag[0])

    def _stopped_before_training(self, should_stop: Callable[[], bool]) -> SessionResult:
        ck, set_at = latest(self.root), getattr(should_stop, "set_at", None)
        lat = None if set_at is None else time.monotonic() - set_at
        log.info("session %s rank %d: stopped before training (checkpoint %s)", self.spec.session_id,
                 self.spec.rank, ck)
        return SessionResult(session_id=self.spec.session_id, rank=self.spec.rank,
                             world_size=self.spec.world_size, start_step=ck or 0, end_step=ck or 0,
                             losses=(), stop_reason="preempted", preempt_latency_s=lat,
                             stop_latency_s=lat, checkpoint_step=ck,
                             check_interval_s=(), checkpoint_stall_s=())

    # ------------------------------------------------------------------ training loop
    def _chunk_tokens(self) -> int:
        if self.cfg.preempt_s is None:
            return 1 << 62
        if self.tokens_per_s is None:
            return _FIRST_CHUNK_TOKENS
        return max(16, int(self.tokens_per_s * self.cfg.preempt_s))

    def _micro_step(self, d: Drafter, samples: list[FeatureSample], ttt: TTTConfig, scale: float,
                    stop: Callable[[], bool] | None = None) -> float | None:
        """Forward + backward of this rank's samples; returns the global loss (times ``scale``),
        or None when the agreed ``stop`` (checked between TTT steps and before the backward)
        abandoned the forward: nothing of it reaches the gradients."""
        batch = pack(samples)
        if self.device.type != "cpu":
            batch = dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(self.device)
                                                  for f in dataclasses.fields(batch)
                                                  if isinstance(getattr(batch, f.name), torch.Tensor)})
        st = ttt_forward(d, batch, ttt, stop)
        if st is None or (stop is not None and stop()):
            return None
        n = len(st.count)
        sums = torch.tensor(st.count + [float(s.detach()) for s in st.loss_sum]
                            + [st.chain_accept, st.positions], dtype=torch.float64)
        dist.all_reduce(sums)  # [steps counts ; steps loss sums ; chain accepts, positions], over all ranks
        counts, loss_sums = sums[:n].tolist(), sums[n:2 * n].tolist()
        self._scored[0] += float(sums[-2])
        self._scored[1] += float(sums[-1])
        ttt = ttt.for_drafter(d)
        world = self.spec.world_size
        loss = 0.0 * sum(st.loss_sum)  # in the graph even when no position counts (empty chunk)
        global_loss = 0.0
        for j, (s, c, gs) in enumerate(zip(st.loss_sum, counts, loss_sums)):
            if c:
                loss = loss + (ttt.decay ** j) * s * (world * scale / c)
                global_loss += (ttt.decay ** j) * gs / c
        loss.backward()
        return global_loss * scale

    def _check(self, gaps: list[float], should_stop: Callable[[], bool]) -> bool:
        """One stop check: notes the interval since the previous one; returns this rank's flag."""
        now = time.monotonic()
        if self._last_check is not None:  # one chunk (+ optimizer step, + save) ago
            gaps.append(now - self._last_check)
        self._last_check = now
        return bool(should_stop())

    def _train_micro_step(self, d: Drafter, next_batch: NextBatch, should_stop: Callable[[], bool],
                          gaps: list[float], state: TrainState) -> tuple[str | None, float, float]:
        """One micro-step in agreed chunks: (stop reason or None, summed global loss of the chunks
        trained, summed loss scale of those chunks: 1 / micro_steps for a whole micro-step)."""
        cfg, spec = self.cfg, self.spec
        stop = self._check(gaps, should_stop)
        want = cfg.token_budget if cfg.local_data else spec.world_size * cfg.token_budget
        samples = [] if stop else list(next_batch(want))
        mine = samples if cfg.local_data else shard_samples(samples, spec.rank, spec.world_size)
        chunks = split_chunks(mine, self._chunk_tokens())
        flags = torch.tensor([float(stop), float(not stop and not mine), float(len(chunks))])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0] or flags[1]:
            return ("preempted" if flags[0] else "no_data"), 0.0, 0.0
        k = int(flags[2])
        chunks += [[empty_like(mine[0])]] * (k - len(chunks))

        def agreed_stop() -> bool:
            return self._agreed_stop(should_stop, gaps)

        # Chunked: also checked inside a chunk (a chunk is whole samples, and one long sample can
        # take several times preempt_s), except the session's first: a session that starts
        # training applies at least one chunk, however short its window.
        chunked = cfg.preempt_s is not None
        loss, weight = 0.0, 0.0
        for i, chunk in enumerate(chunks):
            if i and agreed_stop():
                return "preempted", loss, weight
            t0 = time.monotonic()
            scale = 1.0 / (cfg.micro_steps * k)
            got = self._micro_step(d, chunk, cfg.ttt, scale, agreed_stop if chunked and self._chunks_done else None)
            if got is None:
                return "preempted", loss, weight
            loss += got
            weight += scale
            self._chunks_done += 1
            tokens = sum(len(s) for s in chunk if bool(s.loss_mask.any()))
            if tokens:  # (the collectives inside make this the slowest rank's pace)
                rate = tokens / max(time.monotonic() - t0, 1e-6)
                self.tokens_per_s = rate if self.tokens_per_s is None else 0.5 * (self.tokens_per_s + rate)
        state.progress["samples"] += len(samples)
        return None, loss, weight

    def _loop(self, d, opt, state: TrainState, ckpt: AsyncCheckpointer, start: int,
              next_batch: NextBatch, should_stop: Callable[[], bool],
              on_step: Callable[[int, float], None] | None) -> SessionResult:
        cfg, spec = self.cfg, self.spec
        step, losses, gaps = start, [], []
        reason, exited = None, None
        self._last_check = None
        self._chunks_done = 0  # chunks trained in this session (on every rank alike)
        self._scored = [0.0, 0.0]
        d.train()
        while reason is None:
            if cfg.max_steps is not None and step >= cfg.max_steps:
                reason = "max_steps"
                break
            step_loss = done = 0.0
            for _ in range(cfg.micro_steps):
                reason, loss, weight = self._train_micro_step(d, next_batch, should_stop, gaps, state)
                step_loss, done = step_loss + loss, done + weight
                if reason is not None:
                    exited = time.monotonic()
                    break
            if reason is not None and not done:
                break
            if reason is not None:  # stopped inside a step: apply the mean over the chunks trained
                with torch.no_grad():
                    for p in d.parameters():
                        if p.grad is not None:
                            p.grad.mul_(1.0 / done)
                step_loss /= done
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(list(d.parameters()), cfg.grad_clip)
            ckpt.wait_staged()  # the step below mutates what an in-flight snapshot may still copy
            for g in opt.param_groups:  # the config, not the checkpoint, sets the lr
                g["lr"] = cfg.lr_at(step)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            losses.append(step_loss)
            if on_step is not None:
                on_step(step, step_loss)
            if step % cfg.interval == 0:
                if reason is None and cfg.preempt_s is not None and self._agreed_stop(should_stop, gaps):
                    reason, exited = "preempted", time.monotonic()  # the final save below covers it
                    break
                state.step = step
                ckpt.save(step, {"train": state})
        exited = exited or time.monotonic()
        ckpt.wait()
        if step != start and ckpt.last_committed != step:
            state.step = step
            ckpt.save(step, {"train": state})
            ckpt.wait()
        dist.barrier()  # every rank's shards and the coordinator's commit are done
        durable = time.monotonic()
        # What the next session here may resume from memory; but a one-rank state of this same
        # step (prefetched, or this session's start) fits any membership, this session's shards not.
        have = self.warm_store.get(self.root) if self.warm_store is not None else None
        keep = have is not None and (have.step, have.world_size) == (step, 1)
        if self.warm_store is not None and latest(self.root) == step and not keep:
            self.warm_store.put(self.root, snapshot(d, opt, step, spec.world_size, spec.rank,
                                                    state.progress["samples"]))
        set_at = getattr(should_stop, "set_at", None) if reason == "preempted" else None
        return SessionResult(
            session_id=spec.session_id, rank=spec.rank, world_size=spec.world_size,
            start_step=start, end_step=step, losses=tuple(losses), stop_reason=reason,
            preempt_latency_s=None if set_at is None else exited - set_at,
            stop_latency_s=None if set_at is None else durable - set_at,
            checkpoint_step=latest(self.root),  # after the barrier: committed everywhere
            check_interval_s=tuple(gaps), checkpoint_stall_s=tuple(ckpt.stats.stall_s),
            tokens_per_s=self.tokens_per_s, warm=self.warm,
            heldout_accept_length=1.0 + self._scored[0] / self._scored[1] if self._scored[1] else None,
            phase_s=(self._t_formed - self._t0, self._t_ready - self._t_formed, exited - self._t_ready,
                     durable - exited))


def run_session(*, spec: SessionSpec, config: SpotConfig, drafter_config: DrafterConfig,
                embed_weight: torch.Tensor, head_weight: torch.Tensor, checkpoint_root: str | Path,
                next_batch: NextBatch, should_stop: Callable[[], bool],
                init_from: str | Path | Mapping[str, torch.Tensor] | None = None,
                warm_store: WarmStore | None = None) -> SessionResult:
    """Convenience: build a :class:`SpotTrainer` for this rank and run one session."""
    return SpotTrainer(spec=spec, config=config, drafter_config=drafter_config,
                       embed_weight=embed_weight, head_weight=head_weight, checkpoint_root=checkpoint_root,
                       init_from=init_from, warm_store=warm_store).run(next_batch, should_stop)
