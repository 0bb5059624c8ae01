"""A push that fails at the TP leader, over a 2-rank replica (run as two processes, one per rank).

``python -m tests.sglang_env.push_fail_check SITE_DIR OUT_JSON MODEL_DIR RANK STORE FAIL``. As in
:mod:`.push_check`, a recording HTTP server stands in for SGLang (answering endpoint ``FAIL`` with
SGLang's 400) and CPU tensors stand in for CUDA IPC; here a 2-rank gloo group plays the replica's
TP group, as the actor workers of a TP-2 replica form it. Both ranks push the policy (in two
buckets: two gathers to the leader) and then a drafter. The leader's pushes fail; what must hold
is that each push still reaches every collective (the other rank returns from both pushes and the
two processes end), that the leader raises naming what failed, and that a paused server is told
to go on. Writes what each rank saw to OUT_JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from tests.sglang_env import cpu_env
from tests.sglang_env.push_check import _adapter, _serve


async def _push(rank: int, model_path: str, fail: str) -> dict:
    import torch

    calls: list = []
    runner, port = (await _serve(calls, fail)) if rank == 0 else (None, None)
    out: dict = {}
    try:
        adapter = _adapter(port, model_path, tp=2, bucket_mb=1)
        policy = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(512, 512) for i in range(2)}  # 1 MiB each
        for name, push in (("policy", lambda: adapter.update_weights(iter(policy.items()), global_steps=5)),
                           ("draft", lambda: adapter.update_draft_weights(
                               iter({"model.fc.weight": torch.randn(4, 4)}.items()), version=3))):
            try:
                await push()
                out[name] = "returned"
            except RuntimeError as e:
                out[name] = str(e)
    finally:
        if runner is not None:
            await runner.cleanup()
    out["calls"] = [e for e, _ in calls]
    return out


def main() -> None:
    site, out, model_path, rank, store, fail = sys.argv[1:7]
    os.environ["VERL_PLATFORM"] = "cpu"
    cpu_env.activate(site)
    import torch.distributed as dist
    from sglang.srt.utils import patch_torch

    patch_torch.monkey_patch_torch_reductions = lambda: None  # CPU tensors: see push_check
    dist.init_process_group("gloo", rank=int(rank), world_size=2, init_method=f"file://{store}")
    try:
        result = asyncio.run(_push(int(rank), model_path, fail))
        dist.barrier()  # both ranks got through both pushes
    finally:
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
