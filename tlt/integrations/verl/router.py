"""verl router plugin: every sample of a GRPO group goes to the replica its first sample went to.

Owns :class:`GroupRouter` (``actor_rollout_ref.rollout.router_config_path`` naming
``configs/tlt_router.yaml``; the ``tlt`` trainer sets it when ``tlt.route_groups`` is true and the
user set no router of their own). verl's default balancer spreads a group's siblings over the
replicas by least in-flight count, so a replica's model-free drafter sees about half of each group;
here the first sample of a prompt picks the least-loaded replica and its siblings follow (keyed by
the prompt's token ids, kept for the last ``max_groups`` prompts). The cost: load is balanced per
group of ``n`` samples rather than per request, so the replicas' request counts differ by at most
``n`` at the start of a step instead of 1.
"""

from __future__ import annotations

import random
from typing import Any

from cachetools import LRUCache
from verl.workers.rollout.router import GlobalRequestLoadBalancer


class GroupRouter(GlobalRequestLoadBalancer):
    def __init__(self, servers: dict[str, Any], config: dict | None = None) -> None:
        config = dict(config or {})
        super().__init__(servers)
        self._group_server: LRUCache = LRUCache(maxsize=int(config.get("max_groups", 100_000)))

    def require_acquire_fields(self) -> list[str]:
        return ["prompt_ids"]

    def acquire_server(self, request_id: str, prompt_ids: list[int] | None = None, **extra) -> tuple[str, Any]:
        if prompt_ids is None or request_id in self._request_id_to_server:
            return super().acquire_server(request_id)
        key = tuple(int(t) for t in prompt_ids)
        server_id = self._group_server.get(key)
        if server_id not in self._inflight_requests:  # a new group (or its replica left the pool)
            if not self._inflight_requests:
                raise RuntimeError("No available servers in load balancer")
            low = min(self._inflight_requests.values())
            server_id = random.choice([s for s, n in self._inflight_requests.items() if n == low])
            self._group_server[key] = server_id
        self._request_id_to_server[request_id] = server_id
        self._inflight_requests[server_id] += 1
        return server_id, self._servers[server_id]

    def clear_sticky_cache(self) -> dict:
        out = super().clear_sticky_cache()
        self._group_server.clear()
        return out
