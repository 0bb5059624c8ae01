"""A resumed run's spot root (:mod:`tlt.integrations.verl.resume`): spot checkpoints the abandoned
run wrote after the checkpoint it resumes from are set aside, so the spot trainer, which resumes from
the newest checkpoint it sees, goes on from the run's own newest one. The whole resume runs for real
in tests/integrations/test_verl_resume.py; here its spot-root part, with verl's replicas left out."""

from __future__ import annotations

import json
import types

import pytest

pytest.importorskip("ray", reason="the verl extra is not installed (pip install 'tlt-rollout[verl]')")

from tlt.drafter.checkpoint import complete_steps, latest, step_dir  # noqa: E402
from tlt.integrations.verl import resume  # noqa: E402


def _checkpoint(root, step: int) -> None:
    d = step_dir(root, step)
    d.mkdir(parents=True)
    (d / ".metadata").write_text(str(step))


class _Pusher:
    """The drafter pusher's resume interface (serving needs replicas: not here)."""

    accepted, version, served = None, 0, None

    def restore(self, state):
        self.accepted = state["accepted"]

    def serve_accepted(self, root):
        self.served = (root, self.accepted, latest(root))


def _state_folder(tmp_path, spot_latest):
    folder = tmp_path / "global_step_4"
    (folder / "tlt").mkdir(parents=True)
    spot = [] if spot_latest is None else [4, 2]  # accepted and previous
    for s in spot:
        _checkpoint(folder / "tlt" / "spot", s)
    state = {"pusher": {"accepted": spot[0] if spot else None}, "spot_steps": spot, "tuners": []}
    if spot_latest != "absent":
        state["spot_latest"] = spot_latest
    (folder / "tlt" / "state.json").write_text(json.dumps(state))
    return folder


@pytest.mark.parametrize("spot_latest, kept, moved", [
    (5, [2, 4, 5], [6, 7]),       # 5 was trained (not yet pushed) before the save: the run's own
    (None, [], [5, 6, 7]),        # no spot checkpoint at the save: every one is the abandoned run's
    ("absent", [2, 4, 5, 6, 7], []),  # a state saved before this was recorded: nothing is moved
])
def test_checkpoints_written_after_the_resumed_from_one_are_set_aside(tmp_path, monkeypatch, spot_latest, kept,
                                                                      moved):
    root = tmp_path / "tlt_spot"
    for s in (5, 6, 7):  # the pruned 2 and 4 come back from the state folder
        _checkpoint(root, s)
    monkeypatch.setattr(resume.ray, "get", lambda refs, timeout=None: list(refs))
    pusher = _Pusher()
    resume.restore(_state_folder(tmp_path, spot_latest), pusher, lambda: [], str(root), None, lambda *a: None)
    assert complete_steps(root) == kept
    assert pusher.served == ((str(root), 4, kept[-1]) if kept else None)  # nothing to serve without one
    aside = list((root / resume.ABANDONED).glob("*/step-*")) if moved else []
    assert sorted(int(p.name.split("-")[1]) for p in aside) == moved
    assert all((p / ".metadata").is_file() for p in aside)  # kept whole, not deleted


def test_save_records_the_newest_spot_step(tmp_path, monkeypatch):
    root = tmp_path / "tlt_spot"
    for s in (3, 6, 8):
        _checkpoint(root, s)
    monkeypatch.setattr(resume.ray, "get", lambda refs, timeout=None: list(refs))
    pusher = types.SimpleNamespace(accepted=6, previous=3, version=2, state=lambda: {"accepted": 6})
    folder = resume.save(tmp_path / "global_step_9", pusher, lambda: [], str(root), None)
    state = json.loads((folder / "state.json").read_text())
    assert state["spot_latest"] == 8 and sorted(state["spot_steps"]) == [3, 6]
