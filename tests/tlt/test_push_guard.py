"""The drafter-push guard's decisions (:mod:`tlt.push_guard`) and the weight digests it compares
(:mod:`tlt.drafter.digest`), on real spot checkpoints."""

from __future__ import annotations

import pytest
import torch

from tlt.drafter.checkpoint import TrainState, save_sync
from tlt.drafter.digest import checkpoint_digest, module_digest
from tlt.drafter.eagle import Drafter
from tests.drafter.test_spot import _target
from tlt.push_guard import GuardConfig, PushGuard


def _checkpoint(root, step: int, seed: int, method: str = "eagle", first_id: int = 0) -> Drafter:
    dcfg, embed, head = _target(method)
    torch.manual_seed(seed)
    d = Drafter(dcfg, embed, head)
    if method == "eagle3":  # a draft vocabulary of 40 target ids from first_id
        d.set_vocab_map(torch.arange(first_id, first_id + 40))
    save_sync(root, step, {"train": TrainState(d, torch.optim.AdamW(d.parameters()), frozen=(embed, head))})
    return d


def test_digests_of_a_checkpoint_and_of_the_module_it_was_saved_from(tmp_path):
    a, b = _checkpoint(tmp_path, 2, 0), _checkpoint(tmp_path, 4, 1)
    assert checkpoint_digest(tmp_path, 2, torch.float32) == module_digest(a)
    assert checkpoint_digest(tmp_path, 4, torch.float32) == module_digest(b) != module_digest(a)
    assert checkpoint_digest(tmp_path, 2, torch.bfloat16) == module_digest(a.to(torch.bfloat16))
    with torch.no_grad():
        next(a.parameters())[0, 0] += 1e-3  # one weight off
    assert checkpoint_digest(tmp_path, 2, torch.float32) != module_digest(a)
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        checkpoint_digest(tmp_path, 3, torch.float32)


def test_eagle3_digests_cover_the_vocabulary_map(tmp_path):
    """EAGLE-3 saves its draft-vocabulary map as buffers: both sides hash it (the checkpoint's side
    once did and the module's did not, so every EAGLE-3 push failed the hard check)."""
    a = _checkpoint(tmp_path, 2, 0, "eagle3", first_id=21)
    assert checkpoint_digest(tmp_path, 2, torch.float32) == module_digest(a)
    assert checkpoint_digest(tmp_path, 2, torch.bfloat16) == module_digest(a.to(torch.bfloat16))
    a.set_vocab_map(torch.arange(20, 60))  # the same weights drafting other tokens
    assert checkpoint_digest(tmp_path, 2, torch.float32) != module_digest(a)


def test_hard_check_rejects_any_replica_serving_other_weights():
    g = PushGuard()
    ok = g.hard(2, "aa", ["aa", "aa"])
    assert ok.ok and g.pending == 2 and g.rejected == 0
    bad = g.hard(4, "bb", ["bb", "aa"])
    assert not bad.ok and g.rejected == 1 and g.pending is None and "replicas [1] of 2" in bad.message
    assert not g.hard(6, "cc", [None, "cc"]).ok and g.rejected == 2  # a replica serving no drafter


def test_soft_check_judges_the_pending_push_against_its_heldout_accept_length():
    g = PushGuard(GuardConfig(fraction=0.25, min_verifies=32))
    g.note_heldout(2, 2.2)  # needs 1 + 0.25 * 1.2 = 1.3
    assert g.soft(100, 200) is None  # nothing pushed yet
    g.hard(2, "d", ["d"])
    assert g.soft(31, 31) is None and g.pending == 2  # too few verifies: no verdict yet
    v = g.soft(100, 129)
    assert not v.ok and g.rejected == 1 and g.pending is None
    assert "1.29 over 100 verifies, held-out 2.20 (needs >= 1.30)" in v.message
    g.hard(4, "e", ["e"])
    assert g.soft(100, 130) is None  # no held-out figure for step 4: no verdict
    g.note_heldout(4, 2.2)
    assert g.soft(100, 130).ok and g.rejected == 1
    off = PushGuard(GuardConfig(fraction=0.0))
    off.note_heldout(2, 3.0)
    off.hard(2, "d", ["d"])
    assert off.soft(100, 100) is None


@pytest.mark.parametrize("kw, match", [({"fraction": 1.5}, "fraction=1.5"), ({"min_verifies": 0}, "min_verifies=0")])
def test_guard_config_names_the_bad_value(kw, match):
    with pytest.raises(ValueError, match=match):
        GuardConfig(**kw)


def test_a_replica_pushed_its_drafter_again_rolls_back_with_the_others(monkeypatch, tmp_path):
    """A replica that lost its drafter across a memory release/resume gets the accepted step again
    (same version); a later soft rejection of that step sends every replica back to the drafter they
    all served before it, not the lost one to the rejected step. Real pusher and replica drafter
    records; the replicas' engines, Ray and the checkpoints are stood in."""
    import types

    import ray

    from tlt.integrations.verl import drafter_push
    from tlt.integrations.verl.replica_core import DrafterVersions

    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: refs)
    monkeypatch.setattr(drafter_push, "latest", lambda root: 1)  # spot step 1 is committed
    monkeypatch.setattr(drafter_push, "pin", lambda root, steps: None)
    monkeypatch.setattr(drafter_push, "_expected", lambda root, step, served: f"step{step}")

    class Replica:  # what a replica records (DrafterVersions) and what its engine runs
        def __init__(self):
            self.drafters, self.engine = DrafterVersions(served="start"), "start"
            for name in ("load_drafter", "rollback_drafter", "served_drafter"):
                setattr(self, name, types.SimpleNamespace(remote=getattr(self, "_" + name)))

        def _load_drafter(self, version, step=None):
            self.engine = step
            self.drafters.push(step, version)
            return version

        def _rollback_drafter(self, version):
            if self.drafters.rollback(version):
                self.engine = self.drafters.served
            return version

        def _served_drafter(self):
            return {"digest": None if self.engine == "start" else f"step{self.engine}", "dtype": "torch.float32"}

    replicas = [Replica(), Replica()]
    pusher = drafter_push.DrafterPusher(lambda: replicas, GuardConfig(fraction=0.25, min_verifies=32))
    pusher.step_end(str(tmp_path), [])  # step 1 pushed, served as pushed
    replicas[1].engine = "start"  # its draft weights lost across a release/resume
    pusher.step_end(str(tmp_path), [{"heldout": [(1, 3.0)], "eagle_verifies": 10, "eagle_committed": 12}])  # no verdict yet
    assert [r.engine for r in replicas] == [1, 1] and pusher.repushed == 1
    pusher.step_end(str(tmp_path), [{"eagle_verifies": 100, "eagle_committed": 100}])  # step 1 drafts below its held-out figure
    assert pusher.accepted is None and [r.engine for r in replicas] == ["start", "start"]
    assert [r.drafters.version for r in replicas] == [pusher.version] * 2
