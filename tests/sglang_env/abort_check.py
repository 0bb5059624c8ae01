"""One request's abort on TLT's SGLang server actor, against a stand-in SGLang server (run in its own
process, SGLang importable: ``python -m tests.sglang_env.abort_check SITE MODEL_PATH MAX_LEN OUT_DIR``).

The stand-in (``standin.py``, a subprocess) parses every body into the installed SGLang's request
classes, ``/abort_request`` into ``AbortReq``, and decodes with the project's engine (coupled
sampling). The actor's own ``generate`` and ``abort_request`` run on a real event loop, over real
HTTP (verl's SGLang client). Scenario: an uninterrupted request; the same request again, aborted
while it decodes; its partial output resubmitted as verl's partial rollout does (prompt + partial
output, the same request id and seed, the budget left); a request aborted while it waits at the
actor's gate, and an abort of an id not in flight. Prints JSON: the outputs, the answers and the
stand-in's recorded calls.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

from tests.sglang_env import cpu_env

BUDGET = 200


def main(site: str, model: str, max_len: str, out_dir: str) -> None:
    cpu_env.activate(site)
    import aiohttp

    from tlt.integrations.verl.config import TLTConfig
    from tlt.integrations.verl.sglang_push import TLTHttpEngine
    from tlt.integrations.verl.replica_core import ReplicaCore
    from tlt.integrations.verl.sglang_server import TLTSGLangServer
    from verl.workers.rollout.sglang_rollout.http_server_engine import AsyncHttpServerAdapter

    # verl's client times a request out (60 s) and posts it again: every /generate here runs longer
    # than that default shrunk to 50 ms, so one left on the default would be posted again (the
    # other endpoints keep theirs)
    request = AsyncHttpServerAdapter._make_async_request

    async def short_generate_default(self, endpoint, payload=None, method="POST", timeout=None, only_master=True):
        timeout = timeout if timeout is not None else 0.05 if endpoint == "generate" else 60.0
        return await request(self, endpoint, payload, method, timeout, only_master)

    AsyncHttpServerAdapter._make_async_request = short_generate_default

    out = Path(out_dir)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "tests.sglang_env.standin", site, model, max_len, str(out)],
                            env=env, stdout=open(out / "log", "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (out / "port").exists():
            assert proc.poll() is None and time.monotonic() < deadline, (out / "log").read_text()[-3000:]
            time.sleep(0.1)
        port = int((out / "port").read_text())
        s = object.__new__(TLTSGLangServer)  # verl's constructor launches SGLang: not here
        s.cfg = TLTConfig.from_mapping({})
        s.config = types.SimpleNamespace(max_model_len=int(max_len), response_length=BUDGET, prompt_length=16)
        s.http = TLTHttpEngine(model_path=model, host="127.0.0.1", port=port, launch_server=False, device="cpu")
        s.core, s.eagle, s.global_steps = ReplicaCore(s.cfg, rank=0, seed=0, spot_root=""), False, 1
        s.rank, s._in_flight, s._released, s._rollout_over, s._idle_task = 0, 0, False, True, None
        s._calls, s._dropping = {}, False  # tail batching's (TLTSGLangServer.__init__)
        prompt = [1, 5, 7, 9, 11]

        def sampling(n):
            return {"temperature": 1.0, "max_tokens": n, "seed": 77, "logprobs": True}

        async def running() -> int:
            async with aiohttp.ClientSession() as c, c.post(f"http://127.0.0.1:{port}/tlt_status", json={}) as r:
                return (await r.json())["running"]

        async def scenario():
            s._gate = asyncio.Lock()
            ref = await s.generate("ref", prompt, sampling(BUDGET))
            task = asyncio.ensure_future(s.generate("a", prompt, sampling(BUDGET)))
            t0 = time.monotonic()
            while not await running():
                assert time.monotonic() - t0 < 60
                await asyncio.sleep(0.002)
            await asyncio.sleep(0.02)
            answer = await s.abort_request("a")
            part = await task
            again = await s.generate("a", prompt + part.token_ids, sampling(BUDGET - len(part.token_ids)))
            async with s._gate:  # "b" waits at the gate (as behind a wake-up): aborted there
                held = asyncio.ensure_future(s.generate("b", prompt, sampling(BUDGET)))
                await asyncio.sleep(0.05)
                at_gate = [await s.abort_request("b"), await s.abort_request("nope")]
            held = await held
            return ref, answer, part, again, at_gate, held

        ref, answer, part, again, at_gate, held = asyncio.run(scenario())
        calls = [json.loads(x) for x in (out / "calls.jsonl").read_text().splitlines()]
        print(json.dumps({"ref": [ref.token_ids, ref.log_probs, ref.stop_reason], "answer": answer,
                          "part": [part.token_ids, part.log_probs, part.stop_reason],
                          "again": [again.token_ids, again.log_probs, again.stop_reason], "at_gate": at_gate,
                          "held": [held.token_ids, held.log_probs, held.stop_reason], "calls": calls}))
    finally:
        proc.kill()


if __name__ == "__main__":
    main(*sys.argv[1:])
