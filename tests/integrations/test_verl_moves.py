"""Requests moved between replicas mid-decode, through real Ray actors: two ``TLTServer`` replicas,
TLT's router (verl's balancer subclass, as a Ray actor) and verl's own ``LLMServerClient`` wrapped
by the ``tlt_agent`` loop's :class:`~tlt.integrations.verl.moves.MovingClient`.

- Lossless: with the driver's consolidator moving the tail (every request of one replica moves
  to the other), every response is token-identical, log-probs included, to a run without moves:
  greedy and coupled-sampled, with the EAGLE drafter and with the suffix drafter; moved requests are
  counted (> 0), and the router's in-flight counts end at zero.
- Faults: kill -9 of the source after the hand-off, of the source before it, and of the destination
  after the hand-off: every request is answered once, with the tokens its original seed draws.

The target is the quick demo's (it rarely writes EOS, so requests run long enough to move); the
EAGLE drafter is untrained (lossless whatever it drafts; accepted drafts are tests/rollout/).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'tlt-rollout[verl]')")
ray = pytest.importorskip("ray")

from omegaconf import OmegaConf  # noqa: E402
from verl.workers.rollout.llm_server import LLMServerClient  # noqa: E402

from tlt.coordinator.consolidation import ConsolidationConfig  # noqa: E402
from tlt.demo import job as demo  # noqa: E402
from tlt.integrations.verl.config import TLTConfig  # noqa: E402
from tlt.integrations.verl.moves import MOVED_KEY, MovingClient  # noqa: E402
from tlt.integrations.verl.router import GroupRouter  # noqa: E402
from tlt.integrations.verl.server import TLTServer, server_name  # noqa: E402
from tlt.integrations.verl.consolidator import Consolidator, server_address  # noqa: E402

pytestmark = pytest.mark.slow
GROUPS, N = 3, 2  # GRPO: 3 prompts x 2 samples; the router puts 2 groups on one replica, 1 on the other
BUDGET = 120
SAMPLING = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 1.0, "top_p": 0.9}}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import torch

    from tlt.demo.target_factory import ensure_target
    from tlt.drafter.eagle import DrafterConfig, EagleDrafter
    from tlt.rollout.target import TargetModel

    tmp = tmp_path_factory.mktemp("moves")
    model = str(ensure_target(demo.QUICK.target, progress=False))
    target = TargetModel.from_pretrained(model)
    torch.manual_seed(0)
    EagleDrafter(DrafterConfig.for_target(target.config, "eagle"), target.embed_weight,
                 target.lm_head.weight).save(tmp / "drafter")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="tlt-moves-test")
    yield model, tmp
    ray.shutdown()


def _replicas(setup, drafter: str):
    """Two replicas as TLTReplica launches them (restarted after a kill, calls retried), and the router."""
    model, tmp = setup
    spec = {"coordinator": {"enable": False}, "engine": {"max_batch": 8},
            "tail": {"consolidate": {"mode": "consolidate"}},  # the replicas publish their load
            # EAGLE at a fixed arm; the suffix drafter alone under the tuner (its arms and "off")
            "speculation": {"arm": "4,1,4", "suffix": False} if drafter == "eagle" else {"suffix": True}}
    if drafter == "eagle":
        spec["drafter"] = {"init_path": str(tmp / "drafter")}
    tlt = TLTConfig.from_mapping(spec).to_dict()
    servers = [ray.remote(TLTServer).options(name=server_name(k), max_concurrency=32, num_cpus=0, max_restarts=-1,
                                             max_task_retries=-1).remote(
        model_path=model, replica_rank=k, tlt=tlt, prompt_length=32, response_length=BUDGET, coordinator=None,
        spot_root=str(tmp / "spot"), run_dir=str(tmp), seed=1) for k in range(2)]
    ray.get([s.pid.remote() for s in servers])
    router = ray.remote(GroupRouter).remote({server_address(k): s for k, s in enumerate(servers)})
    return servers, router


def _stop(servers, router) -> None:
    for h in (*servers, router):
        ray.kill(h, no_restart=True)
    time.sleep(0.5)  # the names are free again


def _client(router) -> MovingClient:
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "tlt", "full_determinism": False}}})
    return MovingClient(LLMServerClient(cfg, load_balancer_handle=router))


def _prompt(g: int) -> list[int]:
    return [1, 5 + g, 7, 9, 11 + g, 13]


def _params(i: int, sampling: str) -> dict:
    return {**SAMPLING[sampling], "max_tokens": BUDGET, "logprobs": True, "seed": 1000 + i}


async def _generate_all(client, tag: str, sampling: str):
    calls = [client.generate(f"{tag}-{g}-{s}", prompt_ids=_prompt(g), sampling_params=_params(g * N + s, sampling))
             for g in range(GROUPS) for s in range(N)]
    return await asyncio.gather(*calls)


def _running(servers) -> list[int]:
    return [len(ld["requests"]) for ld in ray.get([s.replica_load.remote() for s in servers])]


async def _when_both_run(servers, timeout_s: float = 120) -> None:
    t0 = time.monotonic()
    while min(await asyncio.to_thread(_running, servers)) == 0:
        assert time.monotonic() - t0 < timeout_s, "the replicas never ran requests together"
        await asyncio.sleep(0.002)


def _consolidator(servers) -> Consolidator:
    # consolidate from the first decision (the tail is everything); move_s fixed: nothing to measure yet
    cfg = ConsolidationConfig(mode="consolidate", remaining_share=1.0, max_batch=8)
    return Consolidator(lambda: servers, cfg, interval_s=0.01, move_s=0.0)


def _same(outs, ref) -> None:
    for o, r in zip(outs, ref):
        assert o.token_ids == r.token_ids
        assert o.log_probs == pytest.approx(r.log_probs, abs=1e-5)


def _idle_router(router, timeout_s: float = 30) -> None:
    t0 = time.monotonic()
    while ray.get(router.get_total_inflight.remote()):  # releases are fire-and-forget
        assert time.monotonic() - t0 < timeout_s, ray.get(router.get_status.remote())
        time.sleep(0.01)


@pytest.mark.parametrize("drafter", ["eagle", "suffix"])
def test_moved_requests_are_token_identical_and_counted(setup, drafter):
    servers, router = _replicas(setup, drafter)
    try:
        client = _client(router)
        for step, sampling in enumerate(sorted(SAMPLING), 1):
            ref = asyncio.run(_generate_all(client, f"ref-{sampling}", sampling))
            ray.get([s.begin_step.remote(step) for s in servers])  # the step's statistics restart
            assert all(len(o.token_ids) > 20 for o in ref)

            async def moved_run():
                run = asyncio.ensure_future(_generate_all(client, f"mv-{sampling}", sampling))
                await _when_both_run(servers)
                moved = await asyncio.to_thread(_consolidator(servers).decide_once, GROUPS * N, [])
                return moved, await run

            moved, outs = asyncio.run(moved_run())
            assert moved > 0, "nothing moved"
            _same(outs, ref)
            assert sum(o.extra_fields.get("tlt_hops", 0) for o in outs) == moved
            stats = ray.get([s.step_stats.remote() for s in servers])
            assert sum(s["moved_out"] for s in stats) == moved
            _idle_router(router)
            drafted = {a for s in stats for a in s["arms"]}  # the drafter drafted, and it was verified
            assert sum(s["verifies"] for s in stats) > 0
            assert all(a.endswith("@suffix") == (drafter == "suffix") for a in drafted), drafted
    finally:
        _stop(servers, router)


class _KillAtHandOff:
    """verl's client with a kill -9 the moment the first moved answer reaches it: of the replica
    the request left (``source``) or of the one it goes to (``destination``)."""

    def __init__(self, inner, servers, pids, victim: str):
        self.inner, self.servers, self.pids, self.victim, self.killed = inner, servers, pids, victim, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, request_id, **kw):
        out = await self.inner.generate(request_id, **kw)
        move = out.extra_fields.get(MOVED_KEY)
        if move is not None and self.killed is None:
            dst = int(move["to"].rsplit("-", 1)[1])
            self.killed = dst if self.victim == "destination" else 1 - dst
            os.kill(self.pids[self.killed], signal.SIGKILL)
        return out


@pytest.mark.parametrize("victim", ["source", "destination"])
def test_a_replica_killed_at_the_hand_off_loses_no_request(setup, victim):
    servers, router = _replicas(setup, "suffix")
    try:
        pids = ray.get([s.pid.remote() for s in servers])
        inner = LLMServerClient(OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "tlt"}}}),
                                load_balancer_handle=router)
        ref = asyncio.run(_generate_all(MovingClient(inner), "ref", "sampled"))
        killer = _KillAtHandOff(inner, servers, pids, victim)
        client = MovingClient(killer)

        async def run():
            calls = asyncio.ensure_future(_generate_all(client, "kill", "sampled"))
            await _when_both_run(servers)
            moved = await asyncio.to_thread(_consolidator(servers).decide_once, GROUPS * N, [])
            return moved, await asyncio.wait_for(calls, 300)

        moved, outs = asyncio.run(run())
        assert moved > 0 and killer.killed is not None
        assert len(outs) == GROUPS * N
        _same(outs, ref)  # answered once each, with the tokens of its original seed
        assert ray.get(servers[killer.killed].pid.remote()) != pids[killer.killed]  # it did die (and restarted)
    finally:
        _stop(servers, router)


def test_a_source_killed_before_the_hand_off_loses_no_request(setup):
    """The move is decided and the destination reserved, then the source dies before it lets the
    requests go: their calls are retried on the restarted source, which (stale) forwards them to a
    healthy replica, and they start over with their seeds."""
    servers, router = _replicas(setup, "suffix")
    try:
        pids = ray.get([s.pid.remote() for s in servers])
        client = _client(router)
        ref = asyncio.run(_generate_all(client, "ref", "sampled"))

        async def run():
            calls = asyncio.ensure_future(_generate_all(client, "kill", "sampled"))
            await _when_both_run(servers)
            src = _running(servers).index(min(_running(servers)))
            assert await asyncio.to_thread(ray.get, servers[1 - src].reserve.remote(2, 2.0))
            os.kill(pids[src], signal.SIGKILL)
            return src, await asyncio.wait_for(calls, 300)

        src, outs = asyncio.run(run())
        _same(outs, ref)
        assert ray.get(servers[src].is_stale.remote())  # restarted: it forwarded, never sampled stale weights
    finally:
        _stop(servers, router)
