"""verl router plugin: every sample of a GRPO group goes to the replica its first sample went to.

Owns :class:`GroupRouter` (``actor_rollout_ref.rollout.router_config_path`` naming
``configs/tlt_router.yaml``; the ``tlt`` trainer sets it when ``tlt.route_groups`` is true and the
user set no router of their own). verl's default balancer spreads a group's siblings over the
replicas by least in-flight count, so a replica's model-free drafter sees about half of each group;
here the first sample of a prompt picks the least-loaded replica and its siblings follow (keyed by
the prompt's token ids). The cost: load is balanced per group of ``n`` samples rather than per
request, so the replicas' request counts differ by at most ``n`` at the start of a step instead of 1.

A group's replica is remembered only while one of its requests is in flight. A prompt that comes
back in a later step (the next epoch) is placed by load again: every replica's draft history holds
every prompt's earlier responses, so nothing is gained by going back, and a memory across steps
once put all eight groups of a step on one replica. Ties between equally loaded replicas are broken
by a hash of the prompt, not at random, so two runs that send the same groups in the same order
place them alike.

A request consolidation moved (:mod:`.moves`) is resubmitted with ``tlt_to``, its destination's
server id: it goes there, and the in-flight counts follow it (its source's count dropped when the
source answered). Its group stays placed where it was.
"""

from __future__ import annotations

import collections
import zlib
from typing import Any

from cachetools import LRUCache
from verl.workers.rollout.router import GlobalRequestLoadBalancer


class GroupRouter(GlobalRequestLoadBalancer):
    def __init__(self, servers: dict[str, Any], config: dict | None = None) -> None:
        config = dict(config or {})
        super().__init__(servers)
        self._group_server: dict[tuple[int, ...], str] = {}  # groups with a request in flight
        self._group_inflight: collections.Counter = collections.Counter()
        # request id -> its group (LRU: a request verl never releases cannot grow it without bound)
        self._request_group: LRUCache = LRUCache(maxsize=int(config.get("max_groups", 100_000)))

    def require_acquire_fields(self) -> list[str]:
        return ["prompt_ids", "tlt_to"]

    def require_release_fields(self) -> list[str]:
        return ["request_id"]

    def acquire_server(self, request_id: str, prompt_ids: list[int] | None = None, tlt_to: str | None = None,
                       **extra) -> tuple[str, Any]:
        if tlt_to is not None and tlt_to in self._inflight_requests:  # a moved request: its destination
            self._request_id_to_server[request_id] = tlt_to
            self._inflight_requests[tlt_to] += 1
            if prompt_ids is not None:
                key = tuple(int(t) for t in prompt_ids)
                self._group_inflight[key] += 1
                self._request_group[request_id] = key
            return tlt_to, self._servers[tlt_to]
        if prompt_ids is None or request_id in self._request_id_to_server:
            return super().acquire_server(request_id)
        key = tuple(int(t) for t in prompt_ids)
        server_id = self._group_server.get(key)
        if server_id not in self._inflight_requests:  # a new group (or its replica left the pool)
            if not self._inflight_requests:
                raise RuntimeError("No available servers in load balancer")
            low = min(self._inflight_requests.values())
            ties = sorted(s for s, n in self._inflight_requests.items() if n == low)
            server_id = ties[zlib.crc32(",".join(map(str, key)).encode()) % len(ties)]
            self._group_server[key] = server_id
        self._request_id_to_server[request_id] = server_id
        self._inflight_requests[server_id] += 1
        self._group_inflight[key] += 1
        self._request_group[request_id] = key
        return server_id, self._servers[server_id]

    def release_server(self, server_id: str, request_id: str | None = None) -> None:
        super().release_server(server_id, request_id)
        key = self._request_group.pop(request_id, None) if request_id is not None else None
        if key is None:
            return
        self._group_inflight[key] -= 1
        if self._group_inflight[key] <= 0:  # the group is done: its next step is placed by load
            del self._group_inflight[key]
            self._group_server.pop(key, None)

    def clear_sticky_cache(self) -> dict:
        out = super().clear_sticky_cache()
        self._group_server.clear()
        self._group_inflight.clear()
        self._request_group.clear()
        return out
