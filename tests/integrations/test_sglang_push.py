"""verl's SGLang rollout with TLT's pushes, against the real request classes of SGLang 0.5.12 and
0.5.23 (each installed --no-deps by tests/sglang_env/install.sh; its engine needs CUDA, so a
recording HTTP server stands in for a live server: see tests/sglang_env/push_check.py).

Policy pushes are target-only in both versions (0.5.12 ``disable_draft_model``, 0.5.23
``selector="target"`` inside a weight-update session) and carry exactly the pushed tensors; draft
pushes reach the draft model only (0.5.12 TLT's custom loader, 0.5.23 ``selector="draft"`` with
generation paused in place).
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
