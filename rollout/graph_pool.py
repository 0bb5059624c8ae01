"""Capture and replay of the planned CUDA graphs (CUDA only), and when and how safely to capture.

Owns :class:`CaptureGate` (a shape is captured at its ``after``-th use), :func:`capturing` (below)
with its :class:`FairLock`, and :class:`CudaGraphPool`: warm-up and capture on one side stream, into one
shared graph-memory pool per scheme, replay with inputs copied into the static buffers, and the
measured memory of each graph. It is model-agnostic: the engine hands it a factory
``make_step(key) -> (static_inputs, fn)`` for the keys of :mod:`tlt.rollout.graphs` (or whole plans
of :func:`tlt.bench.graph_plan.plan_graphs`).

A capture is safe by construction against the two things that invalidated one
(``cudaErrorStreamCaptureInvalidated``, "operation not permitted when stream is capturing"): the
garbage collector, whose passes freed dropped engines' graphs mid-capture, is disabled during the
warm-up and capture; other threads' device work (a replica's drift probe) and
:meth:`CudaGraphPool.close` take :data:`CAPTURE_LOCK`, which a capture holds throughout and gets in
its turn; and a pool dropped without ``close()`` (its engine went with its last reference, in any
thread, or at a collection) leaves its graphs to the next holder of that lock outside a capture. A
capture makes no collection of its own: a full pass over the heap (0.1 s in a bench's process) at
every capture of a tuner's new shape is time its rollout pays.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import inspect
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping

import torch

from tlt.rollout.graphs import GraphKey

log = logging.getLogger(__name__)

# graphs by the capture scheme that captured them, each scheme its own memory pool (the engine captures
# "bucketed"; the benches compare it with "naive", :mod:`tlt.bench.graph_plan`)
SCHEMES = ("bucketed", "naive")


class FairLock:
    """A reentrant lock granted in the order it was asked for. A capture waits for at most the
    holders that asked before it: a thread that releases and at once asks again (a drift probe's
    forwards back to back) queues behind the capture, where a plain lock lets it take the lock again
    before the woken waiter runs, and a capture could wait behind any number of forwards. A waiter
    interrupted by an exception gives its turn up."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._tickets = 0  # tickets handed out
        self._serving = 0  # the ticket whose turn it is
        self._given_up: set[int] = set()  # tickets whose waiter left before its turn
        self._owner: int | None = None
        self._depth = 0

    def acquire(self) -> bool:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return True
            ticket = self._tickets
            self._tickets += 1
            try:
                self._cond.wait_for(lambda: self._serving == ticket)
            except BaseException:
                self._given_up.add(ticket)
                self._next_turn()
                raise
            self._owner, self._depth = me, 1
            return True

    def release(self) -> None:
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("released by a thread that does not hold it")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._serving += 1
                self._next_turn()

    def _next_turn(self) -> None:
        """Skip the turns given up (under the condition's lock) and wake the waiters."""
        while self._owner is None and self._serving in self._given_up:
            self._given_up.discard(self._serving)
            self._serving += 1
        self._cond.notify_all()

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# Held by every capture; device work on any other thread of the process, and closing a pool, take it
# too. Taken after a replica's serving lock where both are (a batch's captures, the drift probe's
# forwards, a drafter push closing the replaced proposer's graphs), never before it.
CAPTURE_LOCK = FairLock()

# The graphs of pools dropped without close(). A pool's finalizer runs in whichever thread drops its
# last reference, or at a collection, at any line: inside a capture, or inside CAPTURE_LOCK's own
# acquire with its inner lock held. So it takes no lock and destroys nothing: it hands its graphs over
# here (a list append), and the next holder of CAPTURE_LOCK outside a capture destroys them.
_DROPPED: list[dict] = []


def _destroy_dropped() -> None:
    """Destroy the graphs of dropped pools; the caller holds CAPTURE_LOCK and captures nothing. A
    graph that fails to go is logged: the error belongs to an engine long gone, not to the caller."""
    while _DROPPED:
        graphs = _DROPPED.pop()
        for key, cap in graphs.items():
            try:
                cap.graph.reset()
            except Exception:
                log.exception("destroying the graph %s of a dropped pool failed", key)
        graphs.clear()


def destroy_dropped_graphs() -> None:
    """Destroy the graphs of pools dropped without close() and return the cached memory to the
    device, waiting for a capture in another thread to end. A new CUDA engine calls it before it
    sizes its cache, and ``release_memory`` does; the next capture and every close() destroy them too."""
    with CAPTURE_LOCK:
        _destroy_dropped()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def capturing():
    """No collection and no other thread's device work while a graph is warmed up and captured."""
    with CAPTURE_LOCK:
        _destroy_dropped()  # before the capture starts
        enabled = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            if enabled:
                gc.enable()

StepFn = Callable[[dict[str, torch.Tensor]], Mapping[str, torch.Tensor]]
MakeStep = Callable[[GraphKey], tuple[dict[str, torch.Tensor], StepFn]]


def held_weakly(fn: Callable) -> Callable[[], Callable | None]:
    """``fn`` as its holder should keep it: a bound method weakly (None once its object is gone), any
    other callable strongly. A pool is an attribute of the object whose method makes its steps: a
    strong reference back would make a cycle that keeps that object -- and the KV cache it holds --
    alive after its owner drops it, until a garbage collection."""
    if inspect.ismethod(fn):
        return weakref.WeakMethod(fn)
    return lambda: fn


@dataclasses.dataclass(frozen=True, kw_only=True)
class GraphMemory:
    """Measured cost of one capture (bytes)."""

    key: str
    scheme: str
    tokens: int
    input_bytes: int  # static input buffers made by make_step (exact nbytes)
    output_bytes: int  # memory_allocated delta across capture: live static outputs
    pool_bytes: int  # memory_reserved delta across capture: growth of the scheme's graph pool
    device_bytes: int  # mem_get_info delta across capture: pool growth + the graph executable


@dataclasses.dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    memory: GraphMemory


class CaptureGate:
    """When a step shape's graph is worth capturing: at its ``after``-th use, its first ones running
    eagerly, so a shape used once (a tuner's exploration of an arm) costs an eager step, not a
    capture. Pure bookkeeping, shared by the verify step and the draft loop."""

    def __init__(self, after: int) -> None:
        if after < 1:
            raise ValueError(f"capture_after={after}: a shape is captured at its first use or later (>= 1)")
        self.after = after
        self.uses: collections.Counter = collections.Counter()  # uses of each shape while not captured
        self.eager = 0  # uses that ran eagerly

    def due(self, key: GraphKey) -> bool:
        """A use of ``key`` (not captured yet): True when it should be captured now."""
        self.uses[key] += 1
        if self.uses[key] >= self.after:
            return True
        self.eager += 1
        return False


class CudaGraphPool:
    """Captures ``torch.cuda.CUDAGraph`` s for graph keys and replays them.

    One graph-memory pool (``torch.cuda.graph_pool_handle()``) per scheme is shared by that
    scheme's graphs; keys are captured largest first so smaller graphs reuse the pool's blocks.
    So graphs of one pool must not be replayed concurrently (one stream), and the static outputs
    ``replay`` returns are valid only until the next replay of *any* graph of that pool (a later
    graph's outputs may sit in an earlier graph's freed workspace): consume or clone them first.

    ``make_step`` may be a method of the object that holds the pool: it is held weakly, so that
    object (an engine's step, with the KV cache) goes with its last reference, not at a collection.

    Needs CUDA: constructing it without a device raises RuntimeError (check
    ``CudaGraphPool.available()`` and run the step functions eagerly on CPU). Step functions must
    be capturable: no host syncs (``.item()``, ``int(tensor)``, dynamic-NTK RoPE), no allocation
    of new inputs, fixed shapes.
    """

    def __init__(self, make_step: MakeStep, *, device: torch.device | str | None = None,
                 warmup_iters: int = 3) -> None:
        if not self.available():
            raise RuntimeError("CudaGraphPool needs a CUDA device and torch.cuda.is_available() is "
                               "False: check CudaGraphPool.available() and run steps eagerly on CPU")
        if warmup_iters < 1:
            raise ValueError(f"warmup_iters={warmup_iters}: at least 1 warm-up run is needed "
                             "before capture (cuBLAS handles, lazy init)")
        self.device = torch.device(device if device is not None else "cuda")
        self._make_step = held_weakly(make_step)
        self.warmup_iters = warmup_iters
        self._pools: dict[str, tuple] = {}
        self._graphs: dict[tuple[str, GraphKey], _Captured] = {}
        self._side = torch.cuda.Stream(device=self.device)  # warm-ups and captures: one stream, one cuBLAS workspace
        self._followed: dict[str, tuple[int, tuple[int, ...]]] = {}  # what: (address, shape) the graphs read

    def follow(self, what: str, tensor: torch.Tensor | None) -> None:
        """The graphs read ``tensor`` (a buffer outside their static inputs, e.g. the engine's feature
        buffer) by address: when ``what`` is another tensor than at their capture (laid out anew),
        every graph is dropped, to be captured again over the new one."""
        if tensor is None:
            return
        now = (tensor.data_ptr(), tuple(tensor.shape))
        if self._followed.get(what, now) != now:
            self.close()
            log.info("graphs dropped: %s moved", what)
        self._followed[what] = now

    @staticmethod
    def available() -> bool:
        return torch.cuda.is_available()

    def capture(self, keys: Iterable[GraphKey], *, scheme: str = "bucketed") -> list[GraphMemory]:
        """Capture every key not yet captured under ``scheme`` (largest first); their costs."""
        if scheme not in SCHEMES:
            raise ValueError(f"scheme={scheme!r}: use one of {SCHEMES}")
        with torch.cuda.device(self.device), capturing():
            pool = self._pools.setdefault(scheme, torch.cuda.graph_pool_handle())
            todo = sorted(set(keys), key=lambda k: (-k.tokens, str(k)))
            out = [self._capture_one(scheme, k, pool) for k in todo if (scheme, k) not in self._graphs]
        log.info("captured %d %s graphs: pool +%.1f MB", len(out), scheme,
                 sum(m.pool_bytes for m in out) / 1e6)
        return out

    def _capture_one(self, scheme: str, key: GraphKey, pool: tuple) -> GraphMemory:
        make_step = self._make_step()
        if make_step is None:
            raise RuntimeError(f"{key}: the object whose method makes this pool's steps is gone")
        inputs, fn = make_step(key)
        for name, t in inputs.items():
            if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
                raise ValueError(f"{key}: static input {name!r} must be a CUDA tensor, got "
                                 f"{type(t).__name__} on {getattr(t, 'device', None)}")
        # Warm-up on the side stream the graph is then captured on (libraries that keep state per
        # stream set it up here, not mid-capture): the pool's first capture warmup_iters times, later
        # ones once (the stream's state exists; one run loads this step's own kernels).
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(self._side):
            for _ in range(self.warmup_iters if not self._graphs else 1):
                fn(inputs)
        torch.cuda.current_stream().wait_stream(self._side)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # so the reserved delta below is the graph pool's growth only
        free0, alloc0, res0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph, pool=pool, stream=self._side):
            outputs = fn(inputs)
        torch.cuda.synchronize()
        if not isinstance(outputs, Mapping) or not all(isinstance(v, torch.Tensor) for v in outputs.values()):
            raise TypeError(f"{key}: the step function must return a dict of tensors, got "
                            f"{type(outputs).__name__}")
        mem = GraphMemory(key=str(key), scheme=scheme, tokens=key.tokens,
                          input_bytes=sum(t.numel() * t.element_size() for t in inputs.values()),
                          output_bytes=torch.cuda.memory_allocated() - alloc0,
                          pool_bytes=torch.cuda.memory_reserved() - res0,
                          device_bytes=free0 - torch.cuda.mem_get_info()[0])
        self._graphs[(scheme, key)] = _Captured(graph, inputs, dict(outputs), mem)
        log.debug("captured %s (%s): pool +%d B, outputs %d B", key, scheme, mem.pool_bytes, mem.output_bytes)
        return mem

    def _find(self, key: GraphKey, scheme: str | None) -> _Captured | None:
        return next((self._graphs[(p, key)] for p in ((scheme,) if scheme else SCHEMES)
                     if (p, key) in self._graphs), None)

    def has(self, key: GraphKey, scheme: str | None = None) -> bool:
        return self._find(key, scheme) is not None

    def replay(self, key: GraphKey, *, scheme: str | None = None, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copy ``inputs`` into the static buffers (same shapes), replay, return static outputs
        (see the class note on their lifetime); ``scheme=None``: bucketed if captured, else naive."""
        cap = self._find(key, scheme)
        if cap is None:
            raise KeyError(f"{key} was not captured{f' under {scheme}' if scheme else ''}; "
                           "capture it first (or pad the batch to a captured size)")
        for name, value in inputs.items():
            dst = cap.inputs.get(name)
            if dst is None:
                raise KeyError(f"{key}: no static input {name!r}; inputs are {sorted(cap.inputs)}")
            if dst.shape != value.shape:
                raise ValueError(f"{key}: input {name!r} has shape {tuple(value.shape)}, the graph was "
                                 f"captured with {tuple(dst.shape)}; pad to the captured shape")
            dst.copy_(value, non_blocking=True)
        cap.graph.replay()
        return cap.outputs

    def memory_report(self) -> dict:
        """Measured totals per captured scheme, and naive/bucketed when both were captured."""
        report: dict = {}
        for scheme in SCHEMES:
            mems = [c.memory for (p, _), c in self._graphs.items() if p == scheme]
            if mems:
                report[scheme] = {"graphs": len(mems), **{f: sum(getattr(m, f) for m in mems) for f in
                                  ("input_bytes", "output_bytes", "pool_bytes", "device_bytes")}}
        if "naive" in report and "bucketed" in report:
            for f in ("pool_bytes", "device_bytes"):
                den = report["bucketed"][f]
                report[f"ratio_{f}"] = report["naive"][f] / den if den else float("inf")
        return report

    def close(self) -> None:
        """Drop every graph and its buffers, and return the cached memory to the device; never
        during a capture (a replaced proposer's pool may be closed from another thread than the one
        capturing), so it waits for CAPTURE_LOCK."""
        with CAPTURE_LOCK:
            for cap in self._graphs.values():
                cap.graph.reset()
            self._graphs.clear()
            _destroy_dropped()
            self._pools.clear()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def __del__(self, _dropped: list[dict] = _DROPPED) -> None:  # (bound now: module globals go at exit)
        graphs = getattr(self, "_graphs", None)
        if graphs:  # dropped without close(): no lock here, see _DROPPED
            _dropped.append(graphs)
