"""A resumed verl run: RollPacker's tail batching (:mod:`tlt.integrations.verl.tail_round`) and TLT's
own state (:mod:`tlt.integrations.verl.resume`) carry across a checkpoint.

Two real verl GRPO runs (Ray, FSDP2 on gloo, two replicas of the project's engine, full TLT:
speculation, spot training, tail consolidation, tail batching) of the quick demo's 8 prompts, 4 per
step, 2 responses each, tail batching launching 8 prompts x 3 responses per short round. The first
runs steps 1-5 from no drafter and checkpoints step 5, a short round, with 4 prompts queued (five
steps: the quick demo's idle windows fit a spot step only sometimes, and a drafter must have been
pushed before the checkpoint); the second resumes from it (``trainer.resume_mode=auto``) and runs
steps 6 (a long round: the saved queue) and 7 (a short round of new prompts), four epochs in all.
One pair of runs serves both tests: each verl start costs about 100 s of CI's budget.

Tail batching, from the step records and the trained responses (``tlt_responses.jsonl``):
- rounds alternate short, long from step 1 to step 7; the long round after the resume trains the
  queue the checkpoint holds, and the short round after it fetches the next epoch's prompts;
- every prompt is trained exactly once per epoch, every trained group has exactly 2 responses;
- what a short round trains is exactly its kept (finished) responses, none of its dropped ones;
- the dropped requests' features reached the DataBuffer (the engine handed them over, reason
  ``aborted``), and speculation ran.

TLT's state: step 6 serves, from its first request, the drafter, draft history and tuner statistics
of step 5 (before that fix a resumed step served no EAGLE drafter, the suffix drafter only, drafter
version 0, and its tuner explored from scratch).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess

import pytest
import torch

pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'tlt-rollout[verl]')")

from tlt.demo import job as demo  # noqa: E402
from tlt.drafter.digest import checkpoint_digest  # noqa: E402

pytestmark = pytest.mark.slow
SAVED = 5  # the step the first run checkpoints (its last): a short round, with prompts queued
STEPS = SAVED + 2  # the resumed run's last: a long round (the saved queue), then a short one


def _run(tmp_path, steps: int, *extra: str) -> str:
    from tlt.demo.target_factory import ensure_target

    size = demo.QUICK
    target = ensure_target(size.target, progress=False)
    train = demo.write_parquet(tmp_path / "train.parquet", size.prompts, 7)
    overrides = [o for o in demo.arm_overrides("G", tmp_path, size, target, tmp_path / "none", train, train)
                 if not o.startswith(("tlt.drafter.init_path", "trainer.total_training_steps", "trainer.save_freq"))]
    cmd = demo.verl_command([*overrides, f"trainer.total_training_steps={steps}", f"trainer.save_freq={SAVED}",
                             "tlt.spot.interval=1", *extra])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path,
                       env={**os.environ, "VERL_PLATFORM": "cpu"})
    text = p.stdout + p.stderr
    (tmp_path / f"verl-{steps}.log").write_text(text)
    assert p.returncode == 0, "\n".join(x for x in text.splitlines()
                                        if "Error" in x or "error" in x or "File " in x)[-4000:]
    return text


def _jsonl(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Runs both; returns (arm directory, what step SAVED's checkpoint held, the resumed run's log)."""
    tmp_path = tmp_path_factory.mktemp("resume")
    _run(tmp_path, SAVED, "trainer.resume_mode=disable")
    arm = tmp_path / "arm-G"
    saved = arm / f"global_step_{SAVED}"
    held = {"tail": torch.load(saved / "tlt_tail_batching.pt", weights_only=False),
            "state": json.loads((saved / "tlt" / "state.json").read_text()), "tlt": saved / "tlt"}
    pusher = held["state"]["pusher"]
    if pusher["accepted"] is not None:
        held["digest"] = checkpoint_digest(saved / "tlt" / "spot", pusher["accepted"], torch.float32)
    text = _run(tmp_path, STEPS, "trainer.resume_mode=auto")
    return arm, held, text


def test_tail_batching_trains_each_prompt_once_per_epoch_across_a_resume(resumed):
    arm, held, _ = resumed
    size = demo.QUICK
    queued = sorted(int(i) for i in held["tail"]["queue"]["index"])
    assert len(queued) == size.batch  # the short round's 8 launched, 4 trained, 4 queued

    recs = {r["step"]: r for r in _jsonl(arm / "tlt_steps.jsonl")}
    steps = list(range(1, STEPS + 1))
    assert sorted(recs) == steps
    rounds = {s: r["tail_batching"] for s, r in recs.items()}
    assert [rounds[s]["round"] for s in steps] == ["short", "long"] * (STEPS // 2) + ["short"]
    assert [rounds[s]["epoch"] for s in steps] == [(s - 1) // 2 for s in steps]
    assert sorted(rounds[SAVED + 1]["launched_indices"]) == queued  # the resumed run trained the saved queue

    trained = collections.defaultdict(list)  # step -> (index, sample)
    for r in _jsonl(arm / "tlt_responses.jsonl"):
        trained[r["step"]].append((r["index"], r["sample"]))
    for epoch_steps in ((1, 2), (3, 4), (5, 6)):
        groups = collections.Counter(i for s in epoch_steps for i, _ in trained[s])
        assert sorted(groups) == list(range(size.prompts)), f"steps {epoch_steps}: {sorted(groups)}"
        assert set(groups.values()) == {size.n}  # every group exactly R0 responses, every prompt once
    shorts = [s for s in steps if s % 2]  # the last one ran after the resume, on the restored dataloader
    dropped = 0
    for s in shorts:
        rec = rounds[s]
        assert rec["launched_prompts"] == 2 * size.batch and rec["responses_per_prompt"] == 3
        kept = {tuple(x) for x in rec["kept_responses"]}
        assert set(trained[s]) == kept and len(kept) == size.batch * size.n
        assert not kept & {tuple(x) for x in rec["dropped_responses"]}
        dropped += len(rec["dropped_responses"])
    assert dropped > 0, "no request was running when the short rounds dropped: nothing was tested"
    for s in shorts:  # a dropped request that had decoded handed its features to the DataBuffer
        if any(rounds[s]["dropped_partial_lengths"]):
            assert sum(f.get("aborted", 0) for f in recs[s]["buffer_fed"]) > 0, s
    # (under load every dropped request may still wait for its first prefill: then none has features)
    assert sum(recs[s]["tlt/spec_verifies"] for s in recs) > 0


def test_a_resumed_run_serves_the_checkpointed_drafter_from_its_first_step(resumed):
    arm, held, text = resumed
    pusher = held["state"]["pusher"]
    assert pusher["accepted"] is not None, f"no spot checkpoint was pushed in {SAVED} steps: nothing to resume"
    assert (held["tlt"] / "history.jsonl").is_file() and len(held["state"]["tuners"]) == 2
    assert all(t is not None for t in held["state"]["tuners"])

    recs = _jsonl(arm / "tlt_steps.jsonl")
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    first = recs[SAVED]  # the resumed run's first step
    # the resumed step's rollout ran on the checkpointed drafter, on both replicas, and drafted with it
    assert first["replica_drafter_version"] == [pusher["version"]] * 2
    assert first["proposers"] == ["eagle", "eagle"]
    assert first["tlt/proposer_share/eagle"] > 0
    resumed_rec = first["resumed"]
    assert resumed_rec["from_tlt_state"] and resumed_rec["tuners"] == [True, True] and resumed_rec["history"] > 0
    assert (resumed_rec["version"], resumed_rec["spot_step"]) == (pusher["version"], pusher["accepted"])
    assert "holds no TLT state" not in text
    # the served step is in the spot root again (the pusher's read-back checked the replicas serve it)
    assert checkpoint_digest(arm / "tlt_spot", pusher["accepted"], torch.float32) == held["digest"]
