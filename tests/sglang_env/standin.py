"""A stand-in SGLang server for the CPU test of TLT's loop on verl's SGLang rollout (test harness).

``python -m tests.sglang_env.standin SITE MODEL_PATH MAX_LEN OUT_DIR [CORRUPT_VERSION] [SLOW_S]``

SGLang's engine needs CUDA, so this process plays one SGLang server over real HTTP on 127.0.0.1:
every request body is parsed into the installed SGLang's own request class for its endpoint (an
unknown field or a bad value fails there, as in SGLang's server), and generation comes from the
project's engine (plain decoding of the same target: no speculation here). It keeps the state a
server would: the KV cache released or not (a ``/generate`` while it is released is an error, so
the loop's ordering is checked by construction), a weight-update session and a paused scheduler,
and the draft-model weights pushed with ``selector="draft"``, which ``/get_weights_by_name`` reads
back for names ``tlt.draft/<name>`` (TLT's plugin hook on a real server). With CORRUPT_VERSION a
draft push labelled ``draft-<CORRUPT_VERSION>`` lands with one weight changed: the silent failure
the push guard must catch. With SLOW_S every answer takes that much longer (a replica in the long
tail, so that the other one idles); a request aborted while it waits returns at once, aborted and empty. Writes ``OUT_DIR/port`` once listening and one JSON line per call to
``OUT_DIR/calls.jsonl``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from tests.sglang_env import cpu_env
from tests.sglang_env.bodies import parse as _parse
from tests.sglang_env.bodies import tensors as _tensors


class StandIn:
    def __init__(self, model_path: str, max_len: int, out: Path, corrupt: int | None, slow_s: float) -> None:
        from tlt.rollout.target import TargetModel
        from tlt.integrations.verl.assembly import ReplicaEngine
        from tlt.integrations.verl.batcher import RequestBatcher
        from tlt.integrations.verl.config import TLTConfig

        self.model = TargetModel.from_pretrained(model_path)
        self.max_len, self.corrupt, self.slow_s = max_len, corrupt, slow_s
        plain = TLTConfig.from_mapping({"speculation": {"enable": False}})
        self.engine = ReplicaEngine(self.model, plain, max_len=max_len, seed=0, rank=0).engine
        self.batcher = RequestBatcher(lambda: self.engine, window_s=0.02, max_batch=64, name="stand-in")
        self.log = open(out / "calls.jsonl", "a", buffering=1)
        self.released: set[str] = set()
        self.session: str | None = None
        self.paused = False
        self.draft: dict = {}
        self.waiting: dict[str, bool] = {}  # request id -> aborted, while a slow request waits

    def record(self, endpoint: str, **fields) -> None:
        self.log.write(json.dumps({"t": time.time(), "endpoint": endpoint, **fields}) + "\n")

    async def generate(self, req) -> dict:
        from sglang.srt.sampling.sampling_params import SamplingParams

        from tlt.integrations.verl.requests import engine_params

        if "kv_cache" in self.released or self.paused:
            raise RuntimeError(f"/generate while the KV cache is released ({sorted(self.released)}) or paused")
        sp = dict(req.sampling_params)
        SamplingParams(**sp)  # SGLang's tokenizer manager builds this from the request
        seed = sp.pop("sampling_seed", None)
        params, _ = engine_params(sp, prompt_len=len(req.input_ids), max_len=self.max_len,
                                  response_length=self.max_len, eos_ids=tuple(self.model.config.eos_ids or ()))
        from tlt.rollout.request import RequestState

        self.waiting[str(req.rid)] = False
        await asyncio.sleep(self.slow_s)  # a slow server: the request waits before it decodes
        if self.waiting.pop(str(req.rid)):  # aborted while it waited: nothing generated
            toks, lps, reason = [], [], "abort"
        else:
            fin = await self.batcher.submit(RequestState(tuple(req.input_ids), params, seed if seed is not None else 0,
                                                         group=tuple(req.input_ids)), str(req.rid))
            toks, lps = list(fin.state.output), list(fin.state.logprobs)
            reason = "abort" if fin.reason == "aborted" else fin.reason
        self.record("generate", rid=req.rid, tokens=len(toks), reason=reason)
        return {"output_ids": toks, "meta_info": {
            "finish_reason": {"type": reason}, "completion_tokens": len(toks), "spec_verify_ct": 0,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, toks)] if req.return_logprob else None}}

    def update(self, body: dict, req) -> dict:
        from tlt.integrations.verl.weight_sync import copy_policy

        selector = body.get("selector")
        tensors = _tensors(body)
        if selector == "draft" or (body.get("load_format") or "").endswith("load_draft_only"):
            if self.session not in (None, "draft") or (self.session and not self.paused):
                raise RuntimeError(f"draft push outside a paused draft session (session={self.session})")
            if body.get("weight_version") == f"draft-{self.corrupt}":
                tensors["fc.weight"].view(-1)[0] += 0.5  # served, but not as pushed
            self.draft = tensors
        else:
            if selector != "target" and not body.get("disable_draft_model"):
                raise RuntimeError(f"a policy push must select the target, not {selector!r}")
            copy_policy(self.model, tensors)
        self.record("update_weights_from_tensor", selector=selector, names=sorted(tensors),
                    weight_version=body.get("weight_version"))
        return {"success": True, "message": "ok"}

    def readback(self, req) -> list:
        name = req.name.removeprefix("tlt.draft/").removeprefix("model.")
        t = self.draft.get(name) if req.name.startswith("tlt.draft/") else None
        self.record("get_weights_by_name", name=req.name, found=t is not None)
        return [] if t is None else t.flatten()[:req.truncate_size].float().tolist()


async def main(site: str, model_path: str, max_len: str, out_dir: str, corrupt: str = "", slow_s: str = "0") -> None:
    cpu_env.activate(site)
    from aiohttp import web

    out = Path(out_dir)
    s = StandIn(model_path, int(max_len), out, int(corrupt) if corrupt else None, float(slow_s))

    async def handle(request):
        endpoint = request.path.strip("/")
        body = await request.json() if request.can_read_body else {}
        try:
            req = _parse(endpoint, body)
            if endpoint == "generate":
                return web.json_response(await s.generate(req))
            if endpoint == "update_weights_from_tensor":
                return web.json_response(s.update(body, req))
            if endpoint == "get_weights_by_name":
                return web.json_response(s.readback(req))
            if endpoint == "tlt_status":  # the harness's own: requests decoding now
                return web.json_response({"running": s.engine.running})
            if endpoint == "abort_request":  # SGLang answers an empty 200; the request's /generate returns
                if req.rid in s.waiting:
                    s.waiting[req.rid] = True
                else:
                    await s.batcher.abort(req.rid)
                s.record(endpoint, body=body)
                return web.Response(status=200)
            if endpoint == "release_memory_occupation":
                s.released |= set(req.tags or ["kv_cache", "weights"])
            elif endpoint == "resume_memory_occupation":
                s.released -= set(req.tags or ["kv_cache", "weights"])
            elif endpoint == "begin_weight_update":
                s.session = req.selector
            elif endpoint == "end_weight_update":
                s.session = None
            elif endpoint == "pause_generation":
                s.paused = True
            elif endpoint == "continue_generation":
                s.paused = False
            s.record(endpoint, body={k: v for k, v in body.items() if k != "serialized_named_tensors"})
            return web.json_response({"success": True, "message": "ok"})
        except Exception as e:  # noqa: BLE001 - the caller sees SGLang's kind of error: HTTP 400
            s.record(endpoint, error=repr(e))
            return web.json_response({"error": repr(e)}, status=400)

    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site_ = web.TCPSite(runner, "127.0.0.1", 0)
    await site_.start()
    (out / "port.tmp").write_text(str(runner.addresses[0][1]))
    (out / "port.tmp").rename(out / "port")
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
