"""A restarted replica's requests, served elsewhere until verl pushes it the current policy.

Owns :class:`Forwarding`: whether this replica is stale (Ray re-ran its constructor after a crash,
so it holds the initial weights) and which healthy replica serves its requests meanwhile. A stale
replica never samples: each request goes to the first replica (by rank) that is not stale, with
its original seed, so it draws the same tokens there.

Owner and order: ``stale`` is set at construction and cleared by the policy copy, under the
replica's serving lock; ``peer`` runs in the event loop and only reads it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class Forwarding:
    def __init__(self, rank: int, stale: bool, actor_name: Callable[[int], str]) -> None:
        """``actor_name(k)``: the Ray name of replica ``k``'s server (replicas are named 0, 1, ...)."""
        self.rank, self.stale, self._actor_name = rank, stale, actor_name
        self._to: int | None = None  # the replica serving this one's requests (logged once per change)
        if stale:
            log.warning("replica %d restarted: serving again after the next policy push", rank)

    def fresh(self) -> None:
        """The current policy arrived: this replica serves its own requests again."""
        self.stale, self._to = False, None

    async def peer(self) -> Any:
        """Another replica serving the current policy (its Ray handle); RuntimeError if none is."""
        import ray

        for k in itertools.count():
            if k == self.rank:
                continue
            try:
                peer = ray.get_actor(self._actor_name(k))
            except ValueError:  # past the last replica
                break
            try:
                if not await peer.is_stale.remote():
                    if self._to != k:
                        log.warning("replica %d: stale after its restart; forwarding requests to replica %d "
                                    "until the next policy push", self.rank, k)
                        self._to = k
                    return peer
            except ray.exceptions.RayError:  # that one is down too
                continue
        raise RuntimeError(f"replica {self.rank} restarted and has not received the current policy yet, and no "
                           "other replica has it; refusing to sample from stale weights")
