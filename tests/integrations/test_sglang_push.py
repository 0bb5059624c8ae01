"""verl's SGLang rollout with TLT's pushes, against the real request classes of SGLang 0.5.12 and
0.5.23 (each installed --no-deps by tests/sglang_env/install.sh; its engine needs CUDA, so a
recording HTTP server stands in for a live server: see tests/sglang_env/push_check.py).

Policy pushes are target-only in both versions (0.5.12 ``disable_draft_model``, 0.5.23
``selector="target"`` inside a weight-update session) and carry exactly the pushed tensors; draft
pushes reach the draft model only (0.5.12 TLT's custom loader, 0.5.23 ``selector="draft"`` with
generation paused in place). A push the server refuses at the TP leader of a TP-2 replica (two
processes) leaves no rank waiting in the push's gathers, and generation is continued.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'tlt-rollout[verl]')")

ROOT = Path(__file__).resolve().parents[2]
ENVS = Path(os.environ.get("TLT_SGLANG_ENVS", ROOT / ".sglang-envs"))


@pytest.fixture(scope="module")
def model_path():
    from tlt.demo import job as demo
    from tlt.demo.target_factory import ensure_target

    return ensure_target(demo.QUICK.target, progress=False)


@pytest.mark.parametrize("version", ["0.5.12", "0.5.23"])
def test_policy_pushes_target_only_and_draft_pushes_draft_only(version, model_path, tmp_path):
    site = ENVS / version
    if not (site / ".complete").exists():
        pytest.skip(f"SGLang {version} is not installed for the CPU tests: bash tests/sglang_env/install.sh")
    out = tmp_path / "push.json"
    p = subprocess.run([sys.executable, "-m", "tests.sglang_env.push_check", str(site), str(out), str(model_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["sglang_version"] == version
    if version == "0.5.12":
        assert r["api"] == {"version": version, "selector": False, "disable_draft": True, "sessions": False}
        assert "disable_draft_model" in r["policy_fields"] and "selector" not in r["policy_fields"]
        assert r["draft_calls"] == ["update_weights_from_tensor"]
    else:
        assert r["api"] == {"version": version, "selector": True, "disable_draft": False, "sessions": True}
        assert r["policy_calls"][0] == "begin_weight_update" and r["policy_calls"][-1] == "end_weight_update"
        assert r["draft_calls"][0] == "pause_generation" and r["draft_calls"][-1] == "continue_generation"
    assert "weight_version" in r["draft_fields"]
    # n-gram fallback: each step's corpus replaces the previous one, bodies parse as SGLang's own
    assert r["corpus_calls"] == ["add_external_corpus", "add_external_corpus", "remove_external_corpus"]


@pytest.mark.parametrize("version, fail", [("0.5.12", "update_weights_from_tensor"),
                                           ("0.5.23", "begin_weight_update"),
                                           ("0.5.23", "update_weights_from_tensor")])
def test_a_push_failing_at_the_tp_leader_leaves_no_rank_waiting(version, fail, model_path, tmp_path):
    """A TP-2 replica (two processes) whose SGLang server refuses one call of each push: the other
    rank still returns from both pushes (the leader goes through every gather), the leader raises
    naming the call, and a paused server is told to continue (0.5.23)."""
    site = ENVS / version
    if not (site / ".complete").exists():
        pytest.skip(f"SGLang {version} is not installed for the CPU tests: bash tests/sglang_env/install.sh")
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.sglang_env.push_fail_check", str(site), str(outs[r]),
                               str(model_path), str(r), str(tmp_path / "store"), fail], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(x[-3000:] for x in logs)
    lead, other = (json.loads(o.read_text()) for o in outs)
    assert other == {"policy": "returned", "draft": "returned", "calls": []}
    assert f"policy push (step 5) not applied: {fail} failed" in lead["policy"], lead
    assert f"drafter version 3 not pushed: {fail} failed" in lead["draft"], lead
    if version == "0.5.23":
        draft = lead["calls"][lead["calls"].index("pause_generation"):]
        assert draft[-1] == "continue_generation", lead["calls"]
        assert ("end_weight_update" in draft) == (fail != "begin_weight_update"), lead["calls"]
