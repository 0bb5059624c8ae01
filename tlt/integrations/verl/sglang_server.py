"""TLT's loop on verl's SGLang rollout: one replica's server actor, behind the loop's replica interface.

Owns :class:`TLTSGLangServer`, verl's ``SGLangHttpServer`` Ray actor with the calls of
:class:`tlt.integrations.replica_api.ReplicaAPI`, and :class:`TLTSGLangReplica`, verl's
``SGLangReplica`` launching it (the ``tlt`` trainer puts it in verl's replica registry for
``rollout.name=sglang``; stock verl runs never see it).

- **Launch.** verl launches SGLang in the actor as it always does, with TLT's arguments added to
  ``engine_kwargs.sglang`` (:mod:`tlt.integrations.sglang.launch`: EAGLE, the start drafter,
  ``speculative_adaptive``, the adaptive slots, 0.5.12's draft loader), after SGLang's plugins
  (TLT's hooks, the lossless guard among them) are loaded in the actor's process. With
  ``tlt.sglang.attach`` the actor attaches to an SGLang server already running instead.
- **Requests** go to the server's HTTP ``/generate`` (the body verl builds), so the same code
  serves an SGLang verl launched, one launched outside verl, and the CPU tests' stand-in.
- **Idle signal**: this actor's in-flight request count (the one process every request of the
  replica passes through). SGLang's scheduler-side idle hook (:mod:`tlt.integrations.sglang.idle`)
  stays for SGLang outside verl: in a verl run it is off, so one coordinator worker never spans two
  processes.
- **Spot agent**: in this actor; sessions train on the replica's first GPU (the frozen tensors
  copied there per session, into the room the released KV cache left), else on the CPU. At 0
  in-flight requests (and a non-empty DataBuffer) the actor releases the server's KV cache (``release_memory_occupation(["kv_cache"])``),
  then reports IDLE; the coordinator's PROMOTE starts a session on the DataBuffer (fed by the
  actor workers' old-log-prob capture). The next request first stops training (checkpointed),
  then resumes the KV cache, then goes to the server.
- **Ordering with verl's sleep/wake**: TLT's release/resume nest inside verl's wake-up ... sleep.
  ``end_rollout`` (the trainer calls it when the rollout ends, after the coordinator preempted the
  sessions, before verl sleeps the replicas) stops the agent and resumes the KV cache if TLT
  released it, so verl's ``sleep`` and ``update_weights`` (``resume(["weights"])``, push,
  ``resume(["kv_cache"])``) find the memory as verl left it. TLT never releases weights.
- **Frozen weights**: the spot session's embedding and LM head are the current policy's: the TP
  leader's policy push hands them to :meth:`update_weights` (cost per push: one copy of both
  through Ray's object store; at 7B, 152k x 3584 in bf16, about 2.2 GB).
- **Drafter pushes** (:meth:`load_drafter`, :meth:`rollback_drafter`) go through the replica's
  actor workers and TLT's draft-only adapter (``TLTSGLangServerAdapter.update_draft_weights``:
  SPMD over the replica's TP ranks, tensors on each rank's device).
- **Hard check** (:meth:`served_drafter`): SGLang's ``get_weights_by_name`` reads only the target
  model in 0.5.12 and 0.5.23, so TLT's SGLang plugin serves names ``tlt.draft/<name>`` from the
  draft model (:mod:`tlt.integrations.sglang.readback`); this reads back the first
  ``tlt.sglang.readback_elements`` values of the drafter's ``fc`` weight and hands their digest
  to the push guard, which computes the same from the checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import types
from typing import Any

import ray
import torch
from verl.workers.rollout.replica import TokenOutput
from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangHttpServer, SGLangReplica

from tlt.drafter.digest import weights_digest
from tlt.drafter.resume_state import WarmStore
from tlt.integrations.sglang import launch
from tlt.integrations.verl.config import TLTConfig
from tlt.integrations.verl.sglang_drafts import CANARY, drafter_config
from tlt.integrations.verl.server import replica_actor_name
from tlt.integrations.verl.sglang_push import TLTHttpEngine
from tlt.integrations.verl.replica_core import ReplicaCore
from tlt.integrations.verl.tail_batching import DROPPED

log = logging.getLogger(__name__)

# A rollout request runs as long as its tokens take (minutes at the tail). verl's client times a
# request out at 60 s and posts it again under the same rid (which SGLang refuses as a duplicate):
# /generate waits this long instead, so it never does.
GENERATE_TIMEOUT_S = 24 * 3600.0
# SGLang ignores an abort that reaches it before its request does: a request still in flight this
# long after its abort is aborted once more
ABORT_RESEND_S = 0.1


class _Call:
    """One ``generate`` call in flight: whether an abort asked for it, whether its body went to SGLang."""

    __slots__ = ("aborted", "sent")

    def __init__(self) -> None:
        self.aborted = self.sent = False


class TLTSGLangServer(SGLangHttpServer):
    """The Ray actor of one SGLang replica (``ray.remote`` is applied by the replica class)."""

    def __init__(self, *args, tlt: dict, coordinator: str | None = None, spot_root: str = "",
                 spot_base_port: int = 0, seed: int = 0, start_drafter: str | None = None,
                 attach: tuple[str, int] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cfg = TLTConfig.from_mapping(tlt)
        self.rank, self.spot_root, self.seed = self.replica_rank, spot_root, seed
        self.start_drafter, self._attach = start_drafter, attach
        self.model_path = self.model_config.local_path
        self.eagle = self.cfg.sglang.algorithm == "eagle"
        # spot sessions train on the replica's first GPU (verl set CUDA_VISIBLE_DEVICES), else the CPU;
        # the frozen tensors wait in host memory and go there only while a session runs
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        embed, head = launch.frozen_tensors(self.model_path)
        self.frozen = types.SimpleNamespace(embed_weight=embed, lm_head=types.SimpleNamespace(weight=head))
        self.drafter_cfg = drafter_config(self.cfg, self.model_path)
        self.core = ReplicaCore(self.cfg, rank=self.rank, seed=seed, spot_root=spot_root)
        # served: the drafter's source ({"kind": "export" | "spot", ...}); None: SGLang's own
        self.core.drafters.served = {"kind": "export", "path": start_drafter} if start_drafter else None
        self.http: TLTHttpEngine | None = None
        self._in_flight = 0
        self._push_failed = False  # the last drafter push failed (event loop)
        self._calls: dict[str, _Call] = {}  # request id -> its call in flight (event loop)
        self._dropping = False  # tail batching dropped this round's requests (event loop)
        self._released = False    # TLT released the KV cache (and must resume it before serving)
        self._rollout_over = True  # between end_rollout and the next begin_step: no idle work
        self._gate = asyncio.Lock()  # memory and agent transitions, in request order
        self._idle_task: asyncio.Task | None = None
        self._coordinator, self._spot_base_port = coordinator, spot_base_port

    # ------------------------------------------------------------------ launch
    async def launch_server(self, master_address: str | None = None, master_port: int | None = None):
        if self._attach is not None:  # an SGLang server already running (launched with TLT's arguments)
            self._server_address, self._server_port = self._attach
        else:
            kw = dict(self.config.engine_kwargs.get("sglang") or {})
            ours = launch.server_args(self.cfg, version=launch.installed_version(), drafter_path=self.start_drafter,
                                      max_running_requests=int(self.config.get("max_num_seqs", 256) or 256))
            clash = {k: kw[k] for k in ours if k in kw and kw[k] != ours[k]}
            if clash:
                log.warning("replica %d: engine_kwargs.sglang %s replaced by TLT's %s", self.rank, clash,
                            {k: ours[k] for k in clash})
            self.config.engine_kwargs["sglang"] = {**kw, **ours}
            os.environ.pop("TLT_COORDINATOR", None)  # the plugin's scheduler-side idle signal stays off
            # verl builds ServerArgs here and SGLang resolves it (0.5.12: in ServerArgs(...), 0.5.23: in
            # resolve_once) before SGLang loads its plugins itself: load them first, so TLT's lossless
            # guard checks this server's arguments and the requests this process's tokenizer verifies
            from sglang.srt.plugins import load_plugins

            load_plugins()
            await super().launch_server(master_address, master_port)
        if self.node_rank != 0:
            return
        self.http = TLTHttpEngine(model_path=self.model_path, host=self._server_address, port=self._server_port,
                                  launch_server=False, device="cuda" if torch.cuda.is_available() else "cpu")
        if self._attach is not None:  # verl's own sleep/wake-up/abort calls, over HTTP
            self.tokenizer_manager = _HttpControl(self.http)
        train = self.cfg.drafter.train and self.eagle and self._coordinator and self._spot_base_port
        if train:
            self.core.start_agent(model=self.frozen, drafter_cfg=self.drafter_cfg, coordinator=self._coordinator,
                                  base_port=self._spot_base_port, device=self.device,
                                  warm_store=WarmStore())  # this replica's sessions resume from memory
        log.info("replica %d: SGLang at %s:%s (%s)", self.rank, self._server_address, self._server_port,
                 "attached" if self._attach else "launched")

    # ------------------------------------------------------------------ requests and the idle signal
    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data=None, video_data=None, **kwargs):
        if image_data or video_data:
            raise ValueError("TLT's SGLang replica serves text-only requests (image/video data given)")
        if self._dropping:  # tail batching dropped this round: nothing new starts
            return TokenOutput(token_ids=[], log_probs=[] if sampling_params.get("logprobs") else None,
                               stop_reason=DROPPED, extra_fields={"global_steps": self.global_steps})
        self._in_flight += 1
        call = self._calls[request_id] = _Call()
        try:
            async with self._gate:  # training stopped and the KV cache back before the server sees it
                if self._idle_task is not None:
                    self._idle_task.cancel()
                    self._idle_task = None
                await self._wake()
            if self._dropping or call.aborted:  # dropped or aborted at the gate: it never reaches SGLang
                return TokenOutput(token_ids=[], log_probs=[] if sampling_params.get("logprobs") else None,
                                   stop_reason=DROPPED if self._dropping else "aborted",
                                   extra_fields={"global_steps": self.global_steps})
            call.sent = True
            self.core.stats.resumed(time.monotonic())
            return await self._generate(request_id, list(prompt_ids), dict(sampling_params))
        finally:
            self._in_flight -= 1
            if self._calls.get(request_id) is call:
                del self._calls[request_id]
            if self._in_flight == 0:
                self.core.stats.went_idle()
                if not self._rollout_over and self.core.agent is not None:
                    self._idle_task = asyncio.get_running_loop().create_task(self._idle())

    async def _generate(self, request_id: str, prompt_ids: list[int], sp: dict[str, Any]):
        cfg = self.config
        room = cfg.max_model_len - len(prompt_ids) - 1
        if room < 0:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens exceeds max_model_len {cfg.max_model_len}")
        wanted = sp.pop("max_new_tokens", sp.pop("max_tokens", None))
        if wanted is None:
            wanted = min(cfg.response_length, cfg.prompt_length + cfg.response_length - len(prompt_ids))
        sp["max_new_tokens"] = max(0, min(int(wanted), room))
        if "seed" in sp:  # the tlt_agent loop's request seed, under SGLang's name
            sp["sampling_seed"] = sp.pop("seed")
        logprob = bool(sp.pop("logprobs", False))
        body = {"rid": request_id, "input_ids": prompt_ids, "sampling_params": sp, "return_logprob": logprob}
        out = await self.http._make_async_request("generate", body, timeout=GENERATE_TIMEOUT_S)
        meta = out.get("meta_info", {})
        tokens = list(out.get("output_ids", []))
        self.core.stats.request(tokens=len(tokens), verifies=int(meta.get("spec_verify_ct", 0) or 0), eagle=self.eagle)
        lps = [float(x[0]) for x in meta.get("output_token_logprobs") or []] if logprob else None
        reason = (meta.get("finish_reason") or {}).get("type")
        if reason == "abort":  # verl's name (its retry loop takes both); the partial output goes back
            reason = DROPPED if self._dropping else "aborted"
            if logprob and len(lps) < len(tokens):  # an abort may cut the log-probs short: keep what has one
                tokens = tokens[:len(lps)]
        if logprob and len(lps) != len(tokens):
            raise RuntimeError(f"request {request_id}: {len(lps)} log-probs for {len(tokens)} tokens")
        return TokenOutput(token_ids=tokens, log_probs=lps, stop_reason=reason,
                           extra_fields={"global_steps": self.global_steps})

    async def abort_request(self, request_id: str) -> dict[str, Any]:
        """Abort one request (SGLang's ``/abort_request``): its ``generate`` returns the tokens it has,
        with their log-probs, as ``aborted`` (verl's partial rollout resubmits it as prompt +
        partial output); one still waiting at the actor's gate returns, aborted and empty, when it
        passes the gate (it never reaches SGLang). An id not
        in flight answers ``aborted: False``. verl's ``abort_all_requests`` (pause with
        ``mode="abort"``) is unchanged."""
        call = self._calls.get(request_id)
        if self.http is None or call is None:
            return {"aborted": False, "request_id": request_id}
        call.aborted = True
        if call.sent:
            await self._abort_sent({request_id: call})
        return {"aborted": True, "request_id": request_id}

    async def _abort_sent(self, calls: dict[str, _Call]) -> None:
        """SGLang's ``/abort_request`` for each call, and once more for those still in flight after
        :data:`ABORT_RESEND_S` (only the same call: a later one may reuse the id)."""
        if not calls:
            return
        for rid in calls:
            await self.http.abort_request(rid=rid)
        await asyncio.sleep(ABORT_RESEND_S)
        for rid, call in calls.items():
            if self._calls.get(rid) is call:
                await self.http.abort_request(rid=rid)

    async def drop_requests(self) -> int:
        """Tail batching's drop: every request in flight is aborted (SGLang's ``/abort_request``) and
        returns its partial output with stop reason ``tlt_dropped`` (verl's client does not
        resubmit it); requests arriving until :meth:`resume_generation` return at once, dropped.
        Returns the requests dropped."""
        self._dropping = True
        calls = dict(self._calls)  # those not yet sent see the drop at the gate
        if self.http is not None:
            await self._abort_sent({rid: call for rid, call in calls.items() if call.sent})
        return len(calls)

    async def resume_generation(self) -> None:
        self._dropping = False
        await super().resume_generation()  # verl's own pause (abort_all_requests) is undone here too

    async def _idle(self) -> None:
        """0 requests in flight: release the KV cache, then report IDLE (if there is data to train on)."""
        await asyncio.sleep(self.cfg.engine.batch_window_ms / 1000)  # a request right behind the last one
        async with self._gate:
            # from here it runs to the end (never cancelled half-way through a release); a request
            # that arrives meanwhile waits for the gate and undoes it in _wake
            self._idle_task = None
            if self._in_flight or self._rollout_over or not len(self.core.buffer) or self._released:
                return
            await self._memory("release", ["kv_cache"])
            self._released = True
            await asyncio.to_thread(self.core.agent.idle, self.core.step)

    async def _wake(self) -> None:
        """(Under the gate.) Stop a training session (checkpointed), then take the KV cache back."""
        agent = self.core.agent
        if agent is not None and (self._released or agent.training):
            await asyncio.to_thread(agent.busy, self.core.step)
        if self._released:
            await self._memory("resume", ["kv_cache"])
            self._released = False

    async def _memory(self, what: str, tags: list[str]) -> None:
        log.debug("replica %d: %s_memory_occupation(%s)", self.rank, what, tags)
        if what == "release":
            await self.http.release_memory_occupation(tags)
        else:
            await self.http.resume_memory_occupation(tags)

    # ------------------------------------------------------------------ the loop's calls
    def begin_step(self, step: int) -> None:
        self.core.begin_step(step)
        self._rollout_over = False

    async def end_rollout(self) -> None:
        async with self._gate:
            self._rollout_over = True
            if self._idle_task is not None:
                self._idle_task.cancel()
                self._idle_task = None
            await self._wake()

    def step_stats(self) -> dict[str, Any]:
        return self.core.step_stats(proposer=f"sglang-{self.cfg.sglang.algorithm}", drift_top1=None)

    def update_weights(self, state: dict, version: int | None = None) -> int:
        """The spot sessions' frozen tensors from the policy push (the TP leader's adapter sends the
        embedding and LM head; the push itself went to the server's target only)."""
        embed = state.get("model.embed_tokens.weight")
        if embed is None:
            return 0
        head = state.get("lm_head.weight", embed)
        self.frozen.embed_weight, self.frozen.lm_head.weight = embed.to("cpu"), head.to("cpu")
        return len(state)

    async def load_drafter(self, version: int, step: int | None = None) -> int:
        """Spot checkpoint ``step`` pushed into the server's draft model (draft only) by the
        replica's actor workers, as ``version``."""
        source = {"kind": "spot", "root": self.spot_root, "step": step}
        drafters = self.core.drafters
        drafters.push(source if await self._push(source, version) else drafters.served, version)
        return version  # (not pushed: a rollback then restores the drafter before, not the one before it)

    async def rollback_drafter(self, version: int) -> int:
        drafters = self.core.drafters
        if drafters.previous is None or drafters.previous[0] is None:  # (SGLang's own drafter: no source to push)
            return drafters.version
        drafters.rollback(version)  # before the push's await: a push meanwhile follows this one
        source = drafters.served
        if await self._push(source, version):
            log.warning("replica %d: drafter rolled back (%s)", self.rank, source)
        return version

    async def _push(self, source: dict, version: int) -> bool:
        """Every actor worker of this replica takes part (the push is SPMD over its TP ranks).
        False where it failed (SGLang refused a call, the checkpoint could not be read): the RL step
        goes on, since a drafter is only ever a matter of speed. What the draft model holds is then
        unknown (a push can fail between buckets), so the read-back reports no drafter until a push
        succeeds: the push guard rejects this one, and the next step's re-check pushes the accepted
        drafter again."""
        try:
            await asyncio.gather(*[_worker_method(w, "tlt_push_drafter").remote(
                source, version, self.drafter_cfg, str(self._dtype())) for w in self.workers])
        except Exception:  # noqa: BLE001 - logged; the guard's read-back sees it
            log.exception("replica %d: drafter version %d (%s) not pushed", self.rank, version, source)
            self._push_failed = True
            return False
        self._push_failed = False
        return True

    async def served_drafter(self) -> dict[str, Any]:
        """The hard check's read-back: digest of the first elements of the draft ``fc`` weight."""
        n = self.cfg.sglang.readback_elements
        got = None if self._push_failed else await self.http._make_async_request(
            "get_weights_by_name", {"name": f"tlt.draft/{CANARY['served']}", "truncate_size": n})
        digest = None  # no draft model, no such weight in it, or part of a failed push
        if isinstance(got, list) and got:
            values = torch.tensor(got, dtype=torch.float32).flatten()[:n]
            digest = weights_digest([(CANARY["pushed"], values)], torch.float32)
        return {"digest": digest, "dtype": str(self._dtype()), "canary": {"name": CANARY["pushed"], "elements": n}}

    def _dtype(self) -> torch.dtype:
        return getattr(torch, str(self.config.dtype).removeprefix("torch."), torch.bfloat16)

    def tuner_state(self) -> dict[str, Any] | None:
        return None  # SGLang chooses its own speculation settings

    def load_tuner_state(self, state: dict[str, Any] | None) -> bool:
        return False

    def add_samples(self, step: int, samples: list[tuple]) -> int:
        """Features captured by this replica's actor worker (``tlt.buffer.capture=old_log_prob``)."""
        return self.core.add_samples(step, samples)

    async def add_history(self, step: int, pairs: list[tuple[list[int], list[int]]]) -> int:
        """NGRAM runs: step ``step``'s responses become the server's external corpus (global to the
        server, not per prompt, in both versions); EAGLE runs keep no history on SGLang (0)."""
        if self.eagle or not pairs or not self.cfg.speculation.history_visits:  # (0: no corpus)
            return 0
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.model_path)
        docs = [tok.decode(r) for _, r in pairs if r]
        return await self.http.rotate_corpus(step, docs, window=max(1, self.cfg.speculation.history_visits))

    def shutdown(self) -> None:
        self.core.shutdown()


def _worker_method(handle, name: str):
    """A method of TLT's actor worker class on verl's worker actor: colocated roles share one
    ``WorkerDict`` actor whose methods carry the role as prefix (verl's ``Role`` strings)."""
    for prefix in ("actor_rollout_ref_", "actor_rollout_", "actor_", ""):
        try:
            return getattr(handle, prefix + name)
        except AttributeError:
            continue
    raise AttributeError(f"the replica's worker actor has no {name} (is it TLT's actor worker class?)")


class _HttpControl:
    """The tokenizer-manager calls verl's ``SGLangHttpServer`` makes (sleep, wake-up, cache flush,
    abort / resume), sent to an attached server's HTTP endpoints instead of an in-process manager."""

    def __init__(self, http: TLTHttpEngine) -> None:
        self.http = http

    async def release_memory_occupation(self, obj, request=None):
        return await self.http.release_memory_occupation(list(obj.tags) if obj.tags else None)

    async def resume_memory_occupation(self, obj, request=None):
        return await self.http.resume_memory_occupation(list(obj.tags) if obj.tags else None)

    async def flush_cache(self):
        return await self.http.flush_cache()

    async def pause_generation(self, obj):
        return await self.http._make_async_request("pause_generation", {"mode": obj.mode})

    async def continue_generation(self, obj):
        return await self.http.continue_generation()


class _WithTLT:
    """verl's ``server_class`` handle, constructing the actor with TLT's keyword arguments too."""

    def __init__(self, actor_cls, extra) -> None:
        self.actor_cls, self.extra = actor_cls, extra

    def options(self, **opts):
        env = {k: v for k, v in os.environ.items() if k.startswith(("VERL_", "TLT_"))}
        renv = dict(opts.get("runtime_env") or {})
        renv["env_vars"] = {**env, **dict(renv.get("env_vars") or {})}
        handle = self.actor_cls.options(**{**opts, "runtime_env": renv})
        return types.SimpleNamespace(remote=lambda **kw: handle.remote(**kw, **self.extra(kw["replica_rank"])))


class TLTSGLangReplica(SGLangReplica):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.server_class = _WithTLT(ray.remote(TLTSGLangServer), self._tlt_kwargs)

    def _tlt_kwargs(self, replica_rank: int) -> dict[str, Any]:
        from tlt.integrations.verl import runtime

        rt = runtime.current()
        attach = rt.tlt.sglang.attached()[replica_rank] if rt.tlt.sglang.attach else None
        return {"tlt": rt.tlt.to_dict(), "coordinator": rt.coordinator_address, "spot_root": rt.spot_root,
                "spot_base_port": rt.spot_base_port, "seed": rt.seed, "start_drafter": rt.start_drafter,
                "attach": attach}

    async def launch_servers(self):
        from tlt.integrations.verl import runtime

        if not runtime.current().tlt.sglang.attach:
            return await super().launch_servers()
        # attached: no GPU of this replica runs SGLang, so verl's device bookkeeping is skipped
        node_id = await self.workers[0].__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
        server = self.server_class.options(
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            name=replica_actor_name("sglang", self.replica_rank), max_concurrency=self.max_concurrency,
        ).remote(config=self.config, model_config=self.model_config, rollout_mode=self.rollout_mode,
                 workers=self.workers[:self.gpus_per_replica_node], replica_rank=self.replica_rank, node_rank=0,
                 nnodes=1, cuda_visible_devices="", base_gpu_id=0)
        self.servers = [server]
        await server.launch_server.remote()
        host, port = await server.get_server_address.remote()
        self._server_handle, self._server_address = server, f"{host}:{port}"

