"""TLT's verl-side SGLang pushes against one installed SGLang version (run in its own process).

``python -m tests.sglang_env.push_check SITE_DIR OUT_JSON`` (SITE_DIR from install.sh). A live
SGLang server needs CUDA, so a real HTTP server on 127.0.0.1 stands in for it: it records each
request and parses its body into SGLang's own request class for that endpoint (an unknown field or
a bad value fails there). verl's real ``AsyncHttpServerAdapter`` / ``ServerAdapter`` code paths
send the requests (a 1-rank gloo group plays the replica's TP group). Checked here, per version:

- policy push (``TLTSGLangServerAdapter.update_weights``): every ``update_weights_from_tensor``
  is target-only (0.5.12 ``disable_draft_model``, 0.5.23 ``selector="target"`` inside
  ``begin_weight_update`` / ``end_weight_update``), and carries exactly the tensors pushed;
- draft push (``update_draft_weights``): 0.5.12 names TLT's draft-only loader as ``load_format``,
  0.5.23 pauses in place and uses ``selector="draft"``; both label ``draft-<version>``;
- the draft-only loader loads into SGLang's EAGLE draft model class and leaves the target alone.

Writes what it saw to OUT_JSON; any failed check raises (non-zero exit).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import types

from tests.sglang_env import cpu_env
from tests.sglang_env.bodies import parse as _parse
from tests.sglang_env.bodies import tensors as _tensors


async def _serve(calls: list, fail: str | None = None):
    """The recording stand-in on a free port; ``fail``: an endpoint it answers with SGLang's 400."""
    from aiohttp import web

    async def handle(request):
        body = await request.json() if request.can_read_body else {}
        endpoint = request.path.strip("/")
        _parse(endpoint, body)
        calls.append((endpoint, body))
        if endpoint == fail:
            return web.json_response({"success": False, "message": "a weight-update session is already open"},
                                     status=400)
        return web.json_response({"success": True, "message": "ok"})

    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)  # the kernel picks the port: no race with other tests
    await site.start()
    return runner, runner.addresses[0][1]


def _adapter(port: int | None, model_path: str, tp: int = 1, bucket_mb: int = 64):
    """TLT's ServerAdapter as one actor worker of a ``tp``-rank replica sees it: the TP leader talks
    to ``port``; another rank (``port`` None) has no server client."""
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh

    from tlt.integrations.verl.sglang_push import TLTHttpEngine, TLTSGLangServerAdapter

    a = object.__new__(TLTSGLangServerAdapter)  # verl's __init__ needs a Ray cluster and a GPU
    a.config = OmegaConf.create({"checkpoint_engine": {"update_weights_bucket_megabytes": bucket_mb},
                                 "quantization": None})
    a.model_config = OmegaConf.create({"hf_config": {"model_type": "llama"}})
    a.device_mesh = init_device_mesh("cpu", (1, tp, 1), mesh_dim_names=("dp", "infer_tp", "infer_pp"))
    a._pd_role, a.replica_rank, a._has_server = None, 0, port is not None
    a._engine = None if port is None else TLTHttpEngine(model_path=model_path, host="127.0.0.1", port=port,
                                                        launch_server=False, device="cpu")
    a.server_actor = _FrozenSink()
    return a


class _FrozenSink:
    """Stands in for TLT's server actor: records what the policy push hands it (a Ray method)."""

    def __init__(self) -> None:
        self.got: list = []
        self.update_weights = types.SimpleNamespace(remote=self._frozen)
        self.set_global_steps = types.SimpleNamespace(remote=self._done)

    def _frozen(self, state, version):
        self.got.append((sorted(state), version))
        return self._done()

    @staticmethod
    def _done(*args):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


async def _main(model_path: str) -> dict:
    import torch

    from tlt.integrations.verl.sglang_push import DRAFT_LOADER, push_api

    api = push_api()
    calls: list = []
    runner, port = await _serve(calls)
    try:
        adapter = _adapter(port, model_path)
        policy = {"model.layers.0.mlp.up_proj.weight": torch.randn(8, 4), "lm_head.weight": torch.randn(16, 4)}
        await adapter.update_weights(iter(policy.items()), global_steps=5)
        policy_calls, calls[:] = list(calls), []
        assert adapter.server_actor.got == [(["lm_head.weight"], 5)], adapter.server_actor.got  # spot's frozen head
        draft = {"model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4)}
        await adapter.update_draft_weights(iter(draft.items()), version=3)
        draft_calls, calls[:] = list(calls), []
        await adapter._engine.rotate_corpus(0, ["12 + 7 = 19", ""])
        await adapter._engine.rotate_corpus(1, ["3 * 4 = 12"])
        corpus_calls, calls[:] = list(calls), []
        for step in range(3):  # a two-step history window: step 0's corpus leaves at step 2
            await adapter._engine.rotate_corpus(step, [f"step {step}"], window=2)
        window_calls = [(e, b["corpus_id"]) for e, b in calls]
    finally:
        await runner.cleanup()

    seq = [c[0] for c in policy_calls]
    updates = [b for e, b in policy_calls if e == "update_weights_from_tensor"]
    assert updates, seq
    got = {}
    for b in updates:
        if api.selector:
            assert b.get("selector") == "target" and "disable_draft_model" not in b, b.keys()
        else:
            assert b.get("disable_draft_model") is True and "selector" not in b, b.keys()
        got.update(_tensors(b))
    assert set(got) == set(policy) and all(torch.equal(got[k], v) for k, v in policy.items())
    if api.sessions:
        assert seq[0] == "begin_weight_update" and policy_calls[0][1] == {"selector": "target"}, seq
        assert seq[-1] == "end_weight_update", seq

    dseq = [c[0] for c in draft_calls]
    [dbody] = [b for e, b in draft_calls if e == "update_weights_from_tensor"]
    assert dbody["weight_version"] == "draft-3"
    assert set(_tensors(dbody)) == set(draft)
    if api.selector:
        assert dbody["selector"] == "draft" and dbody["load_format"] is None
        assert dseq == ["pause_generation", "begin_weight_update", "update_weights_from_tensor",
                        "end_weight_update", "continue_generation"], dseq
        assert draft_calls[0][1] == {"mode": "in_place"} and draft_calls[1][1] == {"selector": "draft"}
    else:
        assert dbody["load_format"] == DRAFT_LOADER and not dbody.get("disable_draft_model"), dbody.keys()
        assert dseq == ["update_weights_from_tensor"], dseq
    assert corpus_calls == [("add_external_corpus", {"corpus_id": "tlt-step-0", "documents": ["12 + 7 = 19"]}),
                            ("add_external_corpus", {"corpus_id": "tlt-step-1", "documents": ["3 * 4 = 12"]}),
                            ("remove_external_corpus", {"corpus_id": "tlt-step-0"})], corpus_calls
    assert window_calls == [("add_external_corpus", "tlt-step-0"), ("add_external_corpus", "tlt-step-1"),
                            ("add_external_corpus", "tlt-step-2"), ("remove_external_corpus", "tlt-step-0")], window_calls
    return {"api": dataclasses.asdict(api), "policy_calls": seq, "draft_calls": dseq,
            "corpus_calls": [c[0] for c in corpus_calls],
            "policy_fields": sorted(set(updates[0]) - {"serialized_named_tensors"}),
            "draft_fields": sorted(set(dbody) - {"serialized_named_tensors"}),
            "draft_loader": _check_draft_loader()}


def _check_draft_loader() -> dict:
    """The 0.5.12 loader against SGLang's own model classes (instances without weights)."""
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.models.llama_eagle import LlamaForCausalLMEagle

    from tlt.integrations.sglang.draft_loader import load_draft_only

    loaded = []
    originals = LlamaForCausalLMEagle.__dict__.get("load_weights"), LlamaForCausalLM.__dict__.get("load_weights")
    LlamaForCausalLMEagle.load_weights = lambda self, w: loaded.append(("draft", [n for n, _ in w]))
    LlamaForCausalLM.load_weights = lambda self, w: loaded.append(("target", [n for n, _ in w]))
    try:
        tensors = [("model.layers.0.self_attn.q_proj.weight", None)]
        load_draft_only(object.__new__(LlamaForCausalLMEagle), tensors)  # no weights: never runs a kernel
        load_draft_only(object.__new__(LlamaForCausalLM), tensors)
    finally:
        for cls, fn in zip((LlamaForCausalLMEagle, LlamaForCausalLM), originals):
            if fn is None:
                delattr(cls, "load_weights")
            else:
                cls.load_weights = fn
    assert loaded == [("draft", ["model.layers.0.self_attn.q_proj.weight"])], loaded
    return {"draft_class": LlamaForCausalLMEagle.__name__, "target_class": LlamaForCausalLM.__name__}


def main() -> None:
    site, out, model_path = sys.argv[1], sys.argv[2], sys.argv[3]
    os.environ["VERL_PLATFORM"] = "cpu"  # verl's push moves tensors to this platform's device
    cpu_env.activate(site)
    import torch.distributed as dist
    from sglang.srt.utils import patch_torch

    # Stand-in for CUDA IPC: SGLang's reduction patch only handles CUDA tensors; CPU tensors go
    # through torch's own shared-memory reductions (same serializer, same request bodies).
    patch_torch.monkey_patch_torch_reductions = lambda: None

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{out}.store")
    try:
        import sglang

        result = asyncio.run(_main(model_path))
        result["sglang_version"] = sglang.__version__
    finally:
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
