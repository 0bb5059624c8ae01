"""Abortable rendezvous of one training session's ranks (the store its process group is built on).

``init_process_group(init_method="tcp://...")`` blocks until every rank arrives or its timeout
passes, and nothing can interrupt it. A spot session needs better: a STOP (rollout done) or a
membership change can arrive while some ranks are still on their way, and a worker must then ack
within the coordinator's deadline instead of sitting out the rendezvous timeout.

So the ranks meet on a ``TCPStore`` (hosted by rank 0) and agree on one decision key with
``compare_set``: the last rank to arrive writes ``go``; a rank asked to stop first writes ``abort``,
one whose wait ran out ``timeout`` (a failure on every rank, not a stop). Whichever lands first is
what every rank reads, so either all ranks build the process group on the store or none does (one
rank building it alone would hang in gloo's full-mesh connect).
Ranks that have not reached the store when it aborts see it vanish, or time out, and abort too.

Keys live under the session id, so a rank that reaches a stale store left on the same port by an
earlier session never reads that session's ``go``; it times out instead. (torch's caches keep the
last finished FSDP2 session's process group, hence its store and port, alive in rank 0's process
until the next session replaces them; threads and fds stay flat across sessions. So use a fresh
port per formation, as ``tlt.spot_agent`` does; rank 0 also keeps the last store it hosted and
reuses it when a later session lands on the same port.)
"""

from __future__ import annotations

import datetime
import logging
import socket
import time
from collections.abc import Callable

import torch.distributed as dist

log = logging.getLogger(__name__)

_ARRIVED, _SEEN, _DECISION = "arrived", "seen_abort", "decision"  # under "tlt/<session id>/"
_GO, _ABORT, _TIMEOUT = b"go", b"abort", b"timeout"
_POLL_S = 0.02
_CONNECT_TRY_S = 1.0  # one connection attempt of a non-zero rank (then should_stop is checked)
_HOSTED: dict[tuple[str, int], dist.TCPStore] = {}  # the last store this process hosted


class RendezvousAborted(Exception):
    """The session was stopped before all of its ranks met: nothing was formed, nothing to save."""


def rendezvous(host: str, port: int, rank: int, world_size: int, *, session_id: str, timeout_s: float,
               store_timeout_s: float, should_stop: Callable[[], bool]) -> dist.Store:
    """Meet the session's other ranks at ``host:port`` (rank 0 hosts the store).

    Returns the store (its timeout set to ``store_timeout_s`` for the process group built on it)
    once all ``world_size`` ranks arrived. Raises :class:`RendezvousAborted` if ``should_stop()``
    became true first (on any rank), ``TimeoutError`` after ``timeout_s`` (on any rank), and
    ``RuntimeError`` if rank 0 cannot host the store (port taken).
    """
    deadline = time.monotonic() + timeout_s
    tcp = _connect(host, port, rank, world_size, deadline, should_stop)
    store = dist.PrefixStore(f"tlt/{session_id}/", tcp)
    stopped = timed_out = False
    try:
        decision = b""
        if store.add(_ARRIVED, 1) == world_size:
            decision = store.compare_set(_DECISION, "", _GO)
        while decision not in (_GO, _ABORT, _TIMEOUT):
            stopped = bool(should_stop())
            timed_out = not stopped and time.monotonic() > deadline
            if stopped or timed_out:  # settle it for every rank; a "go" written first still wins
                decision = store.compare_set(_DECISION, "", _TIMEOUT if timed_out else _ABORT)
                break
            time.sleep(_POLL_S)
            if store.check([_DECISION]):
                decision = store.get(_DECISION)
    except (RuntimeError, OSError) as e:  # the host (rank 0) left: it aborted, or it died
        if should_stop():
            raise RendezvousAborted(f"rendezvous at {host}:{port} ended by its host") from e
        raise RuntimeError(f"rendezvous at {host}:{port} failed: {e}") from e
    if decision in (_ABORT, _TIMEOUT):
        arrived = _acknowledge_abort(store, rank)
        if decision == _TIMEOUT:
            raise TimeoutError(f"rendezvous at {host}:{port}: {arrived} of {world_size} ranks arrived "
                               + (f"within {timeout_s:.0f}s" if timed_out else "within another rank's wait"))
        raise RendezvousAborted(f"session stopped during the rendezvous at {host}:{port}"
                                + ("" if stopped else " (by another rank)"))
    tcp.set_timeout(datetime.timedelta(seconds=store_timeout_s))
    return store


def _connect(host: str, port: int, rank: int, world_size: int, deadline: float,
             should_stop: Callable[[], bool]) -> dist.TCPStore:
    if rank == 0:
        hosted = _HOSTED.get((host, port))
        if hosted is not None:  # still ours (torch may keep it alive): reuse, keys are per session
            return hosted
        try:
            hosted = dist.TCPStore(host, port, world_size, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=_CONNECT_TRY_S))
        except (RuntimeError, OSError) as e:
            raise RuntimeError(f"rank 0 cannot host the rendezvous store at {host}:{port}: {e} "
                               "(port taken? pick another base port)") from e
        _HOSTED.clear()
        _HOSTED[(host, port)] = hosted
        return hosted
    while True:
        if should_stop():
            raise RendezvousAborted(f"session stopped before rank 0 at {host}:{port} was reached")
        try:  # probe with a plain socket: a failed TCPStore connect logs a C++ stack trace per try
            socket.create_connection((host, port), timeout=_CONNECT_TRY_S).close()
        except OSError as e:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rendezvous: rank 0 at {host}:{port} unreachable: {e}") from e
            time.sleep(0.05)
            continue
        return dist.TCPStore(host, port, world_size, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=max(1.0, deadline - time.monotonic())))


def _acknowledge_abort(store: dist.Store, rank: int, wait_s: float = 1.0) -> int:
    """Count this rank as having read ``abort``; rank 0 (the store's host) then waits, bounded,
    until every rank that arrived has read it, so nobody sees the store vanish instead.
    Returns how many ranks had arrived (-1 if the store is gone)."""
    try:
        seen = store.add(_SEEN, 1)
        end = time.monotonic() + wait_s
        while rank == 0 and seen < store.add(_ARRIVED, 0) and time.monotonic() < end:
            time.sleep(_POLL_S)
            seen = store.add(_SEEN, 0)
        return store.add(_ARRIVED, 0)
    except (RuntimeError, OSError):
        return -1  # the host is gone already: the others abort on their own
