"""The drafter's checkpoint directory (torch.distributed.checkpoint) with crash-safe commits.

Owns the spot trainer's checkpoint directory layout, the selective training state, the blocking
save, loading (with resharding to another world size), pinning and pruning. The asynchronous save
that writes into it is :mod:`tlt.drafter.async_checkpoint`.

Layout: ``root/step-00000012/`` is a complete DCP checkpoint; a save is written to
``root/step-00000012.tmp/`` and renamed into place (then the root is fsynced) only after every
rank's shards and the ``.metadata`` are on disk. A process killed with SIGKILL at any point
therefore leaves at most a stale ``.tmp`` (ignored by :func:`latest`, removed by the next
:class:`~tlt.drafter.async_checkpoint.AsyncCheckpointer`), never a damaged complete checkpoint.
Old checkpoints are pruned by renaming to ``.trash`` before deletion; a pinned step is kept.

Selective state (:class:`TrainState`): the drafter's own state dict (trainable parameters plus its
small persistent buffers, e.g. the EAGLE-3 vocab maps) and the optimizer state, keyed by FQN via
``get_state_dict`` (FSDP2 DTensors are saved sharded), plus a few progress integers. The target's
embedding and LM head are shared by reference, are not parameters, and are checked not to appear.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful


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


def is_coordinator(pg: dist.ProcessGroup | None) -> bool:
    """Whether this rank writes the directory (renames, prunes): rank 0 of ``pg``, or the only process."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank(pg) == 0


def single_process() -> bool:
    """No process group: DCP runs without collectives."""
    return not (dist.is_available() and dist.is_initialized())


def commit(tmp: Path, final: Path) -> None:
    """Rename a written ``.tmp`` checkpoint into place (replacing the same step's), then fsync the root."""
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
    coordinator = is_coordinator(process_group)
    if coordinator:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    if not single_process():
        dist.barrier(group=process_group)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
             process_group=process_group, no_dist=single_process())
    if coordinator:
        commit(tmp, final)
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
        dcp.load(state, checkpoint_id=path, process_group=process_group, no_dist=alone or single_process())
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
