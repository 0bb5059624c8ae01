"""Checks that refuse a TLT run before anything starts, shared by the plugin and the trainer.

Owns :func:`check_verl_config` (verl settings TLT cannot work with, as one-line ValueErrors; the
plugin's ``validate_config`` wrapper runs it in the driver, the trainer again in its process) and
the plugin's registration outcome (:func:`registration_failed`, :func:`raise_if_registration_failed`:
verl only DEBUG-logs a plugin that fails, so the ``tlt`` trainer refuses to start instead). It
imports neither the plugin nor the trainer, which both import it.
"""

from __future__ import annotations

from tlt.integrations.verl.config import TLTConfig

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
    if ro.name != "tlt":
        raise ValueError(f"actor_rollout_ref.rollout.name={ro.name!r}: TLT's verl mode serves rollouts with "
                         "its own engine; set actor_rollout_ref.rollout.name=tlt")
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
    bypass = OmegaConf.select(config, "algorithm.rollout_correction.bypass_mode", default=False)
    if bypass and tlt.drafter.train and tlt.buffer.capture == "old_log_prob":
        raise ValueError("algorithm.rollout_correction.bypass_mode=true skips the old-log-prob forward, "
                         "where tlt.buffer.capture=old_log_prob captures hidden states; use tlt.buffer.capture="
                         "rollout or turn bypass off")
