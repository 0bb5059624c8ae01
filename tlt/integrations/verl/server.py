"""One rollout replica of the project's engine behind verl's token-in/token-out server interface.

Owns everything TLT runs per replica, in the replica's own Ray actor process:

- the engine (target model, static KV cache, proposer, BEG-MAB tuner) and the batcher that turns
  verl's concurrent per-request ``generate`` calls into engine batches (requests that arrive
  within ``engine.batch_window_ms`` of each other decode together; later ones form the next batch);
- the engine's proposers (:class:`~tlt.integrations.verl.assembly.ReplicaEngine`): the model-free
  suffix drafter (prompt, GRPO group, earlier steps' responses) and, once one was loaded, the EAGLE
  drafter, as arms of one tuner; the drafter is swapped only between batches, in place;
- policy weight updates (target tensors copied in place: the drafter's shared embedding / LM head
  follow, its own weights are untouched) and drafter updates (``load_drafter``, versioned);
- the DataBuffer of target hidden states: fed by the engine itself as requests finish
  (``tlt.buffer.capture=rollout``: the policy being rolled out) or by this replica's actor worker
  from verl's old-log-prob forward (``old_log_prob``); and the spot agent: in-flight count 0 -> IDLE to the coordinator, PROMOTE -> FSDP2 spot training on this
  process, a new request or rollout end -> stop (checkpointed);
- per-step statistics for the trainer's metrics.

Why here and not in the actor worker: this is the process that idles when its requests drain, it
serves the drafter it trains (no copy for its own updates), and it has no default process group of
its own (the worker's belongs to the FSDP actor), so a spot-training group can be formed freely.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from drafter.buffer import BufferConfig, DataBuffer
from drafter.checkpoint import load_weights
from drafter.eagle import Drafter, DrafterConfig
from drafter.packing import FeatureSample
from drafter.spot import SpotConfig, SpotTrainer
from drafter.warm import prefetch
from drafter.ttt import TTTConfig
from rollout.generate import SamplingParams
from rollout.target import TargetModel
from tlt.integrations.verl.assembly import ReplicaEngine
from tlt.integrations.verl.config import TLTConfig
from tlt.integrations.verl.requests import engine_params

log = logging.getLogger(__name__)
PORT_SPAN = 256
HISTORY_FILE = "tlt_history.jsonl"  # in the run directory: the last steps' responses, for restarts


@dataclasses.dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    seed: int  # the request's seed (verl's sampling_params["seed"]), else unique to this replica
    future: asyncio.Future


class BufferFeed:
    """The engine's feature sink: each finished request becomes a DataBuffer sample of this step."""

    def __init__(self, buffer: DataBuffer, aux_layers: tuple[int, ...], step) -> None:
        self.buffer, self.aux_layers, self._step = buffer, tuple(aux_layers), step  # step(): the RL step

    def add(self, tokens, prompt_len, hidden, aux) -> None:
        mask = torch.zeros(len(tokens), dtype=torch.bool)
        mask[prompt_len:] = True
        self.buffer.add(FeatureSample(torch.tensor(tokens), mask, hidden, aux), self._step())


def server_name(replica_rank: int) -> str:
    return f"tlt_server_{replica_rank}"


def replica_of_this_rank(rollout_config) -> tuple[int, bool]:
    """(replica index, is the replica's first rank) of this actor worker (``RANK``): a replica
    spans tensor x data x pipeline parallel ranks of the actor worker group."""
    rc = rollout_config
    world = rc.tensor_model_parallel_size * rc.data_parallel_size * rc.pipeline_model_parallel_size
    rank = int(os.environ.get("RANK", "0"))
    return rank // world, rank % world == 0


def load_spot_drafter(root: str | Path, cfg: DrafterConfig, embed: torch.Tensor,
                      head: torch.Tensor, step: int | None = None) -> tuple[Drafter, int] | None:
    """Spot checkpoint ``step`` (default: the latest committed one) as a serving drafter (no
    process group needed)."""
    if not root or not Path(root).exists():
        return None
    d = Drafter(cfg, embed, head)
    step = load_weights(root, d, frozen=(embed, head), step=step)
    return None if step is None else (d.eval(), step)


def session_weights(model: TargetModel) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen embedding and LM head a spot session trains against: its own copies, so a policy
    push (which copies the new policy into the target in place) never writes tensors a session
    reads, whether or not the session has stopped yet. Cost per session start: one copy of the
    embedding and the head (at 7B, vocab 152k x 3584 in bf16: about 2.2 GB)."""
    return model.embed_weight.detach().clone(), model.lm_head.weight.detach().clone()


class TLTServer:
    """The Ray actor of one replica (``ray.remote`` is applied by the replica class)."""

    def __init__(self, *, model_path: str, replica_rank: int, tlt: dict, prompt_length: int,
                 response_length: int, coordinator: str | None, spot_root: str, run_dir: str = "",
                 spot_base_port: int = 0, seed: int = 0) -> None:
        import ray

        self.cfg = TLTConfig.from_mapping(tlt)
        self.rank, self.spot_root, self.seed = replica_rank, spot_root, seed
        if run_dir:  # which process is which replica (also after a restart), like tlt_coordinator.pid
            (Path(run_dir) / f"tlt_replica_{replica_rank}.pid").write_text(f"{os.getpid()}\n")
        if self.cfg.engine.threads:
            torch.set_num_threads(self.cfg.engine.threads)
        self.model = TargetModel.from_pretrained(model_path)
        self.max_len = prompt_length + response_length + 1
        self.response_length = response_length
        self.drafter_cfg = DrafterConfig.for_target(self.model.config, self.cfg.drafter.method)
        self.drafter: Drafter | None = None
        self.drafter_version = 0
        if self.cfg.drafter.init_path:
            self.drafter = Drafter.load(self.cfg.drafter.init_path, self.model.embed_weight,
                                        self.model.lm_head.weight).eval()
            self.drafter_cfg = self.drafter.config
        # A restarted replica (Ray re-ran this constructor after a crash) holds the initial weights:
        # until verl pushes the current policy it forwards requests to a healthy replica (never
        # samples stale weights); it serves the newest committed spot drafter.
        self.stale = ray.get_runtime_context().was_current_actor_reconstructed
        if self.stale:
            log.warning("replica %d restarted: serving again after the next policy push", replica_rank)
            got = load_spot_drafter(spot_root, self.drafter_cfg, self.model.embed_weight, self.model.lm_head.weight)
            if got is not None:
                self.drafter, self.drafter_version = got[0], -1  # restored: the driver's version is unknown
        self._forwarded_to: int | None = None
        self.buffer = DataBuffer(BufferConfig(dtype=self.cfg.buffer.dtype, max_bytes=self.cfg.buffer.max_mb << 20))
        self.step = 0
        train = self.cfg.enable and self.cfg.drafter.train and coordinator and spot_base_port
        self.feed = (BufferFeed(self.buffer, self.drafter_cfg.aux_layers, lambda: self.step)
                     if train and self.cfg.buffer.capture == "rollout" else None)
        self.assembly = ReplicaEngine(self.model, self.cfg, max_len=self.max_len, seed=seed, rank=replica_rank,
                                      drafter=self.drafter, sink=self.feed)
        self.history_file = Path(run_dir) / HISTORY_FILE if run_dir else None
        if self.stale and self.history_file is not None and self.history_file.is_file():
            self._reload_history()
        self.pending: collections.deque[_Request] = collections.deque()
        self.inflight = 0
        self.weight_version = 0  # verl's global step of the policy being served
        self._seeds = itertools.count()  # one sampling seed per request, never reused
        self._batcher_task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._lock = threading.Lock()  # held while the engine runs a batch (weights swap between)
        self._stats_lock = threading.RLock()  # the per-step statistics
        self._stats = self._empty_stats()
        self._probe: list[list[int]] = []
        self.drift_top1 = None  # top-1 agreement of the last two policies on the last batch's probe
        self._spot_rate: float | None = None  # spot training tokens/s measured by the last session
        self.agent = self._start_agent(coordinator, ray.util.get_node_ip_address(), spot_base_port) if train else None

    # ------------------------------------------------------------------ engine assembly
    @property
    def engine(self):
        return self.assembly.engine

    @property
    def proposer_name(self) -> str:
        return self.assembly.proposer_name

    def _reload_history(self) -> None:
        """A restarted replica rebuilds its draft history from the run directory (the trainer keeps
        the last ``history_steps`` steps' responses there)."""
        by_step: dict[int, list] = collections.defaultdict(list)
        for line in self.history_file.read_text().splitlines():
            rec = json.loads(line)
            by_step[rec["step"]].append((rec["prompt"], rec["response"]))
        n = sum(self.assembly.add_history(step, by_step[step]) for step in sorted(by_step))
        log.warning("replica %d: draft history rebuilt from %s (%d responses)", self.rank, self.history_file, n)

    def _start_agent(self, coordinator: str, node_ip: str, base_port: int):
        from coordinator import WorkerConfig
        from tlt.spot_agent import AgentConfig, SpotAgent

        cc = self.cfg.coordinator
        spot = SpotConfig(lr=self.cfg.spot.lr, token_budget=self.cfg.spot.token_budget,
                          interval=self.cfg.spot.interval, local_data=True, preempt_s=self.cfg.spot.preempt_s,
                          ttt=TTTConfig(steps=self.cfg.spot.ttt_steps), seed=self.seed)
        self._spot_cfg = spot
        init_from = self.cfg.drafter.init_path

        def make_trainer(s):  # the last session's measured throughput sizes the first chunks
            embed, head = session_weights(self.model)
            return SpotTrainer(spec=s, config=spot, drafter_config=self.drafter_cfg, embed_weight=embed,
                               head_weight=head, checkpoint_root=self.spot_root, init_from=init_from,
                               tokens_per_s=self._spot_rate)

        def batches(f):
            calls = itertools.count()
            return lambda budget: self.buffer.sample_batch(budget, seed=f.epoch * 1_000_003 + next(calls))

        def on_record(rec) -> None:
            r = rec.result
            with self._stats_lock:
                st = self._stats
                if r is None:
                    st["failed_sessions"] += 1
                    return
                if r.tokens_per_s:
                    self._spot_rate = r.tokens_per_s
                if r.preempt_latency_s is not None:
                    st["preempt_s"].append(r.preempt_latency_s)
                st["phases"].append(r.phase_s)
                if r.rank == 0:  # every rank reports the same global steps and losses
                    st["sessions"] += 1
                    st["train_steps"] += r.end_step - r.start_step
                    st["losses"] += list(r.losses)

        worker = WorkerConfig(address=coordinator, worker_id=f"replica-{self.rank}",
                              trainer_address=f"tcp://{node_ip}:{base_port + PORT_SPAN * self.rank}",
                              heartbeat_interval_s=cc.heartbeat_s, liveness=cc.liveness,
                              reconnect_initial_s=cc.heartbeat_s, reconnect_max_s=8 * cc.heartbeat_s)
        agent = SpotAgent(worker, make_trainer=make_trainer, batches=batches, on_record=on_record,
                          config=AgentConfig(port_span=PORT_SPAN))
        return agent.start(0)

    @staticmethod
    def _empty_stats() -> dict[str, Any]:
        return {"committed": 0, "verifies": 0, "accepted": 0, "drafted": 0, "tokens": 0,
                "arms": collections.Counter(), "idle_at": None, "idle_s": 0.0, "sessions": 0,
                "failed_sessions": 0, "train_steps": 0, "losses": [], "preempt_s": [], "batches": 0,
                "requests": 0, "gen_s": 0.0, "phases": []}

    # ------------------------------------------------------------------ verl server interface
    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data=None, video_data=None, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        if image_data or video_data:
            raise ValueError("the tlt rollout serves text-only models (image/video data given)")
        if self.stale:  # never sample stale weights: a healthy replica serves the request
            peer = await self._healthy_peer()
            if peer is None:
                raise RuntimeError(f"replica {self.rank} restarted and has not received the current policy "
                                   "yet, and no other replica has it; refusing to sample from stale weights")
            return await peer.generate.remote(request_id, prompt_ids, sampling_params, image_data=image_data,
                                              video_data=video_data, **kwargs)
        params, seed = engine_params(dict(sampling_params), prompt_len=len(prompt_ids), max_len=self.max_len,
                                     response_length=self.response_length,
                                     eos_ids=tuple(self.model.config.eos_ids or ()))
        if seed is None:  # no identity from verl: a stream no other request of this run uses
            seed = ((self.seed * 1_000_003 + self.rank) * 1_000_003 + next(self._seeds)) | (1 << 63)
        fut = asyncio.get_running_loop().create_future()
        self._ensure_loop()
        self.pending.append(_Request(list(prompt_ids), params, seed, fut))
        self.inflight += 1
        self._wake.set()
        tokens, lps, reason = await fut
        return TokenOutput(token_ids=tokens, log_probs=lps if sampling_params.get("logprobs") else None,
                           stop_reason=reason, extra_fields={"global_steps": self.weight_version})

    async def _healthy_peer(self):
        """Another replica serving the current policy (replicas are named 0, 1, ... in order)."""
        import ray

        for k in itertools.count():
            if k == self.rank:
                continue
            try:
                peer = ray.get_actor(server_name(k))
            except ValueError:  # past the last replica
                return None
            try:
                if not await peer.is_stale.remote():
                    if self._forwarded_to != k:
                        log.warning("replica %d: stale after its restart; forwarding requests to replica %d "
                                    "until the next policy push", self.rank, k)
                        self._forwarded_to = k
                    return peer
            except ray.exceptions.RayError:  # that one is down too
                continue
        return None

    def is_stale(self) -> bool:
        return self.stale

    def _ensure_loop(self) -> None:
        if self._batcher_task is None:
            self._wake = asyncio.Event()
            self._batcher_task = asyncio.get_running_loop().create_task(self._batcher())

    async def _batcher(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._serve_pending()
            except Exception:  # never let the loop die: later requests would wait forever
                log.exception("replica %d: batcher error", self.rank)

    async def _serve_pending(self) -> None:
        window = self.cfg.engine.batch_window_ms / 1000
        if not self.pending:
            return
        while True:  # wait until requests stop arriving for one window
            n = len(self.pending)
            await asyncio.sleep(window)
            if len(self.pending) == n or n >= self.cfg.engine.max_batch:
                break
        batch = [self.pending.popleft() for _ in range(min(len(self.pending), self.cfg.engine.max_batch))]
        try:
            results = await asyncio.to_thread(self._run_batch, batch)
        except Exception as e:  # every waiter learns the error; the server keeps serving
            log.exception("replica %d: batch of %d failed", self.rank, len(batch))
            results = [e] * len(batch)
        finally:
            self.inflight -= len(batch)
        for req, res in zip(batch, results):
            if req.future.done():  # the caller went away
                continue
            if isinstance(res, Exception):
                req.future.set_exception(res)
            else:
                req.future.set_result(res)
        if self.pending:
            self._wake.set()
        elif self.inflight == 0:
            with self._stats_lock:
                self._stats["idle_at"] = time.monotonic()
            if self.agent is not None and len(self.buffer):  # nothing to train on: no session
                self.agent.idle(self.step)

    def _run_batch(self, batch: list[_Request]):
        if self.agent is not None:
            self.agent.busy(self.step)  # stops a training session (checkpointed) before decoding
        with self._lock:
            prompts = [r.prompt for r in batch]
            ids: dict[tuple[int, ...], int] = {}
            groups = [ids.setdefault(tuple(p), len(ids)) for p in prompts]
            t0 = time.monotonic()
            res = self.engine.generate(prompts, [r.params for r in batch], groups, [r.seed for r in batch])
            gen_s = time.monotonic() - t0
            self._probe = [r.prompt + toks for r, toks in zip(batch[:4], res.outputs[:4])]
        with self._stats_lock:
            st = self._stats
            if st["idle_at"] is not None:
                st["idle_s"] += t0 - st["idle_at"]
                st["idle_at"] = None
            st["gen_s"] += gen_s
            st["batches"] += 1
            st["requests"] += len(batch)
            st["tokens"] += res.tokens
            for s in res.steps:
                if s.sd:
                    st["verifies"] += s.batch
                    st["committed"] += s.committed
                    st["accepted"] += s.accepted
                    st["drafted"] += s.drafted
                    st["arms"][s.arm] += 1
        out = []
        for r, toks, lps in zip(batch, res.outputs, res.logprobs):
            stopped = bool(toks) and toks[-1] in r.params.stop_ids
            out.append((toks, lps, "completed" if stopped else "length"))
        return out

    # ------------------------------------------------------------------ control (driver / workers)
    def begin_step(self, step: int) -> None:
        """RL step ``step``'s rollout is about to start: stats restart; training (if any) stops."""
        if self.agent is not None and self.agent.training:
            self.agent.busy(step)
        self.step = step
        with self._stats_lock:
            self._stats = self._empty_stats()

    def step_stats(self) -> dict[str, Any]:
        with self._stats_lock:
            st = dict(self._stats)
            st["arms"] = dict(st["arms"])
            st["losses"], st["preempt_s"], st["phases"] = list(st["losses"]), list(st["preempt_s"]), list(st["phases"])
        if st["idle_at"] is not None:
            st["idle_s"] += time.monotonic() - st["idle_at"]
        st.update(drafter_version=self.drafter_version, proposer=self.proposer_name, drift_top1=self.drift_top1,
                  buffer=self.buffer.stats(), replica=self.rank)
        return st

    def update_weights(self, state: dict[str, torch.Tensor], version: int | None = None) -> int:
        """Policy weights (HF names) copied into the target in place; the drafter is untouched.
        Every name and shape is checked before anything is copied."""
        own = self.model.state_dict()
        skip = {n for n in state if n not in own and (n.endswith("rotary_emb.inv_freq") or (
            n == "lm_head.weight" and self.model.config.tie_word_embeddings))}
        for name, t in state.items():
            if name in skip:
                continue
            if name not in own:
                raise ValueError(f"policy weight {name!r} is not a tensor of the rollout target")
            if tuple(t.shape) != tuple(own[name].shape):
                raise ValueError(f"policy weight {name!r} has shape {tuple(t.shape)}, the rollout target "
                                 f"expects {tuple(own[name].shape)}")
        with self._lock, torch.no_grad():
            before = self._probe_argmax()
            for name, t in state.items():
                if name not in skip:
                    own[name].copy_(t.to(own[name].dtype))
            self.stale, self._forwarded_to = False, None
            if version is not None:
                self.weight_version = int(version)
            if before is not None:
                after = self._probe_argmax()
                self.drift_top1 = float((before[0] == after[0])[before[1]].float().mean())
        return len(state) - len(skip)

    def _probe_argmax(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Greedy next tokens [B, T] of the current target on the probe, and the valid mask."""
        if not self._probe:
            return None
        t = max(len(x) for x in self._probe)
        ids = torch.zeros(len(self._probe), t, dtype=torch.long)
        valid = torch.zeros(len(self._probe), t, dtype=torch.bool)
        for i, x in enumerate(self._probe):
            ids[i, :len(x)], valid[i, :len(x)] = torch.tensor(x), True
        return self.model(ids).logits.argmax(-1), valid  # right padding: causal rows stay exact

    def add_history(self, step: int, pairs: list[tuple[list[int], list[int]]]) -> int:
        """Step ``step``'s (prompt, response) pairs join the suffix drafter's history (between batches)."""
        with self._lock:
            return self.assembly.add_history(step, pairs)

    def load_drafter(self, version: int, step: int | None = None) -> int:
        """Serve spot checkpoint ``step`` (the one the driver pushes to every replica; None: the
        latest) as drafter ``version`` (draft weights only); returns the version served."""
        got = load_spot_drafter(self.spot_root, self.drafter_cfg, self.model.embed_weight,
                                self.model.lm_head.weight, step)
        if got is None:
            return self.drafter_version
        with self._lock:  # never in the middle of a batch (hence of a verify)
            self.drafter, _ = got
            self.drafter_version = version
            self.assembly.set_drafter(self.drafter)
        if self.agent is not None:  # the next one-rank session here resumes from memory
            spot = self._spot_cfg
            prefetch(self.spot_root, self.drafter_cfg, self.model.embed_weight, self.model.lm_head.weight,
                     lr=spot.lr, betas=spot.betas, weight_decay=spot.weight_decay, step=step)
        log.info("replica %d: drafter version %d (%s)", self.rank, version, self.proposer_name)
        return version

    def add_samples(self, step: int, samples: list[tuple]) -> int:
        for ids, mask, hidden, aux in samples:
            self.buffer.add(FeatureSample(ids, mask, hidden, aux), step)
        return len(self.buffer)

    def pid(self) -> int:
        return os.getpid()

    # verl's control plane: sleeping frees nothing on CPU; requests are never aborted mid-batch.
    async def wake_up(self): return None
    async def sleep(self): return None
    async def abort_all_requests(self, reject_request: bool = False): return None
    async def resume_generation(self): return None
    async def clear_kv_cache(self): return None
    async def release_kv_cache(self): return None
    async def resume_kv_cache(self): return None
    async def start_profile(self, **kwargs): return None
    async def stop_profile(self): return None

    def shutdown(self) -> None:
        if self.agent is not None:
            self.agent.close()
