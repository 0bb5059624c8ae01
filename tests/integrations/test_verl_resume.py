"""A resumed verl run serves, from its first step, the drafter, draft history and tuner statistics of
the step it resumes from (:mod:`tlt.integrations.verl.resume`).

Two real verl GRPO runs (Ray, FSDP2 on gloo, two replicas of the project's engine, spot training):
the first runs 4 steps from no drafter and checkpoints step 4; the second resumes from it
(``trainer.resume_mode=auto``) and runs step 5. Before the fix, step 5 served no EAGLE drafter
(the suffix drafter only, drafter version 0) and its tuner explored from scratch.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'tlt-rollout[verl]')")

from tlt.demo import job as demo  # noqa: E402
from tlt.drafter.digest import checkpoint_digest  # noqa: E402

pytestmark = pytest.mark.slow


def _run(tmp_path, steps: int, *extra: str) -> str:
    from tlt.demo.target_factory import ensure_target

    size = demo.QUICK
    target = ensure_target(size.target, progress=False)
    train = demo.write_parquet(tmp_path / "train.parquet", size.prompts, 7)
    overrides = demo.arm_overrides("C", tmp_path, size, target, tmp_path / "none", train, train)
    overrides = [o for o in overrides
                 if not o.startswith(("tlt.drafter.init_path", "trainer.total_training_steps", "trainer.save_freq"))]
    cmd = demo.verl_command([*overrides, f"trainer.total_training_steps={steps}", "trainer.save_freq=4",
                             "tlt.spot.interval=1", *extra])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path,
                       env={**os.environ, "VERL_PLATFORM": "cpu"})
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    return p.stdout + p.stderr


def test_a_resumed_run_serves_the_checkpointed_drafter_from_its_first_step(tmp_path):
    _run(tmp_path, 4, "trainer.resume_mode=disable")
    arm = tmp_path / "arm-C"
    saved = arm / "global_step_4" / "tlt"
    state = json.loads((saved / "state.json").read_text())
    pusher = state["pusher"]
    assert pusher["accepted"] is not None, "no spot checkpoint was pushed in 4 steps: nothing to resume"
    assert (saved / "history.jsonl").is_file() and len(state["tuners"]) == 2
    assert all(t is not None for t in state["tuners"])
    expected = checkpoint_digest(saved / "spot", pusher["accepted"], torch.float32)

    text = _run(tmp_path, 5, "trainer.resume_mode=auto")
    recs = [json.loads(x) for x in (arm / "tlt_steps.jsonl").read_text().splitlines()]
    first = recs[-1]
    assert first["step"] == 5 and [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    # step 5's rollout ran on the checkpointed drafter, on both replicas, and drafted with it
    assert first["replica_drafter_version"] == [pusher["version"]] * 2
    assert first["proposers"] == ["eagle", "eagle"]
    assert first["tlt/proposer_share/eagle"] > 0
    resumed = first["resumed"]
    assert resumed["from_tlt_state"] and resumed["tuners"] == [True, True] and resumed["history"] > 0
    assert (resumed["version"], resumed["spot_step"]) == (pusher["version"], pusher["accepted"])
    assert "holds no TLT state" not in text
    # the served step is in the spot root again (the pusher's read-back checked the replicas serve it)
    assert checkpoint_digest(arm / "tlt_spot", pusher["accepted"], torch.float32) == expected
