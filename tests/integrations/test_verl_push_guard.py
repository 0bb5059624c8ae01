"""The drafter-push guard on the project's engine, end to end over Ray: a corrupted push is
rejected and rolled back, with the warning and the metric's count.

Real Ray actors of ``TLTServer`` (as ``TLTReplica`` launches them), real spot checkpoints in the
spot trainer's DCP format, the real ``DrafterPusher`` the ``tlt`` trainer runs at each step end.
The corruption is the test's: replica 1 is a ``TLTServer`` whose load of one checkpoint step
lands with one weight changed (a push that silently serves something else). The rollout
statistics for the soft check are given by the test, as the replicas' step records would carry
them (accept length collapsed to 1.0 after a push). Last, a replica whose served drafter changes
later (lost across a memory release/resume) gets it pushed again at the next step end.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch

pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'tlt-rollout[verl]')")
ray = pytest.importorskip("ray")

from tlt.drafter.checkpoint import TrainState, pinned, save_sync  # noqa: E402
from tlt.drafter.digest import checkpoint_digest  # noqa: E402
from tlt.drafter.eagle import Drafter, DrafterConfig  # noqa: E402
from tlt.rollout.target import TargetModel  # noqa: E402
from tlt.demo import job as demo  # noqa: E402
from tlt.integrations.verl.config import TLTConfig  # noqa: E402
from tlt.integrations.verl.drafter_push import DrafterPusher  # noqa: E402
from tlt.integrations.verl.server import TLTServer  # noqa: E402
from tlt.push_guard import GuardConfig  # noqa: E402

pytestmark = pytest.mark.slow
CORRUPT_STEP = 4


class CorruptingServer(TLTServer):
    """Loads checkpoint step ``CORRUPT_STEP`` with one draft weight changed."""

    def _load_drafter(self, version: int, step: int | None = None) -> int:
        out = super()._load_drafter(version, step)
        if step == CORRUPT_STEP:
            with torch.no_grad():
                next(self.core.drafters.served.parameters()).view(-1)[0] += 0.5
        return out

    def lose(self) -> None:
        """The drafter's weights change under the engine (a memory release/resume that drops them)."""
        with torch.no_grad():
            next(self.core.drafters.served.parameters()).view(-1)[0] += 0.5


@pytest.fixture(scope="module")
def cluster():
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the subclass ships by value
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="tlt-guard-test")
    yield
    ray.shutdown()


def _save(root, model: TargetModel, step: int) -> None:
    dcfg = DrafterConfig.for_target(model.config, "eagle")
    torch.manual_seed(step)
    d = Drafter(dcfg, model.embed_weight, model.lm_head.weight)
    frozen = (model.embed_weight, model.lm_head.weight)
    save_sync(root, step, {"train": TrainState(d, torch.optim.AdamW(d.parameters()), frozen=frozen)})


def test_a_corrupted_push_is_rejected_and_rolled_back(cluster, tmp_path, caplog):
    from tlt.demo.target_factory import ensure_target

    model_path = str(ensure_target(demo.QUICK.target, progress=False))
    model = TargetModel.from_pretrained(model_path)
    root = tmp_path / "spot"
    tlt = TLTConfig.from_mapping({"coordinator": {"enable": False}}).to_dict()
    servers = [ray.remote(cls).options(max_concurrency=16, num_cpus=0).remote(
        model_path=model_path, replica_rank=r, tlt=tlt, prompt_length=16, response_length=8, coordinator=None,
        spot_root=str(root), run_dir=str(tmp_path), seed=1) for r, cls in enumerate((TLTServer, CorruptingServer))]
    pusher = DrafterPusher(lambda: servers, GuardConfig(fraction=0.25, min_verifies=32))

    def served() -> list:
        return [s["digest"] for s in ray.get([x.served_drafter.remote() for x in servers])]

    def digest(step: int) -> str:
        return checkpoint_digest(root, step, torch.float32)

    assert served() == [None, None]  # no drafter yet
    _save(root, model, 2)
    pusher.step_end(str(root), [])
    assert (pusher.pushed, pusher.version, pusher.guard.rejected) == (2, 1, 0) and served() == [digest(2)] * 2

    # Hard check: replica 1 serves other weights than checkpoint step 4 -> both serve step 2 again.
    _save(root, model, CORRUPT_STEP)
    with caplog.at_level(logging.WARNING, logger="tlt.integrations.verl.drafter_push"):
        pusher.step_end(str(root), [])
    assert (pusher.pushed, pusher.version, pusher.guard.rejected) == (4, 3, 1) and served() == [digest(2)] * 2
    assert "push of spot step 4 rejected" in caplog.text and "replicas [1] of 2" in caplog.text
    pusher.step_end(str(root), [])  # a rejected step is not pushed again
    assert (pusher.version, served()) == (3, [digest(2)] * 2)

    # Soft check: step 6 is served as pushed, but the next rollout's EAGLE verifies accept ~1 token
    # where its spot session measured 2.4 held-out -> rolled back at that step's end.
    _save(root, model, 6)
    pusher.step_end(str(root), [{"heldout": [(6, 2.4)]}])
    assert (pusher.version, pusher.guard.rejected, served()) == (4, 1, [digest(6)] * 2)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tlt.integrations.verl.drafter_push"):
        pusher.step_end(str(root), [{"eagle_verifies": 40, "eagle_committed": 41},
                                    {"eagle_verifies": 40, "eagle_committed": 40}])
    assert (pusher.version, pusher.guard.rejected, served()) == (5, 2, [digest(2)] * 2)
    assert "live EAGLE accept length 1.01 over 80 verifies, held-out 2.40" in caplog.text
    out = ray.get(servers[0].generate.remote("r", [1, 5, 7, 9], {"temperature": 1.0, "max_tokens": 8}), timeout=120)
    assert 1 <= len(out.token_ids) <= 8  # the replica serves with the rolled-back drafter

    # Re-check at the next step end: replica 1 lost the served drafter (step 2) -> pushed to it again.
    assert pinned(root) == {2}  # the served step is kept for re-pushes
    ray.get(servers[1].lose.remote())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tlt.integrations.verl.drafter_push"):
        pusher.step_end(str(root), [])
    assert "replicas [1] no longer serve drafter version 5 (spot step 2)" in caplog.text
    assert (pusher.repushed, pusher.guard.rejected, served()) == (1, 2, [digest(2)] * 2)
