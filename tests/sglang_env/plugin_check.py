"""TLT's SGLang plugin inside one installed SGLang version (run in its own process).

``python -m tests.sglang_env.plugin_check SITE_DIR OUT_JSON MODEL_DIR TRACE [--sglang-own]``. SGLang's engine needs
CUDA, so no server starts; everything else is SGLang's own code:

- the plugin is loaded by SGLang's ``load_plugins()`` from TLT's installed entry point, and
  ``tlt doctor sglang``'s report is taken after it;
- the policy is driven through SGLang's real ``AdaptiveController`` (0.5.23: ``init_states`` with
  the CUDA-graph batch sizes, then ``activate_step_by_batch`` / ``on_verify_complete`` in the
  overlap scheduler's order; 0.5.12: ``on_verify_complete`` after every verify) over the recorded
  verify trace (with ``--sglang-own``, SGLang's own policy too, for docs/sglang.md's comparison);
- the lossless guard: real ``ServerArgs`` (a local target config, no GPU needed to resolve),
  ``SamplingParams.verify`` and the hooked ``Scheduler.set_internal_state``; first, before anything
  loads the plugins, through TLT's server actor launching in verl's order;
- the idle signal: the hook functions with a stand-in scheduler report to a real coordinator.

Writes what it saw to OUT_JSON; the pytest side asserts on it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
import types

from tests.sglang_env import cpu_env

# Simulated rollouts of the recorded trace per policy. 0.5.12 has no steps=0 arm, so TLT's margin
# over plain decoding there is thin (under 1%) and needs the longer run to show; 0.5.23's does not.
ROLLOUTS = {"0.5.12": 16, "0.5.23": 8}


class _Worker:
    """Stand-in for SGLang's EAGLE worker: the ``AdaptiveSpecWorker`` protocol, no GPU."""

    def __init__(self, steps: int) -> None:
        self.speculative_num_steps = steps
        self.built: dict[int, list[int] | None] = {}

    def build_adaptive_runtime_state(self, speculative_num_steps, speculative_num_draft_tokens, cuda_graph_bs=None):
        self.built[speculative_num_steps] = cuda_graph_bs
        return types.SimpleNamespace(speculative_num_steps=speculative_num_steps)

    def apply_runtime_state(self, state) -> None:
        self.speculative_num_steps = state.speculative_num_steps


def _policy_on_trace(version: str, trace, original_cls, sglang_own_too: bool) -> dict:
    from sglang.srt.speculative import adaptive_runtime_state as ars
    from sglang.srt.speculative import adaptive_spec_params as asp

    from tlt.bench.sglang_tuner import SGLANG_SPEC_GRAPH_BS, evaluate
    from tlt.integrations.sglang import hook_impls
    from tlt.integrations.sglang.adaptive import DEFAULT_SLOTS

    out: dict = {"class_replaced": asp.AdaptiveSpeculativeParams.__name__}
    if version == "0.5.23":
        out["candidate_steps"] = asp.resolve_candidate_steps_from_config(None)

        def tlt(clock):
            worker = _Worker(3)
            pol = asp.AdaptiveSpeculativeParams(initial_steps=3, cfg_path=None)  # what eagle_worker_v2 builds
            pol._clock = clock
            ctl = ars.AdaptiveController(worker, pol)
            ctl.init_states(cuda_graph_bs=list(SGLANG_SPEC_GRAPH_BS))
            out["graph_bs_per_step"] = {str(k): v for k, v in sorted(worker.built.items())}
            out["policy_type"] = type(pol).__name__
            return _Driven(ctl, worker, pol)

        def sglang_own(clock):
            worker = _Worker(3)
            ctl = ars.AdaptiveController(worker, original_cls(initial_steps=3, cfg_path=_slots_file(DEFAULT_SLOTS)))
            ctl.init_states(cuda_graph_bs=list(SGLANG_SPEC_GRAPH_BS))
            return _Driven(ctl, worker, None)
    else:
        def tlt(clock):
            worker = _Worker(3)
            ctl = ars.AdaptiveController(worker, config_path=None)  # builds the (replaced) params class
            ctl.params._clock = clock
            ctl.init_states()
            out["policy_type"] = type(ctl.params).__name__
            out["candidate_steps"] = ctl.params.candidate_steps
            return _Driven(ctl, worker, ctl.params, per_verify=True)

        def sglang_own(clock):
            worker = _Worker(3)
            ctl = ars.AdaptiveController.__new__(ars.AdaptiveController)
            ctl.worker, ctl._states = worker, {}
            ctl.params = original_cls(initial_steps=3, config={"candidate_steps": [1, 2, 3, 5, 7]})
            ctl.init_states()
            return _Driven(ctl, worker, None, per_verify=True)
    slots = DEFAULT_SLOTS if version == "0.5.23" else hook_impls.adaptive._positive(DEFAULT_SLOTS)
    rollouts = 16 if sglang_own_too else ROLLOUTS[version]  # docs/sglang.md's figures: 16 each
    for name, make in (("tlt", tlt), ("sglang_own", sglang_own))[:2 if sglang_own_too else 1]:
        ev = evaluate(trace, slots, rollouts=rollouts, requests=32, seed=0, make_tuner=make,
                      overlap=version == "0.5.23")  # 0.5.12's EAGLE worker feeds its policy in the step
        out[name] = {"pct_of_oracle": ev["tuner_pct_of_oracle"], "goodput": ev["goodput_tok_s"]}
    out["rollouts"] = rollouts
    return out


class _Driven:
    """Exposes a real AdaptiveController as the bench's (get_steps_for_batch, on_verify_complete)."""

    def __init__(self, ctl, worker, policy, per_verify: bool = False) -> None:
        self.ctl, self.worker, self.policy, self.per_verify = ctl, worker, policy, per_verify

    def set_cuda_graph_bs(self, bs) -> None:
        pass  # init_states already did, as SGLang does

    def get_steps_for_batch(self, batch_size: int) -> int:
        if not self.per_verify:
            self.ctl.activate_step_by_batch(batch_size)
        return self.worker.speculative_num_steps

    def on_verify_complete(self, accepts, batch_size) -> None:
        if self.per_verify:
            self.ctl.on_verify_complete(accepts)
        else:
            self.ctl.on_verify_complete(accepts, batch_size)

    def stats(self):
        return self.policy.stats() if self.policy is not None and hasattr(self.policy, "stats") else None


def _slots_file(slots) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(slots, f)
    return f.name


def _server_args(version: str, model: str, **kw):
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=model, device="cuda", speculative_algorithm="EAGLE",
                      speculative_draft_model_path=model, **kw)
    if version == "0.5.23":
        args.resolve_once()
    return args


def _speculation(version: str, model: str) -> dict:
    """The server arguments a tlt run launches SGLang with are valid SGLang arguments (EAGLE with a
    drafter, and NGRAM)."""
    from sglang.srt.server_args import ServerArgs

    from tlt.integrations.sglang import launch
    from tlt.integrations.verl.config import TLTConfig

    out = {}
    runs = {"ngram": TLTConfig.from_mapping({"sglang": {"algorithm": "ngram"}}),
            "eagle": TLTConfig.from_mapping({"drafter": {"init_path": model}})}
    for name, cfg in runs.items():
        args = ServerArgs(model_path=model, device="cuda", **launch.server_args(
            cfg, version=version, drafter_path=model if name == "eagle" else None, max_running_requests=128))
        keys = ("speculative_algorithm", "max_running_requests", "custom_weight_loader", "speculative_adaptive")
        if version == "0.5.23":
            args.resolve_once()
            from sglang.srt.arg_groups.overrides import resolution_result

            out[name] = {k: resolution_result(args, k) for k in keys}
        else:
            out[name] = {k: getattr(args, k) for k in keys}
        out[name]["custom_weight_loader"] = list(out[name]["custom_weight_loader"] or []) or None  # 0.5.12: []
    return out


def _corpus(version: str, model: str) -> dict:
    """A tlt NGRAM run's draft history reaches SGLang's external corpus: the arguments it launches
    with (over verl's, which skip SGLang's tokenizer) keep the tokenizer that SGLang's own
    ``add_external_corpus`` encodes the documents with. The TokenizerManager is stood in: its
    tokenizer is None under ``skip_tokenizer_init``, as SGLang's constructor leaves it."""
    import asyncio

    from sglang.srt.managers import tokenizer_control_mixin as control
    from sglang.srt.managers.io_struct import AddExternalCorpusReqInput, AddExternalCorpusReqOutput
    from sglang.srt.server_args import ServerArgs
    from transformers import AutoTokenizer

    from tlt.integrations.sglang import launch
    from tlt.integrations.verl.config import TLTConfig

    ours = launch.server_args(TLTConfig.from_mapping({"sglang": {"algorithm": "ngram"}}), version=version,
                              drafter_path=None, max_running_requests=128)
    args = ServerArgs(model_path=model, device="cuda", **{"skip_tokenizer_init": True, **ours})  # verl's order
    if version == "0.5.23":
        args.resolve_once()
        from sglang.srt.arg_groups.overrides import resolution_result

        skip = resolution_result(args, "skip_tokenizer_init")
    else:
        skip = args.skip_tokenizer_init
    spec = types.SimpleNamespace(speculative_algorithm="NGRAM", speculative_ngram_external_corpus_max_tokens=10**6)
    sent = []

    async def communicator(obj):
        sent.append(obj.token_chunks)
        return [AddExternalCorpusReqOutput(success=True, corpus_id=obj.corpus_id,
                                           loaded_token_count=sum(map(len, obj.token_chunks)))]

    manager = types.SimpleNamespace(tokenizer=None if skip else AutoTokenizer.from_pretrained(model),
                                    auto_create_handle_loop=lambda: None, server_args=spec,
                                    add_external_corpus_communicator=communicator)
    control.get_spec = lambda: spec  # (0.5.23 reads the server's spec through it)
    body = {"corpus_id": "tlt-step-3", "documents": ["12 + 7 = 19", "3 * 4 = 12"]}  # TLTHttpEngine's body
    out = asyncio.run(control.TokenizerControlMixin.add_external_corpus(manager, AddExternalCorpusReqInput(**body)))
    return {"skip_tokenizer_init": skip, "success": out.success, "message": out.message,
            "chunks": len(sent[0]) if sent else 0}


def _readback(version: str, model: str) -> dict:
    """The hooked get_weights_by_name reads ``tlt.draft/<name>`` from the draft model, anything else
    from SGLang's own code (the target). 0.5.12: on the draft worker class SGLang builds from a tlt
    run's EAGLE arguments (``worker``: its name), its draft runner set where SGLang puts it."""
    import torch
    from sglang.srt.managers.io_struct import GetWeightsByNameReqInput
    from sglang.srt.server_args import ServerArgs

    from tlt.integrations.sglang import launch
    from tlt.integrations.verl.config import TLTConfig

    if version == "0.5.23":
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager as owner
    else:
        from sglang.srt.managers.scheduler_update_weights_mixin import SchedulerUpdateWeightsMixin as owner
    draft = torch.nn.Module()
    draft.fc = torch.nn.Linear(3, 2, bias=False)
    runner = types.SimpleNamespace(model=torch.nn.ModuleDict({"model": draft}))
    if version == "0.5.23":
        worker = types.SimpleNamespace(weight_update_runners=lambda: [("draft", runner)])
    else:
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        cfg = TLTConfig.from_mapping({"drafter": {"init_path": model}})
        args = ServerArgs(model_path=model, device="cuda", **launch.server_args(
            cfg, version=version, drafter_path=model, max_running_requests=128))
        cls = SpeculativeAlgorithm.from_string(args.speculative_algorithm).create_worker(args)
        worker = object.__new__(cls)  # (its constructor loads the models on a GPU)
        if hasattr(cls, "draft_model_runner"):  # EAGLEWorker: itself the draft's model worker
            worker.model_runner = runner
        else:  # EAGLEWorkerV2: its EagleDraftWorker holds the draft's runner
            worker._draft_worker = types.SimpleNamespace(draft_runner=runner)
    target = types.SimpleNamespace(get_weights_by_name=lambda req: [7.0])
    me = types.SimpleNamespace(draft_worker=worker, tp_worker=target)
    got = owner.get_weights_by_name(me, GetWeightsByNameReqInput(name="tlt.draft/model.fc.weight", truncate_size=4))
    other = owner.get_weights_by_name(me, GetWeightsByNameReqInput(name="model.fc.weight", truncate_size=4))
    return {"draft": got.parameter, "want": draft.fc.weight.flatten()[:4].tolist(), "target": other.parameter,
            "worker": type(worker).__name__}


def _refused(fn) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _guard(version: str, model: str) -> dict:
    from sglang.srt.managers.io_struct import SetInternalStateReq
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.sampling.sampling_params import SamplingParams

    out: dict = {}
    out["threshold_single"] = _refused(lambda: _server_args(version, model, speculative_accept_threshold_single=0.9))
    out["threshold_acc"] = _refused(lambda: _server_args(version, model, speculative_accept_threshold_acc=0.5))
    os.environ["SGLANG_SIMULATE_ACC_LEN"] = "3"
    out["simulate_acc_len"] = _refused(lambda: _server_args(version, model))
    del os.environ["SGLANG_SIMULATE_ACC_LEN"]
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("tlt.integrations.sglang.hook_impls").addHandler(handler)
    _server_args(version, model)  # lossless, max-running-requests left to SGLang: accepted, warned
    out["lossless_accepted"] = True
    out["warned_default_cap"] = any("max_running_requests" in m for m in records)
    records.clear()
    _server_args(version, model, max_running_requests=256)
    out["warned_with_explicit_cap"] = any("max_running_requests" in m for m in records)
    out["min_p"] = _refused(lambda: SamplingParams(min_p=0.1).verify(100))
    out["greedy_ok"] = _refused(lambda: SamplingParams(temperature=0).verify(100)) is None
    out["sampled_ok"] = _refused(lambda: SamplingParams(temperature=0.7, top_p=0.9).verify(100)) is None
    os.environ["SGLANG_NGRAM_FORCE_GREEDY_VERIFY"] = "1"
    from tlt.integrations.sglang import hook_impls

    hook_impls._server["algorithm"] = "NGRAM"  # what an NGRAM server's args hook records
    out["forced_greedy_sampled"] = _refused(lambda: SamplingParams(temperature=0.7).verify(100))
    out["forced_greedy_greedy_ok"] = _refused(lambda: SamplingParams(temperature=0).verify(100)) is None
    del os.environ["SGLANG_NGRAM_FORCE_GREEDY_VERIFY"]
    hook_impls._server["algorithm"] = None
    out["min_p_without_spec_ok"] = _refused(lambda: SamplingParams(min_p=0.1).verify(100)) is None
    # run time: the hooked method refuses before SGLang's own code (which needs a live scheduler) runs
    res = Scheduler.set_internal_state(object(), SetInternalStateReq(
        server_args={"speculative_accept_threshold_single": 0.5}))
    out["internal_state_refused"] = res.updated is False
    return out


def _idle() -> dict:
    from tlt.coordinator.broker import Coordinator, CoordinatorConfig
    from tlt.coordinator.promotion import PromotionConfig
    from tlt.integrations.sglang import hook_impls

    coord = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", heartbeat_interval_s=0.05,
                                          promotion=PromotionConfig(idle_threshold=8))).start()
    os.environ.update(TLT_COORDINATOR=coord.endpoint, TLT_WORKER_ID="sglang-test")
    sched = types.SimpleNamespace(tp_rank=0, running_batch=types.SimpleNamespace(reqs=[1, 2]), waiting_queue=[])
    seen = []

    def wait(state: str) -> bool:
        end = time.monotonic() + 5
        while time.monotonic() < end:
            snap = coord.snapshot().get("sglang-test")
            if snap and snap[0].value == state:
                seen.append(state)
                return True
            time.sleep(0.02)
        return False

    hook_impls.idle_after_batch(None, sched, None, None)
    busy = wait("BUSY")
    sched.running_batch.reqs = []
    hook_impls.idle_after_on_idle(None, sched)
    idle = wait("IDLE")
    sched.waiting_queue = [3]
    hook_impls.idle_after_batch(None, sched, None, None)
    busy2 = wait("BUSY")
    coord.stop()
    return {"busy": busy, "idle": idle, "busy_again": busy2, "seen": seen}


def _verl_launch(version: str, model: str) -> dict:
    """TLT's SGLang server actor launching as verl 0.9.1 launches SGLang, in a process where nothing
    has loaded SGLang's plugins yet (a verl server actor's): TLT's ``launch_server`` runs verl's
    ``SGLangHttpServer.launch_server``, which builds ``ServerArgs(**args)`` (0.5.12 resolves them in
    its ``__post_init__``) and then ``Engine._launch_subprocesses`` (0.5.23: ``resolve_once()``
    before SGLang's own ``load_plugins()``). That parent is a stand-in doing just those steps (the
    subprocesses it would launch need CUDA). Run before anything else here loads the plugins."""
    import asyncio

    from omegaconf import OmegaConf
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs
    from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangHttpServer

    from tlt.integrations.sglang import hook_impls
    from tlt.integrations.verl.config import TLTConfig
    from tlt.integrations.verl.sglang_server import TLTSGLangServer

    async def verls_order(self, master_address=None, master_port=None):
        args = ServerArgs(model_path=model, device="cuda", **self.config.engine_kwargs["sglang"])
        if version != "0.5.12":
            args.resolve_once()

    def launch(**user_args) -> str | None:
        srv = object.__new__(TLTSGLangServer)
        srv._attach, srv.rank, srv.node_rank, srv.start_drafter = None, 0, 1, model
        srv.cfg = TLTConfig.from_mapping({"drafter": {"init_path": model}})
        srv.config = OmegaConf.create({"engine_kwargs": {"sglang": user_args}, "max_num_seqs": 8})
        return _refused(lambda: asyncio.run(srv.launch_server()))

    parent = SGLangHttpServer.launch_server
    SGLangHttpServer.launch_server = verls_order
    try:
        out = {"lossy_threshold": launch(speculative_accept_threshold_single=0.5), "lossless": launch()}
    finally:
        SGLangHttpServer.launch_server = parent
    out["algorithm"] = hook_impls._server["algorithm"]  # what this process's request check knows
    out["min_p"] = _refused(lambda: SamplingParams(min_p=0.1).verify(100))
    return out


def main(site: str, out_path: str, model: str, trace_path: str, *flags: str) -> None:
    cpu_env.activate(site)
    import sglang
    from sglang.srt.speculative import adaptive_spec_params as asp

    original = asp.AdaptiveSpeculativeParams  # SGLang's own policy, kept before the plugin replaces it
    verl_launch = _verl_launch(sglang.__version__, model)
    from sglang.srt.plugins import load_plugins

    from tlt.integrations.sglang import doctor

    load_plugins()  # SGLang's loader (the launch above ran it already: idempotent)
    version = sglang.__version__
    result = {"sglang_version": version, "doctor": doctor.report(), "verl_launch": verl_launch}
    from tlt.bench.sglang_tuner import parse_trace

    with open(trace_path) as f:
        trace = parse_trace(json.load(f))
    result["policy"] = _policy_on_trace(version, trace, original, "--sglang-own" in flags)
    result["guard"] = _guard(version, model)
    result["speculation"] = _speculation(version, model)
    result["idle"] = _idle()
    result["readback"] = _readback(version, model)
    result["corpus"] = _corpus(version, model)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2, default=str)


if __name__ == "__main__":
    main(*sys.argv[1:])
