"""The installed import names: only ``tlt`` is a top-level name of ours. The user's folders
``rollout/``, ``drafter/`` and ``coordinator/`` install as ``tlt.rollout``, ``tlt.drafter`` and
``tlt.coordinator``, so PyPI packages that own those top-level names (a feature-flag library, a task
runner, a web library) cannot shadow ours or be shadowed by them.

Each check runs in a subprocess started outside the checkout: run from the checkout, its root is on
``sys.path`` and its folders would import under their bare names."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

CLASHING = ("rollout", "drafter", "coordinator")


def _run(code: str, cwd: Path, pythonpath: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_clashing_names_are_not_installed(tmp_path):
    r = _run("import importlib.util, json\n"
             f"print(json.dumps([n for n in {CLASHING + ('configs',)!r} if importlib.util.find_spec(n)]))\n"
             "import tlt.rollout, tlt.drafter, tlt.coordinator, tlt.configs\n", tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []
    r = _run("import rollout", tmp_path)
    assert r.returncode != 0 and "No module named 'rollout'" in r.stderr


def test_stand_in_top_level_packages_change_nothing(tmp_path, trained_target):
    """Stand-ins for the PyPI packages come first on ``sys.path`` and fail loudly if imported; the
    engine generates, the coordinator serves a worker, and the verl trainer imports."""
    standins = tmp_path / "standins"
    for name in CLASHING:
        (standins / name).mkdir(parents=True)
        (standins / name / "__init__.py").write_text(
            f"raise ImportError('the stand-in PyPI package {name!r} was imported')\n")
    code = f"""
import importlib.util, json, sys
from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.generate import SamplingParams
from tlt.rollout.target import TargetModel
from tlt.coordinator import Coordinator, CoordinatorConfig, WorkerClient, WorkerConfig

target = TargetModel.from_pretrained({str(trained_target)!r})
out = RolloutEngine(target, EngineConfig(max_batch=2, max_len=64)).generate(
    [[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=4)).outputs
c = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0")).start()
w = WorkerClient(WorkerConfig(address=c.endpoint, worker_id="w0")).start()
served = w.wait_connected(10)
w.close()
c.stop()
trainer = False
if importlib.util.find_spec("verl") is not None:  # the trainer first: importing it imports verl, whose plugin imports it
    import tlt.integrations.verl.trainer
    from tlt.integrations.verl.verl_checks import raise_if_registration_failed
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    raise_if_registration_failed()
    trainer = TRAINER_REGISTRY.get("tlt") is tlt.integrations.verl.trainer.TLTTrainer
print(json.dumps({{"tokens": [len(o) for o in out], "served": served, "trainer": trainer,
                  "standins": sorted(n for n in {CLASHING!r} if n in sys.modules)}}))
"""
    r = _run(code, tmp_path, pythonpath=str(standins))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "registering the verl plugin failed" not in r.stderr, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["tokens"] == [4, 4] and got["served"] and got["standins"] == []
    assert got["trainer"] == (importlib.util.find_spec("verl") is not None)
    # The stand-ins are live: a bare import reaches them.
    assert "stand-in PyPI package 'rollout'" in _run("import rollout", tmp_path, str(standins)).stderr


@pytest.mark.parametrize("name", CLASHING)
def test_no_source_file_imports_a_bare_name(name):
    """Every import of our packages goes through ``tlt.`` (a bare one would pick up a stand-in)."""
    import ast

    root = Path(__file__).resolve().parents[2]
    bad = []
    for path in root.rglob("*.py"):
        if any(part.startswith(".") for part in path.relative_to(root).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            bad += [f"{path.relative_to(root)}:{node.lineno}" for m in mods if m.split(".")[0] == name]
    assert not bad, f"bare imports of {name!r}: {bad}"
