"""TLT's whole loop on verl's SGLang rollout, in a real verl 0.9.1 GRPO run on this CPU.

SGLang's engine needs CUDA (and the lent GPU machine has no SGLang), so each replica's SGLang
server is a stand-in (``tests/sglang_env/standin.py``): real HTTP, every body parsed into SGLang
0.5.23's own request classes, generation from the project's engine (plain decoding; no
speculation is measured here). Everything else is what a GPU user runs: verl with
``rollout.name=sglang`` and ``trainer.v1.trainer_mode=tlt``, TLT's SGLang replica and server actor
(attached to the stand-ins: ``tlt.sglang.attach``), verl's SGLang worker adapter with TLT's pushes,
the coordinator, spot training in the server actors, the push guard. The Ray processes import
SGLang 0.5.23 through ``cpu_env`` (a ``sitecustomize`` on their ``PYTHONPATH``), whose push
serializer then carries CPU tensors (its CUDA-IPC reducer patch is left out: no GPU here). Replica 1's
stand-in answers slowly, so replica 0 idles in the tail of every step.

Checked: the run finishes; tail batching's short round drops the slow replica's requests over
SGLang's ``/abort_request`` and trains only the kept responses, and the long round runs the queue;
a replica goes IDLE -> TRAINING -> BUSY with its KV cache released before it reports IDLE and
resumed before its next request, and both inside verl's own sleep / wake-up calls (a request while the cache is released fails the stand-in); the drafter push is
draft-only in 0.5.23's format; the stand-in corrupts it and the guard rejects it by read-back,
rolls back (the start drafter pushed again) with one warning and ``tlt/drafter_push_rejected``.
0.5.12's request formats stay covered by ``test_sglang_push.py``.
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
ROOT = Path(__file__).resolve().parents[2]
ENVS = Path(os.environ.get("TLT_SGLANG_ENVS", ROOT / ".sglang-envs"))
VERSION = "0.5.23"
SITECUSTOMIZE = """\
import os
if os.environ.get("TLT_TEST_SGLANG_SITE"):
    from tests.sglang_env import cpu_env
    cpu_env.activate(os.environ["TLT_TEST_SGLANG_SITE"])
    cpu_env.cpu_tensor_pushes()  # SGLang's push serializer is written for CUDA IPC
"""


def _standin(tmp_path: Path, k: int, site: Path, model: Path, max_len: int, env: dict, *extra: str):
    out = tmp_path / f"standin-{k}"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "tests.sglang_env.standin", str(site), str(model), str(max_len),
                             str(out), *extra], cwd=ROOT, env=env, stdout=open(out / "log", "w"),
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not (out / "port").exists():
        assert proc.poll() is None and time.monotonic() < deadline, (out / "log").read_text()[-3000:]
        time.sleep(0.2)
    return proc, int((out / "port").read_text()), out


def _calls(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "calls.jsonl").read_text().splitlines()]


def test_tlt_loop_on_sglang(tmp_path):
    site = ENVS / VERSION
    if not (site / ".complete").exists():
        pytest.skip(f"SGLang {VERSION} is not installed for the CPU tests: bash tests/sglang_env/install.sh")
    from tlt.demo.target_factory import ensure_target

    size = demo.QUICK
    target = ensure_target(size.target, progress=False)
    (tmp_path / "py").mkdir()
    (tmp_path / "py" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "VERL_PLATFORM": "cpu", "TLT_TEST_SGLANG_SITE": str(site),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "py"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    max_len = size.max_prompt + size.max_response + 1
    # replica 0's server corrupts draft push version 1 (the first push); replica 1's answers slowly
    s0, p0, out0 = _standin(tmp_path, 0, site, target, max_len, env, "1")
    s1, p1, out1 = _standin(tmp_path, 1, site, target, max_len, env, "", "4")
    try:
        train = demo.write_parquet(tmp_path / "train.parquet", size.prompts, 7)
        # arm C less its tail consolidation: requests move between replicas of the project's engine only
        overrides = [o for o in demo.arm_overrides("C", tmp_path, size, target, tmp_path / "none", train, train)
                     if not o.startswith(("tlt.drafter.init_path", "trainer.total_training_steps", "tlt.tail."))]
        cmd = demo.verl_command([*overrides, "trainer.total_training_steps=2", "actor_rollout_ref.rollout.name=sglang",
                                 "tlt.buffer.capture=old_log_prob", f"tlt.sglang.attach='127.0.0.1:{p0},127.0.0.1:{p1}'",
                                 "tlt.sglang.readback_elements=16", *demo.TAIL_BATCHING])
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    finally:
        s0.kill()
        s1.kill()
    text = p.stdout + p.stderr
    assert p.returncode == 0, text[-4000:]
    arm = tmp_path / "arm-C"
    recs = [json.loads(x) for x in (arm / "tlt_steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    assert recs[-1]["tlt/buffer_samples"] > 0  # the actor's old-log-prob capture fed the DataBuffers
    assert sum(r["tlt/spot_train_steps"] for r in recs) >= 1
    assert any(r["stopped"] for r in recs), "no replica was promoted to training and stopped"
    # tail batching composes: a short round (8 prompts x 3 launched, the first 4 to finish 2 trained,
    # the slow replica's requests dropped through SGLang's /abort_request), then the long round
    short, long = (r["tail_batching"] for r in recs)
    assert (short["round"], long["round"]) == ("short", "long")
    assert sorted(long["launched_indices"]) == sorted(set(short["launched_indices"])
                                                      - {i for i, _ in short["kept_responses"]})
    trained = {(r["index"], r["sample"]) for r in map(json.loads, (arm / "tlt_responses.jsonl").read_text().splitlines())
               if r["step"] == 1}
    assert trained == {tuple(x) for x in short["kept_responses"]} and short["dropped_responses"]
    assert any(c["endpoint"] == "generate" and c["reason"] == "abort" for c in _calls(out1))
    coord = (arm / "tlt_coordinator.log").read_text()
    assert " TRAINING (session" in coord

    calls0 = _calls(out0)
    errors = [c for c in calls0 + _calls(out1) if "error" in c]
    assert not errors, errors[:3]
    seq = [(c["endpoint"], tuple(c.get("body", {}).get("tags") or ())) for c in calls0
           if c["endpoint"] in ("release_memory_occupation", "resume_memory_occupation")]
    tlt_release = ("release_memory_occupation", ("kv_cache",))
    assert tlt_release in seq, seq  # TLT released the KV cache for spot training ...
    i = seq.index(tlt_release)
    assert seq[i + 1] == ("resume_memory_occupation", ("kv_cache",)), seq  # ... and took it back
    assert ("release_memory_occupation", ("kv_cache", "weights")) in seq[i + 2:], seq  # before verl's sleep

    # the first drafter push: draft-only, 0.5.23's format, corrupted by replica 0's server
    eps = [c["endpoint"] for c in calls0]
    first = next(j for j, c in enumerate(calls0) if c["endpoint"] == "update_weights_from_tensor"
                 and c.get("selector") == "draft")
    assert calls0[first]["weight_version"] == "draft-1" and "fc.weight" in calls0[first]["names"]
    assert eps[first - 2:first] == ["pause_generation", "begin_weight_update"]
    assert eps[first + 1:first + 3] == ["end_weight_update", "continue_generation"]
    assert calls0[first - 1]["body"] == {"selector": "draft"}
    policy = [c for c in calls0 if c["endpoint"] == "update_weights_from_tensor" and c.get("selector") == "target"]
    assert policy and not any(set(c["names"]) & {"fc.weight"} for c in policy)
    # the guard read it back, rejected it, and every replica got the start drafter again (version 2)
    assert any(c["endpoint"] == "get_weights_by_name" and c["found"] for c in calls0[first:])
    rollback = [c for c in calls0[first + 1:] if c["endpoint"] == "update_weights_from_tensor"
                and c.get("selector") == "draft"]
    assert [c["weight_version"] for c in rollback] == ["draft-2"]
    assert [c["weight_version"] for c in _calls(out1) if c.get("selector") == "draft"] == ["draft-1", "draft-2"]
    assert recs[-1]["tlt/drafter_push_rejected"] == 1
    warnings = [x for x in text.splitlines() if "rejected, previous drafter served again" in x]
    assert len(warnings) == 1 and "replicas [0] of 2 do not serve" in warnings[0], warnings


def _check(module: str) -> dict:
    """Run ``tests.sglang_env.<module>`` with SGLang importable; the JSON of its last line."""
    site = ENVS / VERSION
    if not (site / ".complete").exists():
        pytest.skip(f"SGLang {VERSION} is not installed for the CPU tests: bash tests/sglang_env/install.sh")
    p = subprocess.run([sys.executable, "-m", f"tests.sglang_env.{module}", str(site)], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def server_check():
    return _check("server_check")


def test_the_sglang_server_conforms_to_the_replica_interface(server_check):
    assert server_check["nonconforming"] == []


def test_a_request_waits_for_the_kv_cache_and_the_stopped_session(server_check):
    """The server actor's gate, with a request arriving while the KV cache is being released
    (tests/sglang_env/server_check.py): it reaches the server only after training stopped and the
    cache came back; the rollout's end takes the cache back before verl sleeps the replica."""
    kv = ["kv_cache"]
    assert server_check["order"] == [
        ["generate", "a"], ["release", kv], ["IDLE", 3], ["BUSY", 3], ["resume", kv], ["generate", "b"],
        ["release", kv], ["IDLE", 3], ["BUSY", 3], ["resume", kv], ["generate", "c"]], server_check["order"]


def test_a_drafter_push_sglang_refuses_leaves_the_run_going(server_check):
    """SGLang refuses a drafter push (tests/sglang_env/server_check.py): the replica's actor
    raises nothing (the RL step goes on), serves on under the pushed version, and reads back no
    drafter, since a push can fail between buckets, so the push guard rejects it. The rollback
    pushes the drafter served before again, and the read-back returns. The next push serves its spot
    step."""
    start, step6 = {"kind": "export", "path": "start"}, {"kind": "spot", "root": "/spot", "step": 6}
    assert server_check["pushes"]["results"] == [
        [1, start], [False, start], [2, start], [True, start], [3, step6], [True, step6]]
    assert server_check["pushes"]["calls"] == [
        ["push", 2, start], ["get_weights_by_name", "tlt.draft/model.fc.weight"], ["push", 3, step6],
        ["get_weights_by_name", "tlt.draft/model.fc.weight"]]


@pytest.mark.parametrize("version", ["0.5.12", "0.5.23"])
def test_one_request_aborts_with_its_partial_output_and_resumes_token_for_token(tmp_path, version):
    """TLT's SGLang server actor aborts one request through SGLang's ``/abort_request`` (the body
    parsed into the version's ``AbortReq``): its ``generate`` returns the partial output with its
    log-probs as ``aborted``; resubmitted as verl's partial rollout does, it ends with the tokens of an
    uninterrupted run (the stand-in decodes with coupled sampling; tests/sglang_env/abort_check.py).
    A request aborted while it waits at the actor's gate returns empty; an unknown id is not aborted."""
    site = ENVS / version
    if not (site / ".complete").exists():
        pytest.skip(f"SGLang {version} is not installed for the CPU tests: bash tests/sglang_env/install.sh")
    from tlt.demo.target_factory import ensure_target

    size = demo.QUICK
    target = ensure_target(size.target, progress=False)
    p = subprocess.run([sys.executable, "-m", "tests.sglang_env.abort_check", str(site), str(target),
                        str(size.max_prompt + 200 + 8), str(tmp_path)], capture_output=True, text=True, timeout=600,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:] + (tmp_path / "log").read_text()[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    (ref, ref_lp, ref_reason), (part, part_lp, reason), (again, again_lp, again_reason) = r["ref"], r["part"], r["again"]
    assert r["answer"] == {"aborted": True, "request_id": "a"}
    assert reason == "aborted" and 0 < len(part) < len(ref) and len(part_lp) == len(part)
    assert part + again == ref and len(again_lp) == len(again) and again_reason == ref_reason
    assert len(ref_lp) == len(ref) and all(abs(a - b) < 1e-4 for a, b in zip(part_lp + again_lp, ref_lp))
    aborts = [c["body"] for c in r["calls"] if c["endpoint"] == "abort_request"]
    # once, and once more if "a" was still in flight after sglang_server.ABORT_RESEND_S
    assert 1 <= len(aborts) <= 2 and all(b == {"rid": "a", "abort_all": False} for b in aborts)
    # aborted at the actor's gate: it returns empty when the gate opens, never reaching SGLang; an id not in
    # flight is not aborted (no call either)
    assert r["at_gate"] == [{"aborted": True, "request_id": "b"}, {"aborted": False, "request_id": "nope"}]
    assert r["held"] == [[], [], "aborted"]
    assert not [c for c in r["calls"] if "error" in c]
    # each posted once, though each ran past the client's (shrunk) default timeout
    assert [c["rid"] for c in r["calls"] if c["endpoint"] == "generate"] == ["ref", "a", "a"]


def test_an_abort_is_sent_again_only_to_the_same_call_still_in_flight():
    """SGLang ignores an abort that arrives before its request, so the actor aborts once more after
    ``ABORT_RESEND_S`` (tests/sglang_env/resend_check.py): three calls aborted together each get an
    abort at once; after the wait only "a", still the same call in flight, gets a second one. "b"
    finished in between, and "c" finished and was posted again under the same id: the new call is
    not aborted. (The resend's time is bounded below by half the wait, not the whole of it: an event
    loop's timer may wake a fraction of a millisecond early, 99.7 ms for 100 on this machine.)"""
    r = _check("resend_check")
    assert [rid for rid, _ in r["sent"]] == ["a", "b", "c", "a"]
    assert all(t < r["resend_s"] / 4 for _, t in r["sent"][:3]) and r["sent"][3][1] >= r["resend_s"] / 2
