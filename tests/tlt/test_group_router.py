"""verl router plugin: a GRPO group's samples go to one replica, groups spread by load.

GroupRouter subclasses verl 0.9.1's own balancer, a plain class that verl wraps with ``ray.remote``
when it builds the router, so it is tested here directly (no Ray)."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'tlt[verl]')")

from tlt.integrations.verl.router import GroupRouter  # noqa: E402


def test_siblings_share_a_replica_and_groups_spread_by_load():
    router = GroupRouter({"r0": "h0", "r1": "h1"}, {"router_class": "x", "max_groups": 64})
    assert router.require_acquire_fields() == ["prompt_ids"]
    placed = collections.defaultdict(set)
    for g in range(8):
        for s in range(4):
            sid, handle = router.acquire_server(f"req-{g}-{s}", prompt_ids=[7, g, 9])
            assert handle == {"r0": "h0", "r1": "h1"}[sid]
            placed[g].add(sid)
    assert all(len(v) == 1 for v in placed.values())  # whole groups on one replica
    load = collections.Counter(next(iter(v)) for v in placed.values())
    assert load == {"r0": 4, "r1": 4}  # least-loaded at each group's first sample
    assert router.acquire_server("req-0-0", prompt_ids=[7, 0, 9])[0] in placed[0]  # sticky per request
    router.remove_servers(["r0"])
    assert all(router.acquire_server(f"new-{g}", prompt_ids=[7, g, 9])[0] == "r1" for g in range(8))


def test_the_shipped_router_config_names_this_class():
    import yaml

    import tlt.configs

    cfg = yaml.safe_load((Path(tlt.configs.__file__).parent / "tlt_router.yaml").read_text())
    assert cfg["router_class"] == "tlt.integrations.verl.router.GroupRouter"
