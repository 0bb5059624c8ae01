"""The spot trainer's asynchronous checkpoint save: a state machine over DCP's ``async_save``.

Owns the in-flight save, its staging buffers and what it cost the training loop. It writes into
the directory :mod:`tlt.drafter.checkpoint` lays out, with that module's ``.tmp`` + rename commit.

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
import shutil
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful

from tlt.drafter.checkpoint import (
    TMP_SUFFIX,
    TRASH_SUFFIX,
    commit,
    is_coordinator,
    prune,
    single_process,
    state_nbytes,
    step_dir,
)

log = logging.getLogger(__name__)


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
        self.coordinator = is_coordinator(process_group)
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
        if not single_process():
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
                              async_stager=self._stager, no_dist=single_process())
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
                commit(fl.tmp, step_dir(self.root, fl.step))
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
