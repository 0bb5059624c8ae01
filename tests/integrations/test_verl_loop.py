"""Whole verl 0.9.1 GRPO runs on this CPU (real Ray, TransferQueue, FSDP2 on gloo, our rollout).

- ``tlt demo --quick``, run as README command 1 runs it (the console script, an empty working
  directory, no ``--out``): three arms of ``demo.QUICK.steps`` RL steps; arm C (full TLT) must show
  speculation (accept length > 1), a DataBuffer that grew from the old-log-prob capture, a drafter
  version that advanced, replicas the coordinator promoted and stopped (IDLE -> TRAINING -> BUSY),
  rollout log-probs equal to the actor's recomputed ones (fp32), and the summary keys.
- a bad ``tlt.*`` value stops the run with one line before Ray or any worker starts, with the
  project's engine or SGLang as the rollout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'tlt-rollout[verl]')")

from tlt.demo import job as demo  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")  # a new user's: the demo builds its target itself
    cwd = tmp_path_factory.mktemp("fresh")  # empty: the default --out runs/demo is relative to it
    tlt = Path(sys.executable).with_name("tlt")  # the console script pip installed beside python
    p = subprocess.run([str(tlt), "-q", "demo", "--quick"], cwd=cwd, capture_output=True, text=True, timeout=1800,
                       env={**os.environ, "TLT_CACHE": str(cache)})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = cwd / "runs" / "demo"
    assert f"wrote {out / 'summary.json'}" in p.stdout
    return out, json.loads((out / "summary.json").read_text())


def _records(out, arm):
    return [json.loads(x) for x in (out / f"arm-{arm}" / "tlt_steps.jsonl").read_text().splitlines()]


def test_demo_summary_keys(quick_demo):
    out, s = quick_demo
    for key in ("accept_length_ratio_spot_vs_stale", "rollout_time_ratio_ar_over_tlt", "step_time_ratio_ar_over_tlt",
                "reward_mean_by_arm", "target_drift"):
        assert key in s, key
    assert set(s["reward_mean_by_arm"]) == {"A", "B", "C"}
    assert sorted(map(int, s["careful_share_by_step"])) == list(range(1, demo.QUICK.steps + 1))  # JSON keys
    assert all(0 <= v <= 1 for v in s["careful_share_by_step"].values())
    assert s["steps"] == demo.QUICK.steps
    for arm in "ABC":  # the summary's step count is every arm's record count
        assert len(_records(out, arm)) == s["steps"], arm
    assert (out / "demo.png").stat().st_size > 10_000


def test_full_tlt_arm_adapts(quick_demo):
    out, _ = quick_demo
    recs = _records(out, "C")
    assert [r["step"] for r in recs] == list(range(1, demo.QUICK.steps + 1))
    verifies = sum(r["tlt/spec_verifies"] for r in recs)
    assert verifies > 0 and sum(r["tlt/spec_committed"] for r in recs) / verifies > 1.0
    assert recs[-1]["tlt/buffer_samples"] > 0  # hidden states captured in the old-log-prob forward
    assert recs[-1]["tlt/drafter_version"] >= 1  # a spot-trained drafter reached the replicas
    assert recs[-1]["tlt/drafter_push_rejected"] == 0  # served as pushed (the push guard's checks)
    assert sum(r["tlt/spot_train_steps"] for r in recs) >= 1
    assert any(r["stopped"] for r in recs), "no replica was promoted to training and stopped"
    for r in recs:
        assert r["training/rollout_probs_diff_max"] < 1e-4  # rollout log-probs == actor's, fp32
        assert r["coordinator_reachable"]
        assert r["tlt/history_push_failures"] == r["tlt/response_record_failures"] == r["tlt/feeds_dropped"] == 0


def test_arms_differ_only_in_speculation(quick_demo):
    out, _ = quick_demo
    a, b = _records(out, "A"), _records(out, "B")
    assert all(r["tlt/sd_token_share"] == 0 for r in a)  # A: plain decoding
    assert all(r["tlt/spot_train_steps"] == 0 and r["tlt/drafter_version"] == 0 for r in b)  # B: frozen
    assert any(r["tlt/sd_token_share"] > 0 for r in b)


def _verl(tmp_path, *extra, timeout=600):
    size = demo.QUICK
    from tlt.demo.target_factory import ensure_target

    target = ensure_target(size.target, progress=False)
    train = demo.write_parquet(tmp_path / "train.parquet", size.prompts, 7)
    overrides = demo.arm_overrides("A", tmp_path, size, target, tmp_path / "none", train, train)
    overrides = [o for o in overrides if not o.startswith("tlt.")]
    cmd = demo.verl_command([*overrides, "trainer.total_training_steps=1", *extra])
    env = {**os.environ, "VERL_PLATFORM": "cpu"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)


@pytest.mark.parametrize("rollout,bad,line", [
    ("tlt", "tlt.spot.lr=-1", "tlt config: tlt.spot.lr=-1.0 is not allowed; use a float in (0, 1]"),
    ("sglang", "tlt.sglang.readback_elements=0",
     "tlt config: tlt.sglang.readback_elements=0 is not allowed; use an int >= 1")])
def test_bad_tlt_value_fails_before_ray(tmp_path, rollout, bad, line):
    t0 = time.monotonic()
    p = _verl(tmp_path, f"actor_rollout_ref.rollout.name={rollout}", bad, timeout=120)
    assert p.returncode == 2
    errors = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert errors == [f"error: {line}"]
    assert "ray init kwargs" not in p.stdout  # nothing was started
    assert time.monotonic() - t0 < 60


def _run_and_kill_after_step1(tmp_path, kill, *extra, steps=3, then=None):
    """A full-TLT run (n-gram, fresh drafter); ``kill(arm_dir)`` once step 1 is recorded, and
    ``then = (step, kill2)``: ``kill2(arm_dir)`` once ``step`` is recorded."""
    size = demo.QUICK
    from tlt.demo.target_factory import ensure_target

    target = ensure_target(size.target, progress=False)
    train = demo.write_parquet(tmp_path / "train.parquet", size.prompts, 7)
    overrides = demo.arm_overrides("C", tmp_path, size, target, tmp_path / "none", train, train)
    overrides = [o for o in overrides if not o.startswith(("tlt.drafter.init_path", "trainer.total_training_steps"))]
    cmd = demo.verl_command([*overrides, f"trainer.total_training_steps={steps}", *extra])
    log, arm = tmp_path / "verl.log", tmp_path / "arm-C"
    records = arm / "tlt_steps.jsonl"
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path,
                             env={**os.environ, "VERL_PLATFORM": "cpu"})
        try:
            deadline = time.monotonic() + 600
            while not (records.exists() and records.read_text().strip()):
                assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(1)
            kill(arm)
            if then is not None:
                while len(records.read_text().splitlines()) < then[0]:
                    assert p.poll() is None and time.monotonic() < deadline + 600, log.read_text()[-3000:]
                    time.sleep(0.02)
                then[1](arm)
            rc = p.wait(timeout=600)
        finally:
            if p.poll() is None:
                p.kill()
    text = log.read_text()
    assert rc == 0, text[-3000:]
    recs = _records(tmp_path, "C")
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    return recs, text


def _kill_coordinator(arm) -> None:
    os.kill(int((arm / "tlt_coordinator.pid").read_text()), 9)


def test_spot_trainer_then_coordinator_killed(tmp_path):
    """Two faults in one run (one verl start-up, not two).

    - kill -9 of a replica while its spot trainer trains (the trainer lives in the replica's
      process; a replica killed between steps is ``test_verl_replica_restart.py``'s): the RL step
      completes with every request served (a restarted replica forwards its requests to a healthy
      one until the next policy push), the restarted replica serves the drafter of the last
      committed checkpoint, and training resumes from that checkpoint;
    - then kill -9 of the coordinator once step 4 is recorded: the next step that begins after the
      kill (step 5, or step 6 when step 5 reached the coordinator first: verl starts it right after
      writing step 4's record) runs without adaptation, with a warning, and the run finishes."""
    from tlt.drafter.checkpoint import latest

    killed = {}

    def kill(arm):
        log = arm / "tlt_coordinator.log"
        seen = log.read_text().count(" TRAINING (session")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            lines = [x for x in log.read_text().splitlines() if " TRAINING (session" in x]
            if len(lines) > seen:
                worker = lines[-1].split("worker ", 1)[1].split()[0]  # replica-<rank>
                pid = int((arm / f"tlt_replica_{worker.split('-')[1]}.pid").read_text())
                killed.update(worker=worker, checkpoint=latest(arm / "tlt_spot"), step=_last_step(arm))
                os.kill(pid, 9)
                return
            time.sleep(0.02)
        raise AssertionError("no replica was promoted to training after step 1")

    recs, text = _run_and_kill_after_step1(tmp_path, kill, "tlt.spot.interval=1", "tlt.coordinator.done_timeout_s=3",
                                           steps=6, then=(4, _kill_coordinator))
    coord = (tmp_path / "arm-C" / "tlt_coordinator.log").read_text()
    assert f"worker {killed['worker']} LOST" in coord  # it died while in a training session
    assert "restarted: serving again after the next policy push" in text
    assert "refusing to sample" not in text  # no request failed: a healthy replica served them
    at = killed["step"] + 1  # the step whose rollout was running at the kill
    final = latest(tmp_path / "arm-C" / "tlt_spot")
    assert final is not None and final >= (killed["checkpoint"] or 0)
    if killed["checkpoint"] is not None and at < len(recs):  # restored the committed drafter
        assert all(p == "eagle" for p in recs[at]["proposers"]), [r["proposers"] for r in recs]
    assert sum(r["tlt/spot_train_steps"] for r in recs[at - 1:4]) >= 1  # training went on after the kill
    assert all(r["coordinator_reachable"] for r in recs[:4]) and not recs[5]["coordinator_reachable"]
    assert "coordinator unreachable" in text


def _last_step(arm) -> int:
    path = arm / "tlt_steps.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0
