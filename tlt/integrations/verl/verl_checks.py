"""Checks that refuse a TLT run before anything starts, shared by the plugin and the trainer.

Owns :func:`check_verl_config` (verl settings TLT cannot work with, as one-line ValueErrors; the
plugin's ``validate_config`` wrapper runs it in the driver, the trainer again in its process) and
the plugin's registration outcome (:func:`registration_failed`, :func:`raise_if_registration_failed`:
verl only DEBUG-logs a plugin that fails, so the ``tlt`` trainer refuses to start instead). It
imports neither the plugin nor the trainer, which both import it.
"""

from __future__ import annotations

from pathlib import Path

from tlt.integrations.verl.config import PORT_SPAN, TLTConfig

_failure: str | None = None


def registration_failed(traceback_text: str) -> None:
    global _failure
    _failure = traceback_text


def raise_if_registration_failed() -> None:
    if _failure is not None:
        raise RuntimeError(f"TLT's verl plugin failed to register; the tlt trainer cannot run:\n{_failure}")


def check_verl_config(config, tlt: TLTConfig) -> None:
    """verl settings TLT cannot work with, as one-line ValueErrors (before any worker starts)."""
    from omegaconf import OmegaConf

    if not tlt.enable:
        return
    ro = config.actor_rollout_ref.rollout
    if ro.name not in ("tlt", "sglang"):
        raise ValueError(f"actor_rollout_ref.rollout.name={ro.name!r}: TLT's verl mode serves rollouts with "
                         "its own engine (tlt) or SGLang (sglang)")
    if ro.name == "sglang":
        _check_sglang(config, tlt)
    else:
        _check_memory(config, tlt)
        if tlt.drafter.train and not tlt.speculation.enable:
            raise ValueError("tlt.speculation.enable=false with tlt.drafter.train=true: plain decoding serves no "
                             "drafter, so every spot-trained one would be refused at its push; set "
                             "tlt.drafter.train=false (and tlt.buffer.capture=off), or speculate")
    if tlt.tail.consolidate.mode != "off":
        _check_moves(config, tlt)
    if tlt.tail.batching.enable:
        _check_batching(config, tlt)
    backend = ro.checkpoint_engine.backend
    if backend != "naive":
        raise ValueError(f"actor_rollout_ref.rollout.checkpoint_engine.backend={backend!r}: the tlt rollout "
                         "takes the colocated (naive) weight sync; set it to naive")
    sp = config.actor_rollout_ref.get("actor", {}).get("ulysses_sequence_parallel_size", 1) or 1
    if int(sp) > 1:
        raise ValueError(f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}: hidden-state "
                         "capture needs whole sequences per rank; use 1")
    sync_step = OmegaConf.select(config, "trainer.v1.tlt.parameter_sync_step", default=1)
    if sync_step != 1:
        raise ValueError(f"trainer.v1.tlt.parameter_sync_step={sync_step}: TLT's rollout hooks assume one "
                         "rollout per RL step; use 1")
    lora = (OmegaConf.select(config, "actor_rollout_ref.model.lora.rank", default=0)
            or OmegaConf.select(config, "actor_rollout_ref.model.lora_rank", default=0))
    if lora:
        raise ValueError(f"actor_rollout_ref.model.lora rank {lora}: the tlt rollout takes merged full "
                         "weights only; train without LoRA")
    if tlt.drafter.train and tlt.buffer.capture == "off":
        raise ValueError("tlt.drafter.train=true with tlt.buffer.capture=off: spot training would get no hidden "
                         "states and never run; use tlt.buffer.capture=rollout or old_log_prob, or "
                         "tlt.drafter.train=false")
    if tlt.drafter.train and tlt.spot.base_port:
        replicas = max(1, config.trainer.n_gpus_per_node * config.trainer.nnodes)
        top = tlt.spot.base_port + PORT_SPAN * replicas - 1
        if top > 65535:
            most = 65536 - PORT_SPAN * replicas
            fix = f"use at most {most} (or 0: automatic)" if most >= 1024 else "no base port fits so many replicas"
            raise ValueError(f"tlt.spot.base_port={tlt.spot.base_port}: up to {replicas} replicas take {PORT_SPAN} "
                             f"ports each, up to {top} > 65535; {fix}")
    bypass = OmegaConf.select(config, "algorithm.rollout_correction.bypass_mode", default=False)
    if bypass and tlt.drafter.train and tlt.buffer.capture == "old_log_prob":
        raise ValueError("algorithm.rollout_correction.bypass_mode=true skips the old-log-prob forward, "
                         "where tlt.buffer.capture=old_log_prob captures hidden states; use tlt.buffer.capture="
                         "rollout or turn bypass off")


def _check_sglang(config, tlt: TLTConfig) -> None:
    """What an SGLang-served TLT run needs (docs/sglang.md, "TLT in verl on SGLang")."""
    from omegaconf import OmegaConf

    from tlt.integrations.sglang import launch

    launch.plan(tlt, launch.installed_version())  # raises with the fix
    if tlt.drafter.train and tlt.sglang.algorithm == "eagle" and tlt.buffer.capture == "rollout":
        raise ValueError("tlt.buffer.capture=rollout: SGLang servers do not hand out hidden states; use "
                         "tlt.buffer.capture=old_log_prob (the actor's old-log-prob forward feeds the DataBuffer)")
    if OmegaConf.select(config, "actor_rollout_ref.rollout.disaggregation.enabled", default=False):
        raise ValueError("actor_rollout_ref.rollout.disaggregation.enabled=true: TLT drives one SGLang server "
                         "per replica; turn PD disaggregation off")
    if int(OmegaConf.select(config, "actor_rollout_ref.rollout.nnodes", default=0) or 0) > 0:
        raise ValueError("actor_rollout_ref.rollout.nnodes>0 (standalone rollout): TLT's SGLang loop runs "
                         "colocated (hybrid) replicas; leave nnodes at 0")
    if tlt.sglang.attach:
        n = max(1, config.trainer.n_gpus_per_node * config.trainer.nnodes)
        tp = _replica_world(config.actor_rollout_ref.rollout)
        replicas = max(1, n // tp)
        if len(tlt.sglang.attached()) != replicas:
            raise ValueError(f"tlt.sglang.attach={tlt.sglang.attach!r} names {len(tlt.sglang.attached())} servers "
                             f"for {replicas} replicas; give one HOST:PORT per replica")


def _check_memory(config, tlt: TLTConfig) -> None:
    """verl's rollout settings the project's engine honours (``max_num_seqs``, and with a paged cache
    ``gpu_memory_utilization``), and a pool that holds one whole request."""
    ro, eng = config.actor_rollout_ref.rollout, tlt.engine
    seqs = ro.get("max_num_seqs")
    if seqs is not None and int(seqs) < 1:
        raise ValueError(f"actor_rollout_ref.rollout.max_num_seqs={seqs}: a replica decodes at least one request; "
                         "use an int >= 1")
    util = ro.get("gpu_memory_utilization")
    if eng.block_size is not None and eng.kv_blocks is None and util is not None and not 0 < float(util) <= 1:
        raise ValueError(f"actor_rollout_ref.rollout.gpu_memory_utilization={util}: sizes tlt.engine's paged cache "
                         "on a GPU as a share of its memory; use a fraction in (0, 1] (or set tlt.engine.kv_blocks)")
    if eng.kv_blocks is not None:
        positions = int(ro.prompt_length) + int(ro.response_length) + 1 + tlt.speculation.max_draft_tokens
        need = -(-positions // eng.block_size)
        if eng.kv_blocks < need:
            raise ValueError(f"tlt.engine.kv_blocks={eng.kv_blocks}: one request of prompt_length {ro.prompt_length} "
                             f"+ response_length {ro.response_length} + a draft of "
                             f"{tlt.speculation.max_draft_tokens} needs {need} blocks of {eng.block_size} positions; "
                             f"use at least {need}")


def _check_moves(config, tlt: TLTConfig) -> None:
    """What moving requests between replicas needs (tlt.integrations.verl.moves)."""
    ro = config.actor_rollout_ref.rollout
    mode = tlt.tail.consolidate.mode
    if ro.name != "tlt":
        raise ValueError(f"tlt.tail.consolidate.mode={mode}: requests move between replicas of the project's "
                         f"engine only (actor_rollout_ref.rollout.name=tlt, not {ro.name}); set mode=off")
    router = ro.get("router_config_path")
    if not tlt.route_groups or (router and Path(router).name != "tlt_router.yaml"):
        raise ValueError(f"tlt.tail.consolidate.mode={mode}: a moved request is routed to its destination by "
                         "TLT's router; set tlt.route_groups=true and leave actor_rollout_ref.rollout."
                         "router_config_path unset")
    agent = ro.get("agent", {}).get("default_agent_loop")
    if agent != "tlt_agent":
        raise ValueError(f"tlt.tail.consolidate.mode={mode}: verl's client follows a moved request only in "
                         f"TLT's agent loop; set actor_rollout_ref.rollout.agent.default_agent_loop=tlt_agent "
                         f"(it is {agent!r})")


def _check_batching(config, tlt: TLTConfig) -> None:
    """What tail batching needs (tlt.integrations.verl.tail_batching)."""
    from omegaconf import OmegaConf

    p0 = int(config.data.train_batch_size)
    gen = OmegaConf.select(config, "data.gen_batch_size", default=None)
    if gen is not None and int(gen) != p0:
        raise ValueError(f"data.gen_batch_size={gen}: tail batching draws its rounds from whole training batches; "
                         f"leave it unset or set it to data.train_batch_size ({p0})")
    at = tlt.tail.batching.long_round_at
    if at and at < p0:
        raise ValueError(f"tlt.tail.batching.long_round_at={at}: a long round trains data.train_batch_size ({p0}) "
                         f"queued prompts; use 0 or a count >= {p0}")
    if OmegaConf.select(config, "trainer.v1.sampler.sync_refill_failed_groups", default=False):
        raise ValueError("trainer.v1.sampler.sync_refill_failed_groups=true: verl then refills with fresh prompts "
                         "one at a time, outside tail batching's rounds and epochs; set it to false")
    if OmegaConf.select(config, "algorithm.filter_groups.enable", default=False):
        raise ValueError("algorithm.filter_groups.enable=true: DAPO's group filter and tail batching both decide "
                         "which groups a step trains; turn one of them off")
    agent = config.actor_rollout_ref.rollout.get("agent", {}).get("default_agent_loop")
    if agent != "tlt_agent":
        raise ValueError("tlt.tail.batching.enable=true: the tlt_agent loop reports which responses finished and "
                         "which were dropped; set actor_rollout_ref.rollout.agent.default_agent_loop=tlt_agent "
                         f"(it is {agent!r})")


def _replica_world(rollout) -> int:
    """GPUs (or CPU ranks) of one rollout replica: tensor x data x pipeline parallel."""
    return (int(rollout.tensor_model_parallel_size) * int(rollout.get("data_parallel_size", 1) or 1)
            * int(rollout.get("pipeline_model_parallel_size", 1) or 1))
