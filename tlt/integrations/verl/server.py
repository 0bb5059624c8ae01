"""One rollout replica of the project's engine behind verl's token-in/token-out server interface.

Owns the replica's Ray actor (:class:`TLTServer`) and how its parts meet, in the replica's own
process: the engine (:class:`~tlt.integrations.verl.assembly.ReplicaEngine`: target, suffix and
EAGLE proposers, tuner, feature sink) fed by the request batcher (:mod:`.batcher`); policy and
drafter updates (:mod:`.weight_sync`); moves (:class:`~.moves.ReplicaMoves`); and forwarding from
a restarted replica that has not received the current policy yet (:mod:`.forwarding`). What both
backends keep (the DataBuffer, the step's statistics, the spot agent, the drafter versions) is its
:class:`~.replica_core.ReplicaCore`.

Device: the one this process has. With a GPU (Ray gave the actor one) the target, drafter and spot
trainer run there in bf16 with static shapes and graph replay, the GPU tuner arms and nccl;
otherwise on CPU in fp32, eager, with the CPU arms and gloo. verl's ``tlt`` replica launches its
servers without a GPU reservation (``TLTReplica.rollout_worker_use_gpu`` is False), so under verl
today they run on CPU: the backend is for CPU runs, tests and small models; GPU clusters use the
SGLang path (docs/verl.md).

Ordering (one serving lock, ``_lock``): a generation (from the first request an idle engine takes
to the last that leaves it; requests join it while it runs: ``_serving`` takes the lock and releases
it, the batcher's worker holds it around the generation), a policy copy, a drafter swap, a history
update and a drift-probe forward never overlap. A spot session trains on its own copies of the
frozen tensors, so it needs no lock; it is stopped before a generation runs (``agent.busy``).

Moves (the driver's :mod:`.consolidator`, the protocol in :mod:`.moves`): ``move_out`` lets
requests leave for another replica, whose ``generate`` they reach again through verl's client with
their state; ``reserve`` makes this replica a destination. The replica's :class:`~.moves.ReplicaMoves`
orders a reservation with the IDLE decision of ``_idle_work``.

Requests (verl's ``generate``): each is a :class:`~tlt.rollout.request.RequestState` with its seed
(verl's, else :func:`~tlt.drafter.seeds.fallback_seed` of its request id). verl's
``abort_all_requests`` returns every running request's partial output; the replica keeps the aborted
states by their tokens and seed, not by request id (verl's client sends a new id on each call unless
``rollout.full_determinism``), and a resubmission (verl's partial rollout sends prompt + partial
output) goes on from its state: same seed and GRPO group, the features this replica's DataBuffer
already received not trained on twice.

Why here and not in the actor worker: this is the process that idles when its requests drain, it
serves the drafter it trains (no copy for its own updates), and it has no default process group of
its own (the worker's belongs to the FSDP actor), so a spot-training group can be formed freely.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from tlt.drafter.eagle import Drafter, DrafterConfig
from tlt.drafter.resume_state import WarmStore, prefetch, warmup_state
from tlt.drafter.seeds import fallback_seed
from tlt.rollout.request import RequestState
from tlt.rollout.target import TargetModel
from tlt.integrations.verl.assembly import ReplicaEngine
from tlt.integrations.verl.batcher import Generation, RequestBatcher
from tlt.integrations.verl.config import TLTConfig
from tlt.integrations.verl.forwarding import Forwarding
from tlt.integrations.verl.history_log import HISTORY_FILE, read_history
from tlt.integrations.verl.moves import MOVED, MOVED_KEY, ReplicaMoves, moved_in
from tlt.integrations.verl.requests import engine_params
from tlt.integrations.verl.replica_core import ReplicaCore
from tlt.integrations.verl.spot_wiring import BufferFeed, spot_config
from tlt.integrations.verl.tail_batching import DROPPED
from tlt.integrations.verl.weight_sync import DriftProbe, copy_policy, load_spot_drafter

log = logging.getLogger(__name__)


STOP_REASONS = {"stop": "completed", "length": "length", "aborted": "aborted"}


def server_name(replica_rank: int) -> str:
    return f"tlt_server_{replica_rank}"


def replica_actor_name(rollout_name: str, replica_rank: int) -> str:
    """The Ray name of a replica's (first) server actor: the project's engine's, or verl's SGLang one."""
    return f"sglang_server_{replica_rank}_0" if rollout_name == "sglang" else server_name(replica_rank)


def replica_of_this_rank(rollout_config) -> tuple[int, bool]:
    """(replica index, is the replica's first rank) of this actor worker (``RANK``): a replica
    spans tensor x data x pipeline parallel ranks of the actor worker group."""
    rc = rollout_config
    world = rc.tensor_model_parallel_size * rc.data_parallel_size * rc.pipeline_model_parallel_size
    rank = int(os.environ.get("RANK", "0"))
    return rank // world, rank % world == 0


def replica_device() -> torch.device:
    """The device this replica process runs on: its GPU if it has one, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def resume_key(tokens, seed: int | None) -> tuple[int, int, int | None]:
    """The key an aborted request's state is kept under: its tokens (prompt + partial output, what
    its resubmission sends as the prompt) and the seed its agent loop gave (None: none given).
    Seeded requests of one GRPO group aborted at the same tokens differ by their seeds (unseeded
    ones share a key: the last one kept wins); the caller compares tokens and settings
    (:func:`resumes`)."""
    t = tuple(tokens)
    return len(t), hash(t), seed


def resumes(state: RequestState, prompt_ids, params) -> bool:
    """Whether a request of ``prompt_ids`` and ``params`` goes on from the aborted ``state`` kept
    under its key: the same tokens (not a hash collision) and the same settings but the budget (a
    new request with other settings, e.g. a greedy validation of the same tokens, starts anew)."""
    return (list(prompt_ids) == list(state.prompt + state.output)
            and dataclasses.replace(state.params, max_new_tokens=params.max_new_tokens) == params)


class TLTServer:
    """The Ray actor of one replica (``ray.remote`` is applied by the replica class)."""

    def __init__(self, *, model_path: str, replica_rank: int, tlt: dict, prompt_length: int,
                 response_length: int, coordinator: str | None, spot_root: str, run_dir: str = "",
                 spot_base_port: int = 0, seed: int = 0, max_num_seqs: int | None = None,
                 gpu_memory_utilization: float | None = None) -> None:
        import ray

        self.cfg = TLTConfig.from_mapping(tlt)
        self.rank, self.spot_root, self.seed = replica_rank, spot_root, seed
        self.core = ReplicaCore(self.cfg, rank=replica_rank, seed=seed, spot_root=spot_root)
        if run_dir:  # which process is which replica (also after a restart), like tlt_coordinator.pid
            (Path(run_dir) / f"tlt_replica_{replica_rank}.pid").write_text(f"{os.getpid()}\n")
        if self.cfg.engine.threads:
            torch.set_num_threads(self.cfg.engine.threads)
        self.device = replica_device()
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model = TargetModel.from_pretrained(model_path).to(device=self.device, dtype=dtype)
        self.max_len = prompt_length + response_length + 1
        self.response_length = response_length
        self.drafter_cfg = DrafterConfig.for_target(self.model.config, self.cfg.drafter.method)
        drafters = self.core.drafters  # served: the EAGLE drafter (None: none)
        if self.cfg.drafter.init_path:
            drafters.served = Drafter.load(self.cfg.drafter.init_path, self.model.embed_weight,
                                           self.model.lm_head.weight).to(dtype=dtype).eval()
            self.drafter_cfg = drafters.served.config
        # A restarted replica (Ray re-ran this constructor after a crash) holds the initial weights:
        # until verl pushes the current policy it forwards requests to a healthy replica (never
        # samples stale weights); it serves the newest committed spot drafter.
        self.forwarding = Forwarding(replica_rank, ray.get_runtime_context().was_current_actor_reconstructed,
                                     server_name)
        if self.forwarding.stale:
            got = load_spot_drafter(spot_root, self.drafter_cfg, self.model.embed_weight, self.model.lm_head.weight)
            if got is not None:
                drafters.served, drafters.version = got[0], -1  # restored: the driver's version is unknown
        train = self.cfg.enable and self.cfg.drafter.train and coordinator and spot_base_port
        feed = (BufferFeed(self.core.buffer, self.drafter_cfg.aux_layers, lambda: self.core.step)
                if train and self.cfg.buffer.capture == "rollout" else None)
        self.assembly = ReplicaEngine(self.model, self.cfg, max_len=self.max_len, seed=seed, rank=replica_rank,
                                      drafter=drafters.served, sink=feed, device=self.device.type,
                                      max_num_seqs=max_num_seqs, gpu_memory_utilization=gpu_memory_utilization,
                                      drafter_later=bool(train))
        self.history_file = Path(run_dir) / HISTORY_FILE if run_dir else None
        if self.forwarding.stale and self.history_file is not None and self.history_file.is_file():
            self._reload_history()
        self.weight_version = 0  # verl's global step of the policy being served
        self._lock = threading.Lock()  # held while the engine runs a generation (weights swap between)
        # aborted requests' states by resume_key: a resubmission (prompt + partial output, as verl's
        # partial rollout sends it) goes on from there; the oldest are dropped past a bound
        self._partial: dict[tuple[int, int, int | None], RequestState] = {}
        self._dropping = False  # tail batching dropped this round's requests (event loop)
        self.moves = ReplicaMoves()
        self.batcher = RequestBatcher(lambda: self.engine, window_s=self.cfg.engine.batch_window_ms / 1000,
                                      max_batch=self.engine.cfg.max_batch, serving=self._serving,
                                      on_idle=self._went_idle,
                                      track_load=self.cfg.tail.consolidate.mode != "off",
                                      name=f"replica {replica_rank}")
        self.probe = DriftProbe(self.model, self._lock)
        self.warm = WarmStore()  # the spot sessions' state between sessions, and prefetched drafters
        if train:
            self._prefetch_warmup_state()
            self.core.start_agent(model=self.model, drafter_cfg=self.drafter_cfg, coordinator=coordinator,
                                  base_port=spot_base_port, warm_store=self.warm)
        # Everything loaded so far lives as long as the replica: out of the cyclic collector's full
        # passes, which otherwise walk it each time the rollout's allocations trigger one (they took
        # about 60% of the suffix drafter's time per proposal; docs/rollout.md)
        gc.collect()
        gc.freeze()

    @property
    def engine(self):
        return self.assembly.engine

    @property
    def proposer_name(self) -> str:
        return self.assembly.proposer_name

    def _prefetch_warmup_state(self) -> None:
        """The first spot session continues the warm-up drafter's optimizer state: read into this
        process now, so that session does not spend step 1's short idle window reading it."""
        init = warmup_state(self.cfg.drafter.init_path) if self.cfg.drafter.init_path else None
        if init is not None:
            spot = spot_config(self.cfg, self.seed)
            prefetch(self.warm, init, self.drafter_cfg, self.model.embed_weight, self.model.lm_head.weight,
                     lr=spot.lr, betas=spot.betas, weight_decay=spot.weight_decay)

    def _reload_history(self) -> None:
        """A restarted replica rebuilds its draft history from the run directory (the trainer's
        :class:`~tlt.integrations.verl.history_log.HistoryLog`)."""
        n = sum(self.assembly.add_history(step, pairs) for step, pairs in read_history(self.history_file).items())
        log.warning("replica %d: draft history rebuilt from %s (%d responses)", self.rank, self.history_file, n)

    # ------------------------------------------------------------------ verl server interface
    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data=None, video_data=None, **kwargs):
        """verl's request; ``kwargs["tlt_state"]``: a request moved here from another replica (the
        client of :mod:`.moves` resubmits it with its state), which goes on from its tokens so far."""
        from verl.workers.rollout.replica import TokenOutput

        if image_data or video_data:
            raise ValueError("the tlt rollout serves text-only models (image/video data given)")
        tlt_state = kwargs.pop("tlt_state", None)
        if self.forwarding.stale:  # never sample stale weights: a healthy replica serves the request
            peer = await self.forwarding.peer()
            return await peer.generate.remote(request_id, prompt_ids, sampling_params, image_data=image_data,
                                              video_data=video_data, tlt_state=tlt_state, **kwargs)
        params, given = engine_params(dict(sampling_params), prompt_len=len(prompt_ids), max_len=self.max_len,
                                      response_length=self.response_length,
                                      eos_ids=tuple(self.model.config.eos_ids or ()))
        if tlt_state is not None:
            state = moved_in(tlt_state, prompt_ids)
            self.moves.arrived()
        else:
            key = resume_key(prompt_ids, given)
            state = self._partial.get(key)
            if state is not None and resumes(state, prompt_ids, params):
                del self._partial[key]
            else:
                # no seed from the agent loop: one from the request id (verl's client sends a new one
                # per call unless rollout.full_determinism: exact, not reproducible across runs)
                seed = fallback_seed(self.seed, request_id) if given is None else given
                state = RequestState(tuple(prompt_ids), params, seed, group=tuple(prompt_ids))
        fin = None
        try:
            fin = await self.batcher.submit(state, request_id)
        finally:  # answered, dropped, failed or cancelled: a move it was on is over either way
            to = self.moves.departed(request_id, left=fin is not None and fin.reason == "left")
        if fin.reason == "aborted" and self._dropping:  # tail batching's drop: not resubmitted
            return TokenOutput(token_ids=list(fin.state.output[len(state.output):]),
                               log_probs=list(fin.state.logprobs[len(state.output):])
                               if sampling_params.get("logprobs") else None,
                               stop_reason=DROPPED, extra_fields={"global_steps": self.weight_version})
        if fin.reason == "aborted" and not fin.state.done:
            self._partial[resume_key(fin.state.prompt + fin.state.output, given)] = fin.state
            while len(self._partial) > 4 * self.cfg.engine.max_batch:
                self._partial.pop(next(iter(self._partial)))
        new = len(state.output)  # a resubmission returns what it added to the partial output verl holds
        extra = {"global_steps": self.weight_version}
        if fin.reason == "left":  # moved: the client goes on at the destination with this state
            extra[MOVED_KEY] = {"to": to, "state": fin.state}
        return TokenOutput(token_ids=list(fin.state.output[new:]),
                           log_probs=list(fin.state.logprobs[new:]) if sampling_params.get("logprobs") else None,
                           stop_reason=MOVED if fin.reason == "left" else STOP_REASONS[fin.reason],
                           extra_fields=extra)

    def is_stale(self) -> bool:
        return self.forwarding.stale

    @contextlib.contextmanager
    def _serving(self) -> Iterator[Callable[[Generation], None]]:
        """A generation's hold on the replica (the batcher's worker thread, around the whole
        generation): the serving lock from its first step to its last, so weights and drafters swap
        between generations, never inside one; training stopped (checkpointed) before it decodes.
        Yields where the batcher hands the generation's record."""
        done: list[Generation] = []
        with self._lock:  # after any IDLE the idle thread sent under this lock, never before it
            agent = self.core.agent
            if agent is not None:
                agent.busy(self.core.step)
            self.moves.serving()
            yield done.append
            for gen in done:
                self.probe.record([list(f.state.prompt + f.state.output) for f in gen.finished[:self.probe.size]])
        for gen in done:
            self.core.stats.batch(gen)

    def _went_idle(self) -> None:
        """Every request answered (event loop): if there is anything to train on, the spot agent's
        IDLE, then the drift probe's old-policy forward, in a thread of their own. IDLE goes first:
        the idle window is often a fraction of a second, and the probe's forward would delay the
        session's start by its own length."""
        self.core.stats.went_idle()
        threading.Thread(target=self._idle_work, name=f"tlt-idle-{self.rank}", daemon=True).start()

    def _idle_work(self) -> None:
        with self._lock:  # ordered with _serving's BUSY: a generation queued meanwhile keeps it busy
            agent = self.core.agent
            # ordered with reserve(): a move on its way here keeps it busy
            send, expected = self.moves.decide_idle(bool(agent is not None and self.batcher.idle
                                                         and len(self.core.buffer)))
            if send:
                agent.idle(self.core.step)
            elif expected is not None and agent is not None:  # a move that never arrives: look again then
                threading.Timer(max(expected - time.monotonic(), 0.0), self._idle_work).start()
        self.probe.before()  # before the next policy copy: update_weights comes after the rollout

    # ------------------------------------------------------------------ consolidation (the driver's Consolidator)
    async def replica_load(self) -> dict[str, Any]:
        """This replica's load for consolidation: running requests, step cost by batch, the cost
        of a joining request, and whether it is in a spot session."""
        load = self.batcher.load()
        return {"rank": self.rank, "requests": list(load.requests), "step_s": dict(load.step_s),
                "join_s": load.join_s, "tokens_per_step": load.tokens_per_step,
                "training": bool(self.core.agent is not None and self.core.agent.training)}

    def reserve(self, n: int, ttl_s: float) -> bool:
        """A move's destination: False if this replica told its spot agent it is idle (a session
        may run or be about to: never a destination); else it expects ``n`` requests within
        ``ttl_s`` and sends no IDLE until they arrived (the two decisions are ordered: :class:`~.moves.ReplicaMoves`)."""
        return self.moves.reserve(n, ttl_s, training=bool(self.core.agent is not None and self.core.agent.training))

    async def move_out(self, request_ids: list[str], to: str) -> list[str]:
        """The requests ``request_ids`` leave this replica for server ``to`` at the next step
        boundary: each one's ``generate`` returns its state (stop reason ``tlt_moved``), and the
        client goes on there. Returns the ids that were in flight here."""
        return self.moves.leave(request_ids, to, self.batcher.leave)

    # ------------------------------------------------------------------ control (driver / workers)
    def begin_step(self, step: int) -> None:
        """RL step ``step``'s rollout is about to start: stats restart; training (if any) stops."""
        self._stop_training(step, "begins")
        self.core.begin_step(step)
        self.moves.begin_step()

    async def end_rollout(self) -> None:
        """The rollout ended and the coordinator preempted training. A session whose STOP timed out
        there (a slow final checkpoint, say) is waited out here, so that none trains through verl's
        update on the same device. Nothing to give back: the project's engine never releases memory."""
        await asyncio.to_thread(self._stop_training, self.core.step, "ends its rollout")

    def _stop_training(self, step: int, when: str) -> None:
        """Stop this replica's spot session, if one runs; one that outlives ``busy_timeout_s`` is
        logged and left (a generation here waits for it again, and fails if it still runs)."""
        agent = self.core.agent
        if agent is not None and agent.training:
            from tlt.spot_agent import TrainingDidNotStop

            try:
                agent.busy(step)
            except TrainingDidNotStop:
                log.exception("replica %d: step %d %s with a spot session still running", self.rank, step, when)

    def step_stats(self) -> dict[str, Any]:
        return self.core.step_stats(proposer=self.proposer_name, drift_top1=self.probe.top1,
                                    running=self.engine.running, moved_out=self.moves.moved_out,
                                    engine_lifecycle=dict(self.engine.lifecycle), buffer_fed=dict(self.engine.fed),
                                    kv_slots=self.engine.cfg.slots)

    def update_weights(self, state: dict[str, torch.Tensor], version: int | None = None) -> int:
        """Policy weights (HF names) copied into the target in place, between batches; the drafter
        is untouched. The drift probe's new-policy forward runs after, in a thread of its own."""
        with self._lock:
            n = copy_policy(self.model, state)
            self.forwarding.fresh()
            if version is not None:
                self.weight_version = int(version)
        threading.Thread(target=self.probe.after, name=f"tlt-drift-{self.rank}", daemon=True).start()
        return n

    async def add_history(self, step: int, pairs: list[tuple[list[int], list[int]]]) -> int:
        """Step ``step``'s (prompt, response) pairs join the suffix drafter's history (between batches)."""
        def add():
            with self._lock:
                return self.assembly.add_history(step, pairs)
        return await asyncio.to_thread(add)

    # The drafter calls wait for the serving lock off the event loop (a batch may hold it).
    async def load_drafter(self, version: int, step: int | None = None) -> int:
        return await asyncio.to_thread(self._load_drafter, version, step)

    async def served_drafter(self) -> dict[str, Any]:
        return await asyncio.to_thread(self._served_drafter)

    async def rollback_drafter(self, version: int) -> int:
        return await asyncio.to_thread(self._rollback_drafter, version)

    def _load_drafter(self, version: int, step: int | None = None) -> int:
        """Serve spot checkpoint ``step`` (the one the driver pushes to every replica; None: the
        latest) as drafter ``version`` (draft weights only, swapped in place: the engine is not
        rebuilt); returns the version served."""
        got = load_spot_drafter(self.spot_root, self.drafter_cfg, self.model.embed_weight,
                                self.model.lm_head.weight, step)
        drafters = self.core.drafters
        with self._lock:  # never in the middle of a batch (hence of a verify)
            why = ""  # why it is not served
            if got is None:  # (a spot root this node cannot see)
                why = f"no spot checkpoint {'newest' if step is None else f'step {step}'} under {self.spot_root}"
            else:
                try:
                    self.assembly.set_drafter(got[0])
                except ValueError as e:  # the engine refuses it (no room in its memory)
                    why = f"refused: {e}"
            if why:  # the drafter before serves on, under this version: the guard's read-back rejects the push
                log.error("replica %d: drafter version %d not served (%s); the previous one serves on", self.rank,
                          version, why)
                drafters.push(drafters.served, version)  # a rollback then restores it, not the one before it
                return version
            drafters.push(got[0], version)  # the previous one: the push guard's rollback
        if self.core.agent is not None:  # the next one-rank session here resumes from memory
            spot = spot_config(self.cfg, self.seed)
            prefetch(self.warm, self.spot_root, self.drafter_cfg, self.model.embed_weight, self.model.lm_head.weight,
                     lr=spot.lr, betas=spot.betas, weight_decay=spot.weight_decay, step=step)
        log.info("replica %d: drafter version %d (%s)", self.rank, version, self.proposer_name)
        return version

    def _served_drafter(self) -> dict[str, Any]:
        """The push guard's hard check: the digest of the draft weights the engine runs (None: no
        EAGLE drafter) and their dtype, read from the engine's proposer between batches."""
        with self._lock:
            return {"digest": self.assembly.served_drafter_digest(), "dtype": str(self.model.embed_weight.dtype)}

    def _rollback_drafter(self, version: int) -> int:
        """Serve again the drafter served before the last push (the push guard rejected it), as
        ``version``; once only: a second call without a push in between changes nothing."""
        drafters = self.core.drafters
        with self._lock:
            if drafters.previous is None:
                return drafters.version
            self.assembly.set_drafter(drafters.previous[0])
            drafters.rollback(version)
        log.warning("replica %d: drafter rolled back (%s)", self.rank, self.proposer_name)
        return version

    def tuner_state(self) -> dict[str, Any] | None:
        with self._lock:
            tuner = self.engine.tuner
            return None if tuner is None else tuner.state_dict()

    def load_tuner_state(self, state: dict[str, Any] | None) -> bool:
        with self._lock:
            tuner = self.engine.tuner
            if tuner is None or state is None:
                return False
            try:
                tuner.load_state_dict(state)
            except ValueError as e:  # other arms (another drafter kind, another config): start afresh
                log.warning("replica %d: tuner statistics not restored (%s)", self.rank, e)
                return False
        return True

    def add_samples(self, step: int, samples: list[tuple]) -> int:
        """Features captured by this replica's actor worker (``tlt.buffer.capture=old_log_prob``)."""
        return self.core.add_samples(step, samples)

    def pid(self) -> int:
        return os.getpid()

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        """verl's abort: running and queued requests return their partial output (``aborted``);
        requests arriving until :meth:`resume_generation` wait for it (``reject_request``: they
        return at once as aborted, with no tokens)."""
        keys = await self.batcher.abort_all(reject=reject_request)
        log.info("replica %d: aborted %d requests", self.rank, len(keys))
        return {"aborted_count": len(keys), "request_ids": keys}

    async def drop_requests(self) -> int:
        """Tail batching's drop: running and queued requests return their partial output with stop
        reason ``tlt_dropped`` (verl's client does not resubmit it), and requests arriving until
        :meth:`resume_generation` return at once, dropped. Returns the requests dropped."""
        self._dropping = True
        keys = await self.batcher.abort_all(reject=True)
        log.info("replica %d: dropped %d requests", self.rank, len(keys))
        return len(keys)

    async def resume_generation(self) -> None:
        self._dropping = False
        self.batcher.resume()

    async def abort_request(self, request_id: str) -> dict[str, Any]:
        """Abort one request (it returns its partial output, ``aborted``)."""
        return {"aborted": await self.batcher.abort(request_id), "request_id": request_id}

    # verl's control plane. Between rollouts (``sleep`` after one, ``release_kv_cache`` around a
    # weight sync) the engine frees its KV cache, feature buffer and graphs; ``wake_up`` /
    # ``resume_kv_cache`` allocate them again (and a request arriving first does so itself). The
    # replica keeps its own copy of the target's weights beside the actor's.
    async def sleep(self) -> None:
        await asyncio.to_thread(self._release_memory)

    async def release_kv_cache(self) -> None:
        await asyncio.to_thread(self._release_memory)

    async def wake_up(self) -> None:
        await asyncio.to_thread(self._restore_memory)

    async def resume_kv_cache(self) -> None:
        await asyncio.to_thread(self._restore_memory)

    async def clear_kv_cache(self): return None
    def _release_memory(self) -> int:
        """Under the serving lock, which a generation holds from start to end: a sleep that reaches
        a serving replica waits for its generation to end. Returns the bytes freed (0, with a
        warning, if requests are left in the engine, e.g. after a failed abort)."""
        with self._lock:
            if self.engine.active:
                log.warning("replica %d: asked to free its KV cache with %d requests running; kept it",
                            self.rank, self.engine.running)
                return 0
            freed = self.engine.release_memory()
        log.info("replica %d: freed %.1f MB of KV cache and features", self.rank, freed / 2**20)
        return freed

    def _restore_memory(self) -> None:
        with self._lock:
            self.engine.restore_memory()

    async def start_profile(self, **kwargs): return None
    async def stop_profile(self): return None

    def shutdown(self) -> None:
        self.core.shutdown()
