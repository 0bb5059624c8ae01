"""Every replica implementation has every method of the loop's one replica interface, with its
parameter names and its sync/async kind (a Ray caller awaits one and ``ray.get``s the other)."""

from __future__ import annotations

import inspect

import pytest

from tlt.integrations.replica_api import ReplicaAPI

API = {n: f for n, f in vars(ReplicaAPI).items() if callable(f) and not n.startswith("_")}


def _implementations():
    pytest.importorskip("ray", reason="the verl extra is not installed (pip install 'tlt[verl]')")
    from tlt.integrations.verl.server import TLTServer

    return [TLTServer]


def test_the_interface_names_the_loop_calls():
    assert {"generate", "update_weights", "load_drafter", "served_drafter", "rollback_drafter",
            "release_kv_cache", "resume_kv_cache", "begin_step", "step_stats", "add_samples"} <= set(API)


@pytest.mark.parametrize("name", sorted(API))
def test_each_implementation_conforms(name):
    want = inspect.signature(API[name])
    for cls in _implementations():
        got = getattr(cls, name, None)
        assert got is not None, f"{cls.__name__} lacks {name}"
        params = [p for p in inspect.signature(got).parameters if p != "_ray_trace_ctx"]  # Ray's, once wrapped
        assert params == list(want.parameters), (cls.__name__, name)
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(API[name]), (cls.__name__, name)


_SGLANG_CHECK = r"""
import inspect, json, sys
from tests.sglang_env import cpu_env
cpu_env.activate(sys.argv[1])
from tlt.integrations.replica_api import ReplicaAPI
from tlt.integrations.verl.sglang_server import TLTSGLangServer
bad = []
for name, want in vars(ReplicaAPI).items():
    if not callable(want) or name.startswith("_"):
        continue
    got = getattr(TLTSGLangServer, name, None)
    if got is None or list(inspect.signature(got).parameters) != list(inspect.signature(want).parameters) \
            or inspect.iscoroutinefunction(got) != inspect.iscoroutinefunction(want):
        bad.append(name)
print(json.dumps(bad))
"""


def test_the_sglang_server_conforms():
    """TLT's SGLang server actor, in a process with SGLang 0.5.23 importable (its engine is not needed)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'tlt[verl]')")
    root = Path(__file__).resolve().parents[2]
    site = Path(os.environ.get("TLT_SGLANG_ENVS", root / ".sglang-envs")) / "0.5.23"
    if not (site / ".complete").exists():
        pytest.skip("SGLang 0.5.23 is not installed for the CPU tests: bash tests/sglang_env/install.sh")
    p = subprocess.run([sys.executable, "-c", _SGLANG_CHECK, str(site)], capture_output=True, text=True,
                       timeout=300, cwd=root)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == "[]"
