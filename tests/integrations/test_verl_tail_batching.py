"""RollPacker's tail batching in a real verl GRPO run (:mod:`tlt.integrations.verl.tail_round`).

Two real verl runs (Ray, FSDP2 on gloo, two replicas of the project's engine, full TLT: speculation,
spot training, tail consolidation) of the quick demo's 8 prompts, 4 per step, 2 responses each,
with tail batching (8 prompts x 3 responses launched per short round). The first runs step 1 and
checkpoints it with 4 prompts queued; the second resumes (``trainer.resume_mode=auto``) and runs
steps 2-4 (two epochs in all). Checked from the step records and the trained responses
(``tlt_responses.jsonl``):
- rounds short, long, short, long; the long round after the resume trains the queue the checkpoint
  holds;
- every prompt is trained exactly once per epoch, every trained group has exactly 2 responses;
- what a short round trains is exactly its kept (finished) responses, none of its dropped ones;
- the dropped requests' features reached the DataBuffer (the engine handed them over, reason
  ``aborted``), and speculation ran.
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

pytestmark = pytest.mark.slow


def _run(tmp_path, steps: int, *extra: str) -> None:
    from tlt.demo.target_factory import ensure_target

    size = demo.QUICK
    target = ensure_target(size.target, progress=False)
    train = demo.write_parquet(tmp_path / "train.parquet", size.prompts, 7)
    overrides = [o for o in demo.arm_overrides("G", tmp_path, size, target, tmp_path / "none", train, train)
                 if not o.startswith(("tlt.drafter.init_path", "trainer.total_training_steps", "trainer.save_freq"))]
    cmd = demo.verl_command([*overrides, f"trainer.total_training_steps={steps}", "trainer.save_freq=1",
                             "tlt.spot.interval=1", *extra])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path,
                       env={**os.environ, "VERL_PLATFORM": "cpu"})
    (tmp_path / f"verl-{steps}.log").write_text(p.stdout + p.stderr)
    assert p.returncode == 0, "\n".join(x for x in (p.stdout + p.stderr).splitlines()
                                        if "Error" in x or "error" in x or "File " in x)[-4000:]


def _jsonl(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_tail_batching_trains_each_prompt_once_per_epoch_across_a_resume(tmp_path):
    size = demo.QUICK
    _run(tmp_path, 1, "trainer.resume_mode=disable")
    arm = tmp_path / "arm-G"
    saved = torch.load(arm / "global_step_1" / "tlt_tail_batching.pt", weights_only=False)
    queued = sorted(int(i) for i in saved["queue"]["index"])
    assert len(queued) == size.batch  # the short round's 8 launched, 4 trained, 4 queued

    _run(tmp_path, 4, "trainer.resume_mode=auto")
    recs = {r["step"]: r for r in _jsonl(arm / "tlt_steps.jsonl")}
    assert sorted(recs) == [1, 2, 3, 4]
    rounds = {s: r["tail_batching"] for s, r in recs.items()}
    assert [rounds[s]["round"] for s in (1, 2, 3, 4)] == ["short", "long", "short", "long"]
    assert [rounds[s]["epoch"] for s in (1, 2, 3, 4)] == [0, 0, 1, 1]
    assert sorted(rounds[2]["launched_indices"]) == queued  # the resumed run trained the saved queue

    trained = collections.defaultdict(list)  # step -> (index, sample)
    for r in _jsonl(arm / "tlt_responses.jsonl"):
        trained[r["step"]].append((r["index"], r["sample"]))
    for epoch_steps in ((1, 2), (3, 4)):
        groups = collections.Counter(i for s in epoch_steps for i, _ in trained[s])
        assert sorted(groups) == list(range(size.prompts)), f"steps {epoch_steps}: {sorted(groups)}"
        assert set(groups.values()) == {size.n}  # every group exactly R0 responses, every prompt once
    dropped = 0
    for s in (1, 3):
        rec = rounds[s]
        assert rec["launched_prompts"] == 2 * size.batch and rec["responses_per_prompt"] == 3
        kept = {tuple(x) for x in rec["kept_responses"]}
        assert set(trained[s]) == kept and len(kept) == size.batch * size.n
        assert not kept & {tuple(x) for x in rec["dropped_responses"]}
        dropped += len(rec["dropped_responses"])
    assert dropped > 0, "no request was running when the short rounds dropped: nothing was tested"
    fed = [sum(f.get("aborted", 0) for f in recs[s]["buffer_fed"]) for s in (1, 3)]
    ran = [s for s in (1, 3) if any(rounds[s]["dropped_partial_lengths"])]  # a dropped request had decoded
    assert all(fed[(1, 3).index(s)] > 0 for s in ran)  # its features went to the DataBuffer
    # (under load every dropped request may still wait for its first prefill: then none has features)
    assert sum(recs[s]["tlt/spec_verifies"] for s in recs) > 0
