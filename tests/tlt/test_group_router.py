"""verl router plugin: a GRPO group's samples go to one replica, groups spread by load; a group is
remembered only while a request of it is in flight, and ties are broken by the prompt, not at random.

GroupRouter subclasses verl 0.9.1's own balancer, a plain class that verl wraps with ``ray.remote``
when it builds the router, so it is tested here directly (no Ray)."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'tlt-rollout[verl]')")

from tlt.integrations.verl.router import GroupRouter  # noqa: E402


def test_siblings_share_a_replica_and_groups_spread_by_load():
    router = GroupRouter({"r0": "h0", "r1": "h1"}, {"router_class": "x", "max_groups": 64})
    assert router.require_acquire_fields() == ["prompt_ids", "tlt_to"]  # tlt_to: a moved request's destination
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


def _step(router, groups, tag):
    """Acquire every sample of ``groups`` (4 each); returns {group: replica} and the request ids."""
    placed, reqs = {}, []
    for g in groups:
        for s in range(4):
            sid, _ = router.acquire_server(f"{tag}-{g}-{s}", prompt_ids=[7, g, 9])
            placed.setdefault(g, sid)
            assert placed[g] == sid
            reqs.append((sid, f"{tag}-{g}-{s}"))
    return placed, reqs


def test_a_returning_prompt_is_placed_by_load_not_by_its_old_replica():
    """The next epoch's step brings the same prompts back: each is placed by the load of that
    moment. (Remembered across steps, every group of a step could land on one replica.)"""
    router = GroupRouter({"r0": "h0", "r1": "h1"}, {"max_groups": 64})
    assert router.require_release_fields() == ["request_id"]
    first, reqs = _step(router, range(8), "s1")
    for sid, rid in reqs:
        router.release_server(sid, request_id=rid)
    on_r0 = [g for g, sid in first.items() if sid == "r0"]  # 4 groups
    router.acquire_server("long", prompt_ids=[1, 2, 3])  # a request still running somewhere
    second, _ = _step(router, on_r0, "s2")  # only groups that were all on r0 come back
    assert collections.Counter(second.values()) == {"r0": 2, "r1": 2}, second  # by load, not all on r0


def test_placement_does_not_depend_on_chance():
    """Two routers given the same groups in the same order place them alike (ties broken by the
    prompt's hash): arms of a comparison that send alike decode alike."""
    a, _ = _step(GroupRouter({"r0": 0, "r1": 1}), range(8), "x")
    b, _ = _step(GroupRouter({"r0": 0, "r1": 1}), range(8), "y")
    assert a == b
    assert len(set(a.values())) == 2


def test_the_shipped_router_config_names_this_class():
    import yaml

    import tlt.configs

    cfg = yaml.safe_load((Path(tlt.configs.__file__).parent / "tlt_router.yaml").read_text())
    assert cfg["router_class"] == "tlt.integrations.verl.router.GroupRouter"
