"""A rollout replica killed with -9 comes back stale and never samples its stale weights.

Real Ray actors of ``TLTServer`` (as ``TLTReplica`` launches them: named, restarted by Ray), real
SIGKILL. After the restart, a request to the stale replica is served by a healthy replica; with no
healthy replica left it fails loudly; the next policy push makes it serve again itself.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'tlt-rollout[verl]')")
ray = pytest.importorskip("ray")

from tlt.demo import job as demo  # noqa: E402
from tlt.integrations.verl.config import TLTConfig  # noqa: E402
from tlt.integrations.verl.server import TLTServer, server_name  # noqa: E402

pytestmark = pytest.mark.slow

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 8, "logprobs": True}


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="tlt-restart-test")
    yield
    ray.shutdown()


def _launch(rank: int, model: str, tmp_path):
    tlt = TLTConfig.from_mapping({"coordinator": {"enable": False}, "speculation": {"enable": False}}).to_dict()
    return ray.remote(TLTServer).options(name=server_name(rank), max_concurrency=16, num_cpus=0, max_restarts=-1,
                                         max_task_retries=-1).remote(
        model_path=model, replica_rank=rank, tlt=tlt, prompt_length=16, response_length=8, coordinator=None,
        spot_root=str(tmp_path / "spot"), run_dir=str(tmp_path), seed=1)


def _kill_and_wait(server, rank: int, tmp_path) -> None:
    pid_file = tmp_path / f"tlt_replica_{rank}.pid"
    old = int(pid_file.read_text())
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the restarted actor writes its new pid
        try:
            if int(pid_file.read_text()) != old and ray.get(server.is_stale.remote(), timeout=10):
                return
        except (ValueError, ray.exceptions.RayError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"replica {rank} did not come back")


def test_restarted_replica_forwards_until_the_next_policy_push(cluster, tmp_path):
    from tlt.rollout.target import TargetModel
    from tlt.demo.target_factory import ensure_target

    model = str(ensure_target(demo.QUICK.target, progress=False))
    policy = {k: v.clone() for k, v in TargetModel.from_pretrained(model).state_dict().items()}
    servers = [_launch(r, model, tmp_path) for r in range(2)]
    ray.get([s.update_weights.remote(policy, 1) for s in servers])
    prompt = [1, 5, 7, 9]

    def generate(s):
        return ray.get(s.generate.remote("r", prompt, SAMPLING), timeout=120)

    assert not any(ray.get([s.is_stale.remote() for s in servers]))
    _kill_and_wait(servers[0], 0, tmp_path)
    before = ray.get(servers[1].step_stats.remote())["requests"]
    out = generate(servers[0])  # stale: replica 1 serves it
    assert 1 <= len(out.token_ids) <= 8 and len(out.log_probs) == len(out.token_ids)
    assert ray.get(servers[1].step_stats.remote())["requests"] == before + 1
    assert ray.get(servers[0].step_stats.remote())["requests"] == 0

    _kill_and_wait(servers[1], 1, tmp_path)  # now nobody holds the current policy
    with pytest.raises(ray.exceptions.RayTaskError, match="refusing to sample from stale weights"):
        generate(servers[0])

    ray.get([s.update_weights.remote(policy, 2) for s in servers])  # the next push: both serve again
    assert not any(ray.get([s.is_stale.remote() for s in servers]))
    out = generate(servers[0])
    assert ray.get(servers[0].step_stats.remote())["requests"] == 1 and out.token_ids
