"""TLT's SGLang server actor without a live SGLang (run in its own process, SGLang importable:
``python -m tests.sglang_env.server_check SITE``): its methods against the loop's replica interface
(names, parameters, sync/async), and the order it keeps between requests, its KV-cache
release/resume and the spot agent.

The actor's own methods run on a real event loop; its HTTP client and spot agent are recorders
(what they would call is SGLang's engine and the coordinator). Scenario: request ``a`` finishes ->
the replica releases its KV cache and reports IDLE; request ``b`` arrives *while the release is
still in flight* -> it waits, training stops (BUSY), the cache comes back, then ``b`` reaches the
server; the replica idles again and the rollout ends -> training stops and the cache comes back
before verl's sleep. Then drafter pushes whose first one SGLang refuses: the replica serves on, its
read-back reports no drafter (the push guard rejects), the rollback pushes the one before again.
Prints ``{"nonconforming": [...], "order": [...], "pushes": [...]}`` as JSON.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
import types

from tests.sglang_env import cpu_env


def main(site: str) -> None:
    cpu_env.activate(site)
    from tlt.integrations.replica_api import ReplicaAPI
    from tlt.integrations.verl.config import TLTConfig
    from tlt.integrations.verl.replica_core import ReplicaCore
    from tlt.integrations.verl.sglang_server import TLTSGLangServer

    log: list = []

    class Http:
        async def release_memory_occupation(self, tags):
            log.append(["release", tags])
            await asyncio.sleep(0.1)  # a slow release: request b arrives meanwhile

        async def resume_memory_occupation(self, tags):
            log.append(["resume", tags])

        async def _make_async_request(self, endpoint, body, timeout=None):  # (verl's client: 60 s by default)
            if endpoint == "get_weights_by_name":
                log.append([endpoint, body["name"]])
                return [[0.5, -0.25]]
            assert timeout is not None and timeout >= 3600, f"/{endpoint} would be timed out and posted again"
            log.append([endpoint, body["rid"]])
            return {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "stop"}, "spec_verify_ct": 1}}

    class Agent:
        training = False

        def idle(self, step):
            log.append(["IDLE", step])
            self.training = True  # the coordinator promoted it

        def busy(self, step):
            log.append(["BUSY", step])
            self.training = False

    s = object.__new__(TLTSGLangServer)  # verl's constructor launches SGLang: not here
    s.cfg = TLTConfig.from_mapping({"engine": {"batch_window_ms": 1.0}})
    s.config = types.SimpleNamespace(max_model_len=64, response_length=8, prompt_length=8, dtype="bfloat16")
    s.rank, s.eagle, s.global_steps = 0, True, 1
    s.http, s.core = Http(), ReplicaCore(s.cfg, rank=0, seed=0, spot_root="")
    s.core.agent, s.core.buffer = Agent(), [object()]  # a buffer with something to train on
    s._in_flight, s._released, s._rollout_over, s._gate, s._idle_task = 0, False, True, None, None
    s._calls, s._dropping = {}, False  # tail batching's (TLTSGLangServer.__init__)

    async def scenario():
        s._gate = asyncio.Lock()
        s.begin_step(3)
        await s.generate("a", [1, 2, 3], {"temperature": 1.0})
        await asyncio.sleep(0.05)  # the idle task is releasing now
        await s.generate("b", [1, 2, 3], {"temperature": 1.0})
        await asyncio.sleep(0.2)  # idle again: released, IDLE
        await s.end_rollout()
        await s.generate("c", [1], {})  # after the rollout: no idle work is scheduled
        await asyncio.sleep(0.05)

    asyncio.run(scenario())
    order = list(log)
    log.clear()

    class Worker:  # verl's worker actor: tlt_push_drafter, SPMD over the replica's ranks
        class tlt_push_drafter:  # noqa: N801 - a Ray actor method's shape
            @staticmethod
            async def remote(source, version, drafter_cfg, dtype):
                if version == 1:  # (verl's push raises once every rank is through: sglang_push._LeaderEngine)
                    raise RuntimeError("replica 0: drafter version 1 not pushed: update_weights_from_tensor failed "
                                       "(HTTPError: 400 a weight-update session is already open)")
                log.append(["push", version, source])

    s.workers, s.spot_root, s.drafter_cfg, s._push_failed = [Worker()], "/spot", None, False
    s.core.drafters.served = {"kind": "export", "path": "start"}

    async def pushes():
        out = []
        for call in (lambda: s.load_drafter(1, 5), s.served_drafter, lambda: s.rollback_drafter(2),
                     s.served_drafter, lambda: s.load_drafter(3, 6), s.served_drafter):
            got = await call()
            out.append([got["digest"] is not None if isinstance(got, dict) else got, s.core.drafters.served])
        return out

    results = asyncio.run(pushes())
    print(json.dumps({"nonconforming": _nonconforming(ReplicaAPI, TLTSGLangServer), "order": order,
                      "pushes": {"results": results, "calls": log}}))


def _nonconforming(api, cls) -> list[str]:
    bad = []
    for name, want in vars(api).items():
        if not callable(want) or name.startswith("_"):
            continue
        got = getattr(cls, name, None)
        if got is None or list(inspect.signature(got).parameters) != list(inspect.signature(want).parameters) \
                or inspect.iscoroutinefunction(got) != inspect.iscoroutinefunction(want):
            bad.append(name)
    return bad


if __name__ == "__main__":
    main(*sys.argv[1:])
