"""Every replica implementation has every method of the loop's one replica interface, with its
parameter names and its sync/async kind (a Ray caller awaits one and ``ray.get``s the other).
The project's engine here; SGLang's server actor in ``tests/integrations/test_sglang_loop.py`` (in
a process where SGLang is importable)."""

from __future__ import annotations

import inspect

import pytest

from tlt.integrations.replica_api import ReplicaAPI

API = {n: f for n, f in vars(ReplicaAPI).items() if callable(f) and not n.startswith("_")}


def _implementations():
    pytest.importorskip("ray", reason="the verl extra is not installed (pip install 'tlt-rollout[verl]')")
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

