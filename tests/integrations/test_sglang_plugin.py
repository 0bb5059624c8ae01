"""TLT's SGLang plugin inside the real SGLang 0.5.12 and 0.5.23 (each installed --no-deps by
tests/sglang_env/install.sh; the engine needs CUDA, so no server starts: see
tests/sglang_env/plugin_check.py for what runs). SGLang's own plugin loader finds TLT's entry point;
every hook of the version's table lands; the policy runs inside SGLang's AdaptiveController on the
recorded verify trace (docs/bench/sglang_trace.json); every lossy setting is refused; the idle
signal reaches a real coordinator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENVS = Path(os.environ.get("TLT_SGLANG_ENVS", ROOT / ".sglang-envs"))
TRACE = ROOT / "docs" / "bench" / "sglang_trace.json"


@pytest.fixture(scope="module")
def model_path():
    from tlt.demo import job as demo
    from tlt.demo.target_factory import ensure_target

    return ensure_target(demo.QUICK.target, progress=False)


def _check(version: str, model_path: Path, tmp_path: Path) -> dict:
    site = ENVS / version
    if not (site / ".complete").exists():
        pytest.skip(f"SGLang {version} is not installed for the CPU tests: bash tests/sglang_env/install.sh")
    out = tmp_path / "plugin.json"
    p = subprocess.run([sys.executable, "-m", "tests.sglang_env.plugin_check", str(site), str(out), str(model_path),
                        str(TRACE)], capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "TMPDIR": str(tmp_path)})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("version", ["0.5.12", "0.5.23"])
def test_plugin_inside_sglang(version, model_path, tmp_path):
    from tlt.bench.sglang_tuner import evaluate, parse_trace
    from tlt.integrations.sglang import hook_table
    from tlt.integrations.sglang.adaptive import DEFAULT_SLOTS

    r = _check(version, model_path, tmp_path)
    assert r["sglang_version"] == version
    doc = r["doctor"]
    assert doc["entry_point"] == "tlt = tlt.integrations.sglang.plugin:load"
    assert doc["hooks_missing"] == [] and doc["errors"] == []
    assert doc["hooks_applied"] == [h.target for h in hook_table.TABLE[version]()]

    pol = r["policy"]
    if version == "0.5.23":
        assert pol["class_replaced"] == pol["policy_type"] == "Tuner"
        assert pol["candidate_steps"] == [0, 1, 2, 3, 5, 7]  # SGLang sizes its buffers from TLT's slots
        graphs = {int(k): v for k, v in pol["graph_bs_per_step"].items()}
        assert graphs[0] == graphs[1] and len(graphs[1]) == 24  # off and 1 step everywhere
        assert graphs[7] == [1, 2, 3] and graphs[3][-1] == 10  # deep chains only where few requests run
        # SGLang's real controller drives the policy exactly as the bench's driver does
        ev = evaluate(parse_trace(json.loads(TRACE.read_text())), DEFAULT_SLOTS, rollouts=pol["rollouts"],
                      requests=32, seed=0)
        assert pol["tlt"]["goodput"]["TLT tuner (BEG-MAB)"] == pytest.approx(ev["goodput_tok_s"]["TLT tuner (BEG-MAB)"])
    else:
        assert pol["class_replaced"] == pol["policy_type"] == "EmaTuner"
        assert 0 not in pol["candidate_steps"]  # 0.5.12 cannot run steps=0
    ar = pol["tlt"]["goodput"]["AR (0 steps)"]
    assert pol["tlt"]["goodput"]["TLT tuner (BEG-MAB)"] > ar  # it learned to speculate where it pays
    assert pol["tlt"]["pct_of_oracle"] > 90

    # launched as verl launches SGLang (ServerArgs built and resolved before SGLang loads plugins):
    # the server's lossy threshold is refused, and so are the requests the guard refuses
    v = r["verl_launch"]
    assert "speculative_accept_threshold_single=0.5" in (v["lossy_threshold"] or ""), v
    assert v["lossless"] is None and v["algorithm"] == "EAGLE" and "min_p" in (v["min_p"] or ""), v

    g = r["guard"]
    for key in ("threshold_single", "threshold_acc", "simulate_acc_len", "min_p", "forced_greedy_sampled"):
        assert g[key] and ("lossy" in g[key] or "refuses" in g[key] or "ignores min_p" in g[key]), key
    assert "speculative_accept_threshold_single=0.9" in g["threshold_single"]
    assert "speculative_accept_threshold_acc=0.5" in g["threshold_acc"]
    assert g["lossless_accepted"] and g["greedy_ok"] and g["sampled_ok"] and g["forced_greedy_greedy_ok"]
    assert g["min_p_without_spec_ok"]
    assert g["internal_state_refused"]
    assert g["warned_default_cap"] and not g["warned_with_explicit_cap"]

    assert r["idle"]["seen"] == ["BUSY", "IDLE", "BUSY"]
    # a tlt run's NGRAM and EAGLE server arguments resolve in real SGLang, our cap kept, and 0.5.12
    # loads draft-only pushes through TLT's loader
    loader = ["tlt.integrations.sglang.draft_loader.load_draft_only"] if version == "0.5.12" else None
    assert r["speculation"] == {
        "ngram": {"speculative_algorithm": "NGRAM", "max_running_requests": 128, "custom_weight_loader": None,
                  "speculative_adaptive": False},
        "eagle": {"speculative_algorithm": "EAGLE", "max_running_requests": 128, "custom_weight_loader": loader,
                  "speculative_adaptive": True}}
    # the push guard's read-back: the draft model's weights by name, the target's otherwise
    rb = r["readback"]
    assert rb["draft"] == rb["want"] and len(rb["want"]) == 4 and rb["target"] == [7.0]
    if version == "0.5.12":  # the worker SGLang builds for a tlt run's EAGLE arguments (spec v2)
        assert rb["worker"] == "EAGLEWorkerV2"
    # an NGRAM run's draft history: SGLang keeps the tokenizer its external corpus encodes with
    assert r["corpus"] == {"skip_tokenizer_init": False, "success": True, "message": r["corpus"]["message"], "chunks": 2}


def test_plugin_failure_stops_the_process(tmp_path):
    """A hook that cannot land ends the SGLang process with the reason on stderr (SGLang itself
    would only log it). Run against 0.5.23 with a table entry pointing at a missing target."""
    site = ENVS / "0.5.23"
    if not (site / ".complete").exists():
        pytest.skip("SGLang 0.5.23 is not installed for the CPU tests: bash tests/sglang_env/install.sh")
    code = (
        "import sys; from tests.sglang_env import cpu_env; cpu_env.activate(sys.argv[1])\n"
        "from tlt.integrations.sglang import hook_table\n"
        "base = hook_table.TABLE['0.5.23']\n"
        "hook_table.TABLE['0.5.23'] = lambda: base() + (hook_table.Hook('sglang.srt.managers.scheduler.Scheduler.no_such_method',"
        " 'after', 'tlt.integrations.sglang.hook_impls:idle_after_batch', 'test'),)\n"
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "print('still running')\n")
    p = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-3000:]
    assert "still running" not in p.stdout
    assert "Scheduler.no_such_method" in p.stderr and "TLT_SGLANG_PLUGIN=0" in p.stderr


def test_doctor_without_sglang_says_how_to_install():
    try:
        import sglang  # noqa: F401
        pytest.skip("SGLang is importable in this environment")
    except ImportError:
        pass
    p = subprocess.run([sys.executable, "-m", "tlt", "doctor", "sglang"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert p.returncode == 2 and "SGLang is not importable" in p.stderr
