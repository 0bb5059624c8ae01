"""verl's SGLang rollout with TLT's weight pushes (GPU clusters; SGLang 0.5.12 and 0.5.23).

Owns the actor-side push into stock SGLang servers: policy pushes that never touch the drafter,
and draft-only pushes of a new drafter. Registered by the plugin as verl's ``("sglang", "async")``
rollout adapter, so any verl run with ``rollout.name=sglang`` gets target-only policy pushes once
TLT is installed (without a draft model they are exactly verl's pushes).

Why: stock verl 0.9.1 posts ``update_weights_from_tensor`` with only ``serialized_named_tensors``,
``load_format`` and ``flush_cache``. With an EAGLE draft model loaded, SGLang hands such an update
to its draft worker, which loads the tensors into the draft model (its layer 0 shares names with
the target's) and then into the target. What each version offers:

=================  ==========================================  =========================================
push               SGLang 0.5.12                               SGLang 0.5.23
=================  ==========================================  =========================================
policy (target)    ``disable_draft_model: true``               ``selector: "target"`` inside
                                                               ``begin_weight_update(selector="target")``
                                                               ... ``end_weight_update``
draft only         ``load_format`` = :data:`DRAFT_LOADER`      ``pause_generation(mode="in_place")`` ->
                   (server launched with                       ``begin_weight_update(selector="draft")``
                   ``--custom-weight-loader DRAFT_LOADER``)    -> ``selector: "draft"`` ->
                                                               ``end_weight_update`` ->
                                                               ``continue_generation``
=================  ==========================================  =========================================

Which column applies is read from the installed SGLang's own request classes (:func:`push_api`),
not from its version string; an SGLang with neither field is refused (a push would reach the
drafter). A call the server refuses fails the push at the TP leader only after every rank is
through the push's gathers, and a paused server is always told to continue.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import logging
from typing import Any

from verl.workers.rollout.sglang_rollout import sglang_rollout as _sglang_rollout
from verl.workers.rollout.sglang_rollout.http_server_engine import AsyncHttpServerAdapter
from verl.workers.rollout.sglang_rollout.sglang_rollout import ServerAdapter

from tlt.integrations.sglang.launch import DRAFT_LOADER

FROZEN = ("model.embed_tokens.weight", "lm_head.weight")  # what a tlt run's spot sessions train against
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PushAPI:
    """What the installed SGLang's weight-update requests support."""

    version: str
    selector: bool        # UpdateWeightsFromTensorReqInput.selector (0.5.23)
    disable_draft: bool   # UpdateWeightsFromTensorReqInput.disable_draft_model (0.5.12)
    sessions: bool        # begin_weight_update / end_weight_update exist (0.5.23)

    def policy_fields(self) -> dict[str, Any]:
        """Extra request fields that keep a policy push out of the draft model."""
        if self.selector:
            return {"selector": "target"}
        if self.disable_draft:
            return {"disable_draft_model": True}
        raise RuntimeError(f"SGLang {self.version}: update_weights_from_tensor has neither `selector` nor "
                           "`disable_draft_model`; TLT cannot push the policy without touching the "
                           "drafter (supported: SGLang 0.5.12, 0.5.23)")


def request_fields(cls) -> tuple[str, ...]:
    """Field names of an SGLang request class (a dataclass in 0.5.12, a msgspec Struct in 0.5.23)."""
    if dataclasses.is_dataclass(cls):
        return tuple(f.name for f in dataclasses.fields(cls))
    return tuple(getattr(cls, "__struct_fields__", ()))


def push_api() -> PushAPI:
    import sglang
    from sglang.srt.managers import io_struct

    fields = request_fields(io_struct.UpdateWeightsFromTensorReqInput)
    return PushAPI(version=getattr(sglang, "__version__", "?"), selector="selector" in fields,
                   disable_draft="disable_draft_model" in fields,
                   sessions=hasattr(io_struct, "BeginWeightUpdateReqInput"))


class TLTHttpEngine(AsyncHttpServerAdapter):
    """verl's HTTP client of one SGLang server: every ``update_weights_from_tensor`` carries TLT's
    fields (target-only unless told otherwise), plus the session / pause calls verl 0.9.1 never
    makes. (SGLang 0.5.23 declares ``begin_weight_update`` / ``end_weight_update`` abstract, so
    verl 0.9.1's own client cannot even be constructed against it.)"""

    @functools.cached_property
    def api(self) -> PushAPI:
        return push_api()

    async def update_weights_from_tensor(self, req, fields: dict[str, Any] | None = None) -> dict[str, Any]:
        extra = self.api.policy_fields() if fields is None else fields
        payload = {"serialized_named_tensors": [base64.b64encode(t).decode("utf-8")
                                                for t in req.serialized_named_tensors],
                   "load_format": req.load_format, "flush_cache": req.flush_cache, **extra}
        return await self._make_async_request("update_weights_from_tensor", payload)

    async def begin_weight_update(self, selector: str = "all") -> dict[str, Any]:
        return await self._make_async_request("begin_weight_update", {"selector": selector})

    async def end_weight_update(self) -> dict[str, Any]:
        return await self._make_async_request("end_weight_update", {})

    async def pause_generation(self) -> dict[str, Any]:
        return await self._make_async_request("pause_generation", {"mode": "in_place"})

    async def continue_generation(self) -> dict[str, Any]:
        return await self._make_async_request("continue_generation", {})

    async def add_external_corpus(self, corpus_id: str, documents: list[str]) -> dict[str, Any]:
        return await self._make_async_request("add_external_corpus", {"corpus_id": corpus_id, "documents": documents})

    async def remove_external_corpus(self, corpus_id: str) -> dict[str, Any]:
        return await self._make_async_request("remove_external_corpus", {"corpus_id": corpus_id})

    async def rotate_corpus(self, step: int, documents: list[str], window: int = 1) -> int:
        """NGRAM speculation's history: step ``step``'s responses become external corpus
        ``tlt-step-<step>`` and the one that left the last ``window`` steps goes. SGLang's external
        corpora are global to the server (matched for every request, not per prompt: both 0.5.12
        and 0.5.23); its n-gram trie already holds the running requests' tokens, so GRPO siblings
        draft from each other. Returns the documents added."""
        if window < 1:
            raise ValueError(f"rotate_corpus: window={window} must be >= 1 (steps of responses kept)")
        docs = [d for d in documents if d]
        if docs:
            await self.add_external_corpus(f"tlt-step-{step}", docs)
        if step - window >= 0:
            await self.remove_external_corpus(f"tlt-step-{step - window}")
        return len(docs)


class _LeaderEngine:
    """The TP leader's engine during one push, as SGLang's and verl's push loops call it. A push is
    SPMD over the replica's TP ranks (every bucket is first gathered to the leader), so the leader
    never raises inside it, or the other ranks would wait in the gather for good: its first failure
    is kept, its later calls are skipped, and :meth:`raise_failure` raises once every rank is through.
    ``fields``: what each ``update_weights_from_tensor`` carries (None: the policy's)."""

    def __init__(self, engine: TLTHttpEngine, fields: dict[str, Any] | None = None) -> None:
        self.engine, self.fields = engine, fields
        self.failed: tuple[str, Exception] | None = None

    async def call(self, name: str, *args) -> Any:
        if self.failed is None:
            try:
                return await getattr(self.engine, name)(*args)
            except Exception as e:  # noqa: BLE001 - raised by raise_failure, after the collectives
                self.failed = (name, e)
        return {}

    async def update_weights_from_tensor(self, req) -> dict[str, Any]:
        return await self.call("update_weights_from_tensor", req, self.fields)

    async def flush_cache(self) -> dict[str, Any]:
        return await self.call("flush_cache")

    def raise_failure(self, what: str) -> None:
        if self.failed is not None:
            name, e = self.failed
            raise RuntimeError(f"{what}: {name} failed ({type(e).__name__}: {e})") from e


# verl's ServerAdapter builds its HTTP client by this module-level name; TLT's adapter replaces
# verl's SGLang adapter in the registry, so every client built in this process is TLT's.
_sglang_rollout.AsyncHttpServerAdapter = TLTHttpEngine


class TLTSGLangServerAdapter(ServerAdapter):
    """verl's SGLang ``ServerAdapter`` (one per actor worker) whose pushes are TLT's."""

    def _leads_pushes(self) -> bool:
        return self._engine is not None and self._is_server_tp_leader()

    async def update_weights(self, weights, global_steps: int = None, **kwargs):
        """The policy, into the target only (every rank iterates ``weights``, as verl requires).
        The TP leader then hands the embedding and LM head to its server actor: a ``tlt`` run's
        spot sessions train against the current policy's (:mod:`.sglang_server`)."""
        await self._init_server_adapter()
        lead = self._leads_pushes()
        session = lead and self._engine.api.sessions
        frozen: dict = {}

        def tee(items):
            for name, t in items:
                if lead and name in FROZEN:
                    frozen[name] = t.detach().to("cpu", copy=True)
                yield name, t

        own = self._engine
        leader = _LeaderEngine(own) if lead else None
        opened = False
        if session:
            await leader.call("begin_weight_update", "target")
            opened = leader.failed is None
        if lead:
            self._engine = leader  # verl's loop posts (and flushes) through it
        try:
            await super().update_weights(tee(weights), global_steps=global_steps, **kwargs)
        finally:
            self._engine = own
            if opened:
                await own.end_weight_update()
        if lead:
            leader.raise_failure(f"replica {self.replica_rank}: policy push (step {global_steps}) not applied")
        actor = getattr(self, "server_actor", None)
        if frozen and hasattr(actor, "update_weights"):  # TLT's server actor (a tlt run)
            await actor.update_weights.remote(frozen, global_steps)

    async def update_draft_weights(self, weights, version: int) -> None:
        """A new drafter (SGLang draft-model names), into the draft model only, labelled
        ``draft-<version>``. SPMD over the replica's TP ranks like the policy push; the tensors must
        be on this rank's device (CUDA IPC)."""
        from sglang.srt.weight_sync.utils import update_weights as sgl_update_weights

        await self._init_server_adapter()
        lead = self._leads_pushes()
        api = push_api()
        if api.selector:
            fields, load_format = {"selector": "draft"}, None
        else:
            fields, load_format = {}, DRAFT_LOADER  # 0.5.12: the loader skips the target model
        leader = _LeaderEngine(self._engine, {**fields, "weight_version": f"draft-{version}"}) if lead else None
        paused = lead and api.sessions
        opened = False
        if paused:
            await leader.call("pause_generation")
            await leader.call("begin_weight_update", "draft")
            opened = leader.failed is None
        try:
            await sgl_update_weights(engine=leader, params_batch=list(weights), device_mesh_key="infer_tp",
                                     device_mesh=self.device_mesh, load_format=load_format)
        finally:
            if paused:  # generation goes on whatever failed
                try:
                    if opened:
                        await self._engine.end_weight_update()
                finally:
                    await self._engine.continue_generation()
        if lead:
            leader.raise_failure(f"replica {self.replica_rank}: drafter version {version} not pushed")
            log.info("replica %s: drafter version %d pushed (%s)", self.replica_rank, version,
                     "selector=draft" if api.selector else DRAFT_LOADER)
