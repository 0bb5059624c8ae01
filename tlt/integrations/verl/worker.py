"""Actor worker subclass: captures target hidden states during the old-log-prob forward only.

Owns :class:`TLTActorRolloutRefWorker` (swapped in for verl's ``ActorRolloutRefWorker`` by the
TLT trainer). ``tlt_arm_capture(step, aux_layers)`` arms the actor's next ``infer_batch`` (the
trainer calls it right before the old-log-prob stage, never before the reference model or
validation); that forward runs with hooks on the actor's HF model and a wrapper that remembers
each micro-batch, and every sequence this rank computed goes as a drafter sample to the
DataBuffer of this rank's rollout replica. verl's own methods are not overridden.

verl is imported at this module's top: the trainer imports it when it builds its workers, after
``import verl`` ran. The class exists only in runs with TLT on (the tlt trainer swaps it in), so it is also where verl's
``sglang`` rollout gets TLT's adapter (:data:`SGLANG_ADAPTER`: policy pushes that never reach a
draft model): installed in this worker process when the worker is built, never at ``import verl``.
"""

from __future__ import annotations

import logging
import os
import time

import ray
from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.rollout import base

from tlt.integrations.verl.capture import HiddenCapture, micro_batch_samples
from tlt.integrations.verl.server import replica_actor_name, replica_of_this_rank

log = logging.getLogger(__name__)
SGLANG_ADAPTER = "tlt.integrations.verl.sglang_push.TLTSGLangServerAdapter"


def worker_class() -> type:
    """The actor worker class the ``tlt`` trainer swaps in for verl's."""
    return TLTActorRolloutRefWorker


class TLTActorRolloutRefWorker(ActorRolloutRefWorker):
    def __init__(self, *args, **kwargs):
        # verl's SGLang rollout, with policy pushes that never reach a draft model (this run has TLT on)
        base._ROLLOUT_REGISTRY[("sglang", "async")] = SGLANG_ADAPTER
        super().__init__(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tlt_arm_capture(self, step: int, aux_layers: list[int] | None = None) -> bool:
        """The next actor ``infer_batch`` (the old-log-prob forward) captures hidden states."""
        actor = self.actor
        original = type(actor).infer_batch.__get__(actor)

        def infer_batch(data):
            del actor.infer_batch  # one call only: the instance attribute shadows the method
            return self._tlt_capture(original, data, int(step), tuple(aux_layers or ()))

        actor.infer_batch = infer_batch
        return True

    def _tlt_capture(self, infer, data, step: int, aux_layers: tuple[int, ...]):
        engine = self.actor.engine
        cap = HiddenCapture(engine.module, aux_layers)
        batches = []
        prepare = engine.prepare_model_inputs

        def remember(micro_batch):
            batches.append(micro_batch)
            return prepare(micro_batch)

        engine.prepare_model_inputs = remember
        try:
            with cap.active():
                out = infer(data)
        finally:
            del engine.prepare_model_inputs
        t0 = time.monotonic()
        packed = bool(self.config.model.get("use_remove_padding", False))
        samples = []
        for k, mb in enumerate(batches):
            hidden, aux = cap.features(k)
            samples += micro_batch_samples(mb, hidden, aux, packed)
        self._tlt_ship(step, samples)
        log.info("tlt: rank %s captured %d sequences for step %d (%.2fs)", os.environ.get("RANK"),
                 len(samples), step, time.monotonic() - t0)
        return out

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def tlt_push_drafter(self, source: dict, version: int, drafter_cfg, dtype: str) -> bool:
        """SGLang replicas: a drafter (spot checkpoint step or exported directory) into this rank's
        server's draft model only, through TLT's draft-only adapter (every rank of the replica
        calls this: the push is SPMD over its TP ranks; the tensors go from this rank's device)."""
        import torch

        from tlt.integrations.verl.sglang_drafts import source_tensors

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        tensors = source_tensors(source, drafter_cfg, getattr(torch, dtype.removeprefix("torch.")))
        await self.rollout.update_draft_weights(((k, v.to(device)) for k, v in tensors.items()), version)
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tlt_dropped_feeds(self) -> int:
        """Captured batches this rank could not hand to its replica, so far (the trainer's metric)."""
        return getattr(self, "_tlt_dropped", 0)

    def _tlt_ship(self, step: int, samples) -> None:
        replica, _ = replica_of_this_rank(self.config.rollout)
        try:
            server = ray.get_actor(replica_actor_name(self.config.rollout.name, replica))
            ray.get(server.add_samples.remote(step, samples))
        except Exception:  # adaptation is an optimisation: the RL step goes on without it, counted
            self._tlt_dropped = getattr(self, "_tlt_dropped", 0) + 1
            log.exception("tlt: could not hand %d samples to replica %d (%d batches dropped so far)",
                          len(samples), replica, self._tlt_dropped)
