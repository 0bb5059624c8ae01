"""The replica's request batcher: verl's concurrent per-request ``generate`` calls -> one running engine.

Owns the hand-off of arriving requests to the engine, the generation that serves them and the gate
that holds them. Continuous batching: requests that reach an idle engine within ``window_s`` of each
other start a generation together (the window closes early at ``max_batch``); a request that arrives
while it runs is added to the engine at the next step boundary
(:meth:`~tlt.rollout.engine.RolloutEngine.add`). The engine's queue admits them, by free rows and,
with a paged cache, free blocks (and takes evicted requests back first). Each request's result (a
:class:`~tlt.rollout.request.Finished`) is returned as soon as it finishes.

Abort (verl's ``abort_all_requests`` and ``resume_generation``, and a single request's abort): the
gate closes, so requests arriving meanwhile wait for :meth:`resume` (or, with ``reject``, return at
once as aborted with no tokens); running and queued requests are aborted at the next step boundary
and return their partial output (reason ``aborted``). :meth:`leave` is the same for named requests
without the gate, with reason ``left``: the request goes on elsewhere from its state (a move).

Load (:meth:`load`): with ``track_load``, after each step the worker feeds a
:class:`~.replica_load.LoadMeter` the step's cost and the running requests' progress, which
consolidation reads.

Threads and ownership: the event loop owns the futures, the gate and the ``_serving`` flag; a
generation runs in one worker thread, which owns the engine from its first step to its last, inside
``serving()`` (e.g. the replica's serving lock, taken and released in one function). The two meet
only in ``_mu``-guarded fields: ``_pending`` (event loop appends, worker takes) and the abort and
leave requests (event loop posts, worker serves). A result is handed to the event loop with
``call_soon_threadsafe`` (FIFO with the worker's end, so every answer is delivered, and counted out
of the in-flight count, before the event loop sees the generation end). The worker ends a generation only when, under ``_mu``, the engine is idle and nothing waits; a
request queued after that is seen by the event loop, which starts the next. A generation that fails
fails its own requests (those in its engine and those it was adding) and returns the abort-alls it
took; the batcher keeps serving.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from tlt.integrations.verl.replica_load import Load, LoadMeter
from tlt.rollout.engine import RolloutEngine, StepRecord
from tlt.rollout.request import Finished, RequestState

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Request:
    state: RequestState
    key: str  # the caller's id (verl's request_id): what a single abort names
    future: asyncio.Future
    rid: int | None = None  # the engine's id once admitted
    steps: int = 0  # engine steps it ran in here (its tokens beyond one per step were accepted drafts)


@dataclasses.dataclass
class Generation:
    """What one generation did (handed to the callable ``serving()`` yields)."""

    finished: list[Finished]
    steps: list[StepRecord]
    started: float  # time.monotonic() at its first step
    seconds: float
    tokens: int  # generated in it (tokens requests brought with them excluded)
    lifecycle: dict[str, int] = dataclasses.field(default_factory=dict)  # its engine's joined / left / aborted / evicted


@contextlib.contextmanager
def _serving_alone() -> Iterator[Callable[[Generation], None]]:
    """The default ``serving``: nothing held, the record dropped."""
    yield lambda gen: None


class RequestBatcher:
    def __init__(self, engine: Callable[[], RolloutEngine], *, window_s: float, max_batch: int,
                 serving: Callable[[], contextlib.AbstractContextManager] = _serving_alone,
                 on_idle: Callable[[], None] = lambda: None, name: str = "replica", track_load: bool = False) -> None:
        """``engine()``: the engine to run (read at each generation's start); ``serving()``: a context
        the worker thread holds around each generation, yielding where the generation's record goes
        (an error entering it fails the requests waiting for that generation); ``on_idle``: runs in
        the event loop when every request was answered (it must not block); ``track_load``: measure
        and publish the load after each step (only consolidation reads it: off, the step loop does
        no more)."""
        self.meter = LoadMeter() if track_load else None
        self.engine, self.serving, self.on_idle = engine, serving, on_idle
        self.window_s, self.max_batch, self.name = window_s, max_batch, name
        self._mu = threading.Lock()
        self._pending: list[Request] = []  # queued for the engine (guarded by _mu)
        self._abort_all: list[asyncio.Future] = []  # abort-all requests for the worker (guarded by _mu)
        self._exits: dict[str, str] = {}  # key -> "aborted" / "left", for the worker (guarded by _mu)
        self._serving = False  # a generation is starting or running (event loop only)
        self._open: asyncio.Event | None = None  # the gate (set: open), made in the event loop
        self._rejecting = False
        # requests submitted and not answered yet (waiting, queued or decoding), by key (event loop)
        self._keys: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------------------------ event loop side
    async def submit(self, state: RequestState, key: str = "") -> Finished:
        """Queue one request and wait for it to finish (or be aborted). A request the engine cannot
        run is refused here (ValueError), never inside a generation others share."""
        self.engine().check(state)
        gate = self._gate()
        if not gate.is_set():
            if self._rejecting:
                return Finished(-1, state, "aborted")
            await gate.wait()
        fut = asyncio.get_running_loop().create_future()
        with self._mu:
            self._pending.append(Request(state, key, fut))
        self._keys[key] += 1
        if not self._serving:
            self._serving = True
            asyncio.get_running_loop().create_task(self._serve())
        return await fut

    async def abort_all(self, reject: bool = False) -> list[str]:
        """Close the gate (``reject``: later requests return at once as aborted, else they wait for
        :meth:`resume`) and abort every queued and running request; returns their keys once they
        have all returned."""
        gate = self._gate()
        gate.clear()
        self._rejecting = reject
        with self._mu:
            keys = [r.key for r in self._pending]
            waiting, self._pending = self._pending, []
        for r in waiting:  # never admitted: nothing generated
            self._answer(r, Finished(-1, r.state, "aborted"))
        if not self._serving:
            return keys
        fut = asyncio.get_running_loop().create_future()
        with self._mu:
            self._abort_all.append(fut)
        return keys + await fut

    async def abort(self, key: str) -> bool:
        """Abort the request ``key`` (waiting or running; at once if not handed to the engine yet, else at
        the next step boundary: it returns its partial output); False if
        no request of that key is in flight."""
        return bool(self._exit([key], "aborted"))

    def leave(self, keys: list[str]) -> list[str]:
        """The requests ``keys`` leave (those not handed to the engine yet at once, the others at the
        next step boundary),
        each answered with its state (reason ``left``); returns the keys that were in flight."""
        return self._exit(keys, "left")

    def _exit(self, keys: list[str], reason: str) -> list[str]:
        keys = [k for k in dict.fromkeys(keys) if k in self._keys]
        with self._mu:
            mine = [r for r in self._pending if r.key in keys]
            self._pending = [r for r in self._pending if r.key not in keys]
            for key in keys:
                if self._keys[key] > sum(r.key == key for r in mine):  # admitted: at the next step boundary
                    self._exits.setdefault(key, reason)
        for r in mine:
            self._answer(r, Finished(-1, r.state, reason))
        return keys

    def load(self) -> Load:
        """The last published load (none measured without ``track_load``)."""
        return self.meter.load() if self.meter is not None else Load((), {}, None, 1.0)

    def resume(self) -> None:
        """Open the gate again: held requests go on."""
        self._rejecting = False
        self._gate().set()

    @property
    def inflight(self) -> int:
        return sum(self._keys.values())

    @property
    def idle(self) -> bool:
        return self.inflight == 0

    def _gate(self) -> asyncio.Event:
        if self._open is None:
            self._open = asyncio.Event()
            self._open.set()
        return self._open

    def _answer(self, req: Request, value: Finished | Exception) -> None:
        """Deliver a request's result (event loop). The in-flight count drops here, with the
        delivery, so the idle check after a generation never sees a request already answered."""
        self._keys[req.key] -= 1
        if not self._keys[req.key]:
            del self._keys[req.key]
        if req.future.done():  # the caller went away
            return
        if isinstance(value, Exception):
            req.future.set_exception(value)
        else:
            req.future.set_result(value)

    async def _serve(self) -> None:
        """Start generations while requests wait: the first after a window without arrivals."""
        try:
            while True:
                while True:  # wait until requests stop arriving for one window
                    n = len(self._pending)
                    await asyncio.sleep(self.window_s)
                    if len(self._pending) == n or n >= self.max_batch:
                        break
                if not self._pending:  # aborted while the window ran
                    break
                await asyncio.to_thread(self._generation, asyncio.get_running_loop())
                if not self._pending:
                    break
        except Exception:  # never let serving die: later requests would wait forever
            log.exception("%s: batcher error", self.name)
        finally:
            self._serving = False
            with self._mu:  # abort-alls posted as the generation ended have nothing left to abort
                late, self._abort_all = self._abort_all, []
            for f in late:
                _resolve(f, [])
        if self._pending:
            self._serving = True
            asyncio.get_running_loop().create_task(self._serve())
        elif self.inflight == 0:
            self.on_idle()

    # ------------------------------------------------------------------ worker thread
    def _generation(self, loop: asyncio.AbstractEventLoop) -> None:
        eng, t0 = self.engine(), time.monotonic()  # (the generation's time includes the wait for serving())
        with self._mu:  # exits posted before now named requests that had finished: none of this generation's
            self._exits.clear()
        with contextlib.ExitStack() as stack:
            try:
                record = stack.enter_context(self.serving())
            except Exception as e:  # the requests waiting for this generation learn why it never ran
                log.exception("%s: a generation could not start", self.name)
                with self._mu:
                    waiting, self._pending = self._pending, []
                for req in waiting:
                    loop.call_soon_threadsafe(self._answer, req, e)
                return
            record(self._decode(eng, loop, t0))

    def _decode(self, eng: RolloutEngine, loop: asyncio.AbstractEventLoop, t0: float) -> Generation:
        """Step the engine until it is idle and nothing waits: requests join at step boundaries,
        exits are served, each result is answered as it finishes. Returns what the generation did
        (a failure fails its own requests and ends it)."""
        live: dict[int, Request] = {}
        held = _Held()  # taken from the event loop's side, not yet in the engine or answered
        done: list[Finished] = []
        first, tokens, counts = eng.steps_run, 0, collections.Counter(eng.lifecycle)

        def answer(outs: list[Finished]) -> None:
            nonlocal tokens
            for f in outs:
                req = live.pop(f.rid)
                tokens += len(f.state.output) - len(req.state.output)
                done.append(f)
                loop.call_soon_threadsafe(self._answer, req, f)

        try:
            while self._step_once(eng, loop, live, held, answer):
                pass
        except Exception as e:  # the engine is emptied, then every request it held or was to hold learns the error
            failed = [*live.values(), *held.joining]
            log.exception("%s: a generation of %d requests failed", self.name, len(failed))
            try:
                eng.abort()
            except Exception:
                log.exception("%s: emptying the engine after the failure failed too", self.name)
            for req in failed:
                loop.call_soon_threadsafe(self._answer, req, e)
            for f in held.aborts:  # (after the answers: an abort-all returns once its requests did)
                loop.call_soon_threadsafe(_resolve, f, [r.key for r in failed])
        finally:
            steps = eng.steps_since(first)
            eng.forget_steps(eng.steps_run)  # handed over with the generation: the engine keeps no history
        return Generation(done, steps, t0, time.monotonic() - t0, tokens,
                          dict(collections.Counter(eng.lifecycle) - counts))

    def _step_once(self, eng: RolloutEngine, loop: asyncio.AbstractEventLoop, live: dict[int, Request],
                   held: _Held, answer: Callable[[list[Finished]], None]) -> bool:
        """One step boundary: aborts, exits and arrivals served, then one engine step. False when the
        engine is idle and nothing waits (the generation ends; decided under ``_mu``). What it takes
        from the event loop's side stays in ``held`` until served, so a failure reaches it."""
        with self._mu:
            held.aborts += self._abort_all
            self._abort_all = []
            exits, self._exits = self._exits, {}
            held.joining += self._pending  # the engine's queue admits them (rows, blocks)
            self._pending = []
            if not held.joining and not eng.active:
                if self.meter is not None:
                    self.meter.clear()
                for f in held.aborts:
                    loop.call_soon_threadsafe(_resolve, f, [])
                held.aborts = []
                return False
        if held.aborts:
            gone = [r.key for r in live.values()]
            answer(eng.abort(list(live)))
            for f in held.aborts:
                loop.call_soon_threadsafe(_resolve, f, gone)
            held.aborts = []
        for reason in ("aborted", "left"):
            named = [rid for rid, r in live.items() if exits.get(r.key) == reason]
            if named:
                answer(eng.abort(named) if reason == "aborted" else eng.leave(named))
        while held.joining:  # one by one: a request the engine refuses fails alone
            req = held.joining[0]
            try:
                (rid,) = eng.add([req.state])
            except ValueError as e:
                loop.call_soon_threadsafe(self._answer, held.joining.pop(0), e)
                continue
            held.joining.pop(0)
            req.rid, live[rid] = rid, req
        if eng.active:
            n_steps, t_step, joins = eng.steps_run, time.monotonic(), eng.lifecycle["joined"]
            answer(eng.step())
            if self.meter is not None:
                if eng.steps_run > n_steps:  # a decode step ran (its prefill of joining requests included)
                    self.meter.measure(eng.steps[-1], time.monotonic() - t_step, eng.lifecycle["joined"] - joins)
                self._publish(live, eng.progress())
        return True

    def _publish(self, live: dict[int, Request], progress: dict[int, int]) -> None:
        """``progress``: the requests still running, each of which ran this step."""
        reqs = []
        for rid, r in live.items():  # (in the order they joined)
            have = progress.get(rid)
            if have is None:  # waiting for a row
                continue
            r.steps += 1
            made = have - len(r.state.output)  # here, from ``steps`` steps: the rest were accepted drafts
            reqs.append((r.key, have, max(made - r.steps, 0), r.state.params.max_new_tokens))
        self.meter.publish(reqs)


@dataclasses.dataclass
class _Held:
    """What a generation took from the event loop's side and has not served yet (worker thread)."""

    joining: list[Request] = dataclasses.field(default_factory=list)  # taken from _pending, not yet added
    aborts: list[asyncio.Future] = dataclasses.field(default_factory=list)  # abort-alls taken, not yet resolved


def _resolve(fut: asyncio.Future, value: Any) -> None:
    """An abort-all's answer (its caller may have gone away)."""
    if not fut.done():
        fut.set_result(value)

