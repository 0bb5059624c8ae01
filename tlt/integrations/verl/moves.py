"""A request that moves between replicas mid-decode: one answer to verl's agent loop, token-identical.

Owns the move's protocol: the client side (:class:`MovingClient`, wrapped around verl's
``LLMServerClient`` by the ``tlt_agent`` loop), the replica side (:class:`ReplicaMoves`: where
leaving requests go, which arrivals a destination expects) and the markers both read.

The protocol (the driver's :mod:`.consolidator` decides; replicas and this client carry it out):
1. the destination reserves a slot (``TLTServer.reserve``: it refuses while a spot session may
   run there, and sends no IDLE until the request arrived);
2. the source lets the request go at its next step boundary (``TLTServer.move_out``): its
   ``generate`` returns the tokens made there with stop reason :data:`MOVED` and, in
   ``extra_fields[MOVED_KEY]``, the destination's server id and the request's
   :class:`~tlt.rollout.request.RequestState` (seed, GRPO group, tokens so far, log-probs, features
   already handed to the source's DataBuffer);
3. this client resubmits the request to that server (the router pins it there: ``tlt_to``, so the
   in-flight counts follow the move) with the state (``tlt_state``); the destination goes on from
   it, token for token (coupled sampling), and returns only what it added;
4. the client returns the tokens of every hop as one answer.

Owner and order: the client holds the request between hops, so once the source has answered, the
source can die without losing it. Before that, the source's death fails its ``generate`` call;
Ray retries it on the restarted replica (``max_task_retries=-1``), which forwards it to a healthy
one: the request starts over with its original seed and so draws the same tokens. The
destination's death is the same: the retried call carries the state and goes on from it.
Every request is answered once, by whichever replica finishes it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from tlt.rollout.request import RequestState

log = logging.getLogger(__name__)

MOVED = "tlt_moved"  # a moved request's stop reason at its source
MOVED_KEY = "tlt_moved"  # extra_fields key: {"to": destination server id, "state": RequestState}
MAX_HOPS = 8  # a request moved more often than this is a consolidation bug: refuse rather than loop


def moved_in(state: RequestState, prompt_ids: list[int]) -> RequestState:
    """The state a moved request arrives with, checked against the prompt the client sent."""
    if not isinstance(state, RequestState):
        raise ValueError(f"tlt_state must be a RequestState, got {type(state).__name__}")
    if list(state.prompt) != list(prompt_ids):
        raise ValueError("tlt_state: the moved request's prompt differs from prompt_ids (a resubmission "
                         "sends the original prompt; the state carries the tokens so far)")
    return state


class MovingClient:
    """verl's ``LLMServerClient`` with moves followed: ``generate`` returns one ``TokenOutput``
    whatever replicas served it. Everything else is the wrapped client's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.stop_reason: str | None = None  # the last answer's (tail batching reads it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(self, request_id, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs):
        out = await self.inner.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params,
                                        **kwargs)
        move = out.extra_fields.pop(MOVED_KEY, None)
        self.stop_reason = out.stop_reason
        if move is None:
            return out
        tokens, logprobs = list(out.token_ids), list(out.log_probs) if out.log_probs is not None else None
        hops = 0
        while move is not None:
            hops += 1
            if hops > MAX_HOPS:
                raise RuntimeError(f"request {request_id} moved {hops} times in one rollout; consolidation "
                                   "moves a request at most once per step")
            state: RequestState = move["state"]
            if list(state.output) != tokens:
                raise RuntimeError(f"request {request_id}: the moved state's {len(state.output)} tokens are not "
                                   f"the {len(tokens)} the client received")
            out = await self.inner.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params,
                                            tlt_to=move["to"], tlt_state=state, **kwargs)
            move = out.extra_fields.pop(MOVED_KEY, None)
            tokens += out.token_ids
            if logprobs is not None and out.log_probs is not None:
                logprobs += out.log_probs
        out.token_ids, out.log_probs = tokens, logprobs
        self.stop_reason = out.stop_reason
        out.extra_fields["tlt_hops"] = hops
        return out


class ReplicaMoves:
    """One replica's side of the moves: its leaving requests' destinations, the arrivals it expects
    as a destination, and whether it told its spot agent it is idle.

    Owners and order: the leaving requests and ``moved_out`` are the event loop's (``leave``,
    ``departed``). ``_mu`` guards the expected arrivals and ``idle_sent`` (Ray's threads, the idle
    thread), so a reservation and the IDLE decision are ordered: a replica that told its agent it is
    idle refuses to be a destination, and one expecting a request sends no IDLE until it arrived or
    the reservation ran out.
    """

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._expected: list[float] = []  # arrivals on their way here: deadlines (time.monotonic()) (_mu)
        self._idle_sent = False  # IDLE went to the spot agent since the last generation (_mu)
        self._leaving: dict[str, str] = {}  # request id -> destination server, while it leaves (event loop)
        self.moved_out = 0  # requests that left this step (event loop)

    @property
    def idle_sent(self) -> bool:
        with self._mu:
            return self._idle_sent

    def reserve(self, n: int, ttl_s: float, *, training: bool) -> bool:
        """Become the destination of ``n`` requests arriving within ``ttl_s``; False (nothing
        reserved) if IDLE was sent or a spot session runs here (``training``)."""
        with self._mu:
            if self._idle_sent or training:
                return False
            now = time.monotonic()
            self._expected = [t for t in self._expected if t > now] + [now + ttl_s] * n
        return True

    def arrived(self) -> None:
        with self._mu:
            if self._expected:
                self._expected.pop(0)

    def serving(self) -> None:
        """A generation starts: the next idle period sends IDLE again."""
        with self._mu:
            self._idle_sent = False

    def decide_idle(self, ready: bool) -> tuple[bool, float | None]:
        """(send IDLE now, the deadline of the earliest arrival still expected): IDLE goes when the
        replica is ``ready`` (idle, with something to train on) and no arrival is expected; the
        caller looks again at the deadline of one that never arrives."""
        with self._mu:
            now = time.monotonic()
            self._expected = [t for t in self._expected if t > now]
            expected = min(self._expected, default=None)
            send = ready and expected is None
            self._idle_sent = self._idle_sent or send
        return send, expected

    def begin_step(self) -> None:
        self.moved_out = 0

    def leave(self, keys: list[str], to: str, batcher_leave: Callable[[list[str]], list[str]]) -> list[str]:
        """The requests ``keys`` leave for server ``to`` (``batcher_leave`` lets them go at the next
        step boundary); returns those that were in flight here."""
        keys = [k for k in keys if k not in self._leaving]
        for k in keys:
            self._leaving[k] = to
        left = batcher_leave(keys)
        for k in set(keys) - set(left):
            self._leaving.pop(k, None)
        return left

    def departed(self, key: str, left: bool) -> str | None:
        """Request ``key`` was answered here (``left``: it moved); its destination if it moved (a
        request may finish before its move took effect: then it is forgotten, not counted)."""
        to = self._leaving.pop(key, None)
        if left:
            self.moved_out += 1
        return to
