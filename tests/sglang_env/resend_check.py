"""The abort resend of TLT's SGLang server actor (``TLTSGLangServer._abort_sent``), on a recording
stand-in of the HTTP client (run in its own process, SGLang importable: ``python -m
tests.sglang_env.resend_check SITE``).

SGLang ignores an abort that reaches it before its request does, so an abort goes once more after
``ABORT_RESEND_S`` to the calls still in flight, and only to the same call: one that finished in
between gets no second abort, nor does a new call that reused its id. Scenario: three calls in
flight are aborted together; during the wait "b" finishes and "c" finishes and is posted again under
the same id. Prints JSON: each abort sent (request id, seconds after the first) and the wait.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from tests.sglang_env import cpu_env


def main(site: str) -> None:
    cpu_env.activate(site)
    from tlt.integrations.verl import sglang_server
    from tlt.integrations.verl.sglang_server import TLTSGLangServer, _Call

    sent: list[tuple[str, float]] = []

    class Recorder:  # the HTTP client's abort_request: what the actor sends, and when
        async def abort_request(self, rid: str) -> dict:
            sent.append((rid, time.monotonic()))
            return {}

    s = object.__new__(TLTSGLangServer)  # verl's constructor launches SGLang: not here
    s.http = Recorder()
    calls = {rid: _Call() for rid in "abc"}
    for call in calls.values():
        call.sent = True
    s._calls = dict(calls)

    async def meanwhile() -> None:
        await asyncio.sleep(sglang_server.ABORT_RESEND_S / 4)
        del s._calls["b"]  # finished before the resend
        s._calls["c"] = _Call()  # finished, and a new call posted under the same id

    async def scenario() -> None:
        await asyncio.gather(s._abort_sent(calls), meanwhile())

    asyncio.run(scenario())
    t0 = sent[0][1]
    print(json.dumps({"sent": [[rid, t - t0] for rid, t in sent], "resend_s": sglang_server.ABORT_RESEND_S}))


if __name__ == "__main__":
    main(*sys.argv[1:])
