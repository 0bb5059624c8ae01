"""Selective asynchronous drafter checkpoints (torch.distributed.checkpoint) with crash-safe commits.

Owns the spot trainer's checkpoint directory, the selective training state, the async save state
machine and loading (with resharding to another world size).

Layout: ``root/step-00000012/`` is a complete DCP checkpoint; a save is written to
``root/step-00000012.tmp/`` and renamed into place (then the root is fsynced) only after the
save future completed on the coordinator rank, i.e. after every rank's shards and the ``.metadata``
are on disk. A process killed with SIGKILL at any point therefore leaves at most a stale ``.tmp``
(ignored by :func:`latest`, removed by the next :class:`AsyncCheckpointer`), never a damaged
complete checkpoint. Old checkpoints are pruned by renaming to ``.trash`` before deletion.

Selective state (:class:`TrainState`): the drafter's own state dict (trainable parameters plus its
small persistent buffers, e.g. the EAGLE-3 vocab maps) and the optimizer state, keyed by FQN via
``get_state_dict`` (FSDP2 DTensors are saved sharded), plus a few progress integers. The target's
embedding and LM head are shared by reference, are not parameters, and are checked not to appear.

State machine (:class:`AsyncCheckpointer`)::

    IDLE --save()--> STAGING --(snapshot copied)--> SAVING --(written: commit in writer thread)
    STAGING/SAVING --wait()--> IDLE        any --close()--> CLOSED (after waiting)

Rules: at most one save in flight; ``save`` first waits for the in-flight one (the staging
buffers are cached and reused, so this rule also keeps the previous snapshot intact); ``close``
waits; with ``overlap_staging`` the snapshot copy runs in the background too, and the loop must
call ``wait_staged()`` before it next mutates the saved tensors (the optimizer step) — without
it, ``save`` returns with the snapshot taken (STAGING is skipped). The commit runs as soon as
the write finishes, without waiting for the loop to call ``wait``, so the work lost to a kill
is bounded by one interval plus one save's duration.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step-(\d+)$")
TMP_SUFFIX = ".tmp"
TRASH_SUFFIX = ".trash"
# DCP warns on every single-process save/load; without a process group that is what we mean.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def complete_steps(root: str | Path) -> list[int]:
    """Steps of the complete checkpoints under ``root``, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and (p / ".metadata").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest(root: str | Path) -> int | None:
    """Step of the newest complete checkpoint under ``root`` (``None`` if there is none)."""
    steps = complete_steps(root)
    return steps[-1] if steps else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj.to_local() if hasattr(obj, "to_local") else obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _refuse_frozen(state: Any, frozen: Iterable[torch.Tensor]) -> None:
    """Raise if a tensor of ``state`` shares storage with a frozen target tensor (embedding / LM
    head): those stay shared by reference and never reach a drafter checkpoint."""
    ptrs = {t.untyped_storage().data_ptr() for t in frozen}
    if any(t.numel() and t.untyped_storage().data_ptr() in ptrs for t in _tensors(state)):
        raise RuntimeError("a target tensor (embedding / LM head) reached the drafter checkpoint; "
                           "it must stay shared by reference, not a parameter")


def state_nbytes(state: Any) -> int:
    """Bytes of this rank's tensors in a (possibly nested) state dict."""
    return sum(t.numel() * t.element_size() for t in _tensors(state))


class TrainState(Stateful):
    """Selective training state: drafter state dict + optimizer state + progress counters.

    ``frozen`` are the target tensors the drafter reads by reference (embedding, LM head); the
    state dict raises if any tensor shares their storage (the target must never be saved here).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, step: int = 0,
                 frozen: Iterable[torch.Tensor] = (), progress: dict[str, int] | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.step = step
        self.progress = dict(progress or {})  # extra ints (world size, samples seen, ...)
        self._frozen = [t for t in frozen if t is not None]

    def state_dict(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.optimizer)
        _refuse_frozen((msd, osd), self._frozen)
        return {"model": msd, "optim": osd, "progress": {"step": self.step, **self.progress}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])
        progress = dict(state_dict["progress"])
        self.step = int(progress.pop("step"))
        self.progress.update({k: int(v) for k, v in progress.items()})


class SaveState(enum.Enum):
    IDLE = "idle"
    STAGING = "staging"  # snapshot copy still running: the saved tensors must not change yet
    SAVING = "saving"  # snapshot taken; writing (or written and committed, not yet waited for)
    CLOSED = "closed"


@dataclasses.dataclass
class CheckpointStats:
    """What the training loop paid and what reached disk (seconds, monotonic clock)."""

    stall_s: list[float] = dataclasses.field(default_factory=list)  # per save: save() + wait_staged()
    wait_s: list[float] = dataclasses.field(default_factory=list)  # time wait() blocked
    write_s: list[float] = dataclasses.field(default_factory=list)  # snapshot start -> committed
    committed: list[int] = dataclasses.field(default_factory=list)  # steps, in commit order
    bytes: int = 0  # this rank's bytes in the last save


@dataclasses.dataclass
class _InFlight:
    step: int
    tmp: Path
    future: Future  # upload (write) completion
    staged: Future | None  # snapshot completion (overlap_staging only)
    started: float
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: BaseException | None = None


def _is_coordinator(pg: dist.ProcessGroup | None) -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank(pg) == 0


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


class AsyncCheckpointer:
    """Selective async checkpoints under ``root``; see the module docstring for the rules.

    Every rank of the session constructs one and calls ``save`` at the same steps. With more than
    one rank pass a dedicated gloo ``process_group``: DCP runs its collectives in the writer
    thread, and they must not interleave with the training loop's collectives on another group.
    """

    def __init__(self, root: str | Path, *, keep_last: int = 2,
                 process_group: dist.ProcessGroup | None = None,
                 overlap_staging: bool = False) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last}: keep at least 1 complete checkpoint")
        self.root = Path(root)
        self.keep_last = keep_last
        self.pg = process_group
        self.coordinator = _is_coordinator(process_group)
        self.stats = CheckpointStats()
        self._closed = False
        self._inflight: _InFlight | None = None
        self._lock = threading.Lock()
        cuda = torch.cuda.is_available()
        # Cached staging buffers: after the first save a snapshot is a copy into warm memory.
        self._stager = DefaultStager(StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=overlap_staging,
            use_non_blocking_copy=cuda))
        if self.coordinator:
            self.root.mkdir(parents=True, exist_ok=True)
            for p in self.root.iterdir():  # leftovers of a killed save or prune
                if p.name.endswith((TMP_SUFFIX, TRASH_SUFFIX)):
                    log.info("removing incomplete checkpoint %s", p)
                    shutil.rmtree(p, ignore_errors=True)
        if not _no_dist():
            dist.barrier(group=process_group)  # nobody writes before the cleanup is done

    @property
    def state(self) -> SaveState:
        with self._lock:
            fl = self._inflight
        if self._closed:
            return SaveState.CLOSED
        if fl is None:
            return SaveState.IDLE
        return SaveState.STAGING if fl.staged is not None and not fl.staged.done() else SaveState.SAVING

    @property
    def last_committed(self) -> int | None:
        return self.stats.committed[-1] if self.stats.committed else None

    def save(self, step: int, state: dict[str, Any]) -> float:
        """Snapshot ``state`` and write it in the background; returns the seconds this blocked.

        ``state`` is a DCP state dict (values may be :class:`Stateful`, e.g. a TrainState).
        Waits first for a save still in flight (counted as stall: the loop is blocked).
        """
        if self._closed:
            raise RuntimeError("AsyncCheckpointer.save after close()")
        t0 = time.monotonic()
        self.wait()
        tmp = step_dir(self.root, step).with_suffix(TMP_SUFFIX)
        if self.coordinator:
            shutil.rmtree(tmp, ignore_errors=True)
        started = time.monotonic()
        plain = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}
        self.stats.bytes = state_nbytes(plain)
        writer = dcp.FileSystemWriter(tmp, sync_files=True)
        resp = dcp.async_save(plain, storage_writer=writer, process_group=self.pg,
                              async_stager=self._stager, no_dist=_no_dist())
        if isinstance(resp, AsyncSaveResponse):  # overlap_staging: the copy is still running
            flight = _InFlight(step, tmp, resp.upload_completion, resp.staging_completion, started)
        else:
            flight = _InFlight(step, tmp, resp, None, started)
        with self._lock:
            self._inflight = flight
        flight.future.add_done_callback(lambda f, fl=flight: self._on_written(fl))
        stall = time.monotonic() - t0
        self.stats.stall_s.append(stall)
        return stall

    def _on_written(self, fl: _InFlight) -> None:
        """Writer thread: commit (coordinator renames ``.tmp`` into place), then prune."""
        try:
            fl.future.result()
            if self.coordinator:
                _commit(fl.tmp, step_dir(self.root, fl.step))
                self._prune()
            self.stats.write_s.append(time.monotonic() - fl.started)
            self.stats.committed.append(fl.step)
            log.debug("checkpoint step %d committed", fl.step)
        except BaseException as err:  # noqa: BLE001 - surfaced by wait(); callbacks must not raise
            fl.error = err
        finally:
            fl.done.set()

    def _prune(self) -> None:
        prune(self.root, self.keep_last)

    def wait_staged(self) -> float:
        """Block until the in-flight snapshot is copied; call before mutating the saved tensors.

        Returns the seconds blocked (added to the save's stall). A no-op without overlap_staging.
        """
        with self._lock:
            fl = self._inflight
        if fl is None or fl.staged is None or fl.staged.done() and fl.staged.exception() is None:
            return 0.0
        t0 = time.monotonic()
        try:
            fl.staged.result()
        except BaseException as err:
            raise RuntimeError(f"checkpoint of step {fl.step}: snapshot failed: {err!r}") from err
        dt = time.monotonic() - t0
        if self.stats.stall_s:
            self.stats.stall_s[-1] += dt
        return dt

    def wait(self) -> int | None:
        """Block until the in-flight save is committed; returns its step (None if idle)."""
        with self._lock:
            fl = self._inflight
        if fl is None:
            return None
        t0 = time.monotonic()
        fl.done.wait()
        self.stats.wait_s.append(time.monotonic() - t0)
        with self._lock:
            self._inflight = None
        if fl.error is not None:
            raise RuntimeError(f"checkpoint of step {fl.step} failed: {fl.error!r}") from fl.error
        return fl.step

    def close(self) -> None:
        """Wait for the in-flight save and release the staging buffers; idempotent."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._stager.close()

    def __enter__(self) -> AsyncCheckpointer:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _commit(tmp: Path, final: Path) -> None:
    if final.exists():  # the same step saved again (e.g. a session that trained 0 steps)
        trash = final.with_suffix(TRASH_SUFFIX)
        os.replace(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


PIN = "pinned"  # file under the root: one step per line that pruning must keep (being read)


def pin(root: str | Path, steps: Iterable[int]) -> None:
    """Keep ``steps`` out of pruning (replaces the pinned set; atomic). The driver pins the step it
    pushes to the replicas until every replica has read it."""
    root = Path(root)
    tmp = root / f".{PIN}.tmp"
    tmp.write_text("".join(f"{int(s)}\n" for s in steps))
    os.replace(tmp, root / PIN)


def pinned(root: str | Path) -> set[int]:
    path = Path(root) / PIN
    return {int(x) for x in path.read_text().split()} if path.is_file() else set()


def prune(root: str | Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints under ``root``, and never a
    pinned one (:func:`pin`)."""
    keep = pinned(root)
    for s in complete_steps(root)[:-keep_last]:
        if s in keep:
            continue
        path = step_dir(root, s)
        trash = path.with_suffix(TRASH_SUFFIX)
        os.replace(path, trash)  # atomic: a kill mid-delete leaves only trash behind
        shutil.rmtree(trash, ignore_errors=True)


def save_sync(root: str | Path, step: int, state: dict[str, Any], *,
              process_group: dist.ProcessGroup | None = None) -> float:
    """Blocking save with the same ``.tmp`` + rename commit; returns the seconds it blocked.

    The baseline the async path is measured against (the bench saves the full model this way).
    """
    t0 = time.monotonic()
    root = Path(root)
    final = step_dir(root, step)
    tmp = final.with_suffix(TMP_SUFFIX)
    coordinator = _is_coordinator(process_group)
    if coordinator:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    if not _no_dist():
        dist.barrier(group=process_group)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
             process_group=process_group, no_dist=_no_dist())
    if coordinator:
        _commit(tmp, final)
    return time.monotonic() - t0


def load(root: str | Path, state: dict[str, Any], *, step: int | None = None,
         process_group: dist.ProcessGroup | None = None, alone: bool = False) -> int | None:
    """Load checkpoint ``step`` (default: the latest complete one) into ``state`` in place.

    ``state`` is a DCP state dict; :class:`Stateful` values get ``load_state_dict`` called. The
    checkpoint may come from any world size (DCP reshards). ``alone``: this process reads it by
    itself, with no collective even while a training session's process group exists. Returns the
    step, or None if ``root`` holds no complete checkpoint.
    """
    step = latest(root) if step is None else step
    if step is None:
        return None
    path = step_dir(root, step)
    if not (path / ".metadata").is_file():
        raise ValueError(f"{path} is not a complete checkpoint; choose one of {complete_steps(root)}")
    try:
        dcp.load(state, checkpoint_id=path, process_group=process_group, no_dist=alone or _no_dist())
    except CheckpointException as e:  # a BaseException: no `except Exception` of a caller would see it
        raise unreadable(path, e) from e
    return step


def unreadable(path: Path, e: BaseException) -> ValueError:
    """DCP's CheckpointException (a BaseException, every rank's traceback in its text) as a
    ValueError naming the checkpoint, the cause (its last line) and the likely fix."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return ValueError(f"{path} could not be read into this drafter: {lines[-1] if lines else type(e).__name__}; "
                      "if the drafter's method, sizes or draft vocabulary changed since it was written, use "
                      "another checkpoint root")


def load_weights(root: str | Path, model: nn.Module, *, frozen: Iterable[torch.Tensor] = (),
                 step: int | None = None) -> int | None:
    """The model weights of training-state checkpoint ``step`` (default: the latest complete one)
    into an unsharded ``model`` in place, read by this process alone; DCP reads only the keys asked
    for: the weights, never the optimizer state. Returns the step, or None if ``root`` holds no
    complete checkpoint. ``frozen`` (the target tensors the model reads by reference) must not be
    among the model's own tensors."""
    step = latest(root) if step is None else step
    if step is None:
        return None
    msd = get_model_state_dict(model)
    _refuse_frozen(msd, [t for t in frozen if t is not None])
    load(root, {"train": {"model": msd}}, step=step, alone=True)  # the keys TrainState saved them under
    set_model_state_dict(model, msd)
    return step
