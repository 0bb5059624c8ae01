"""TLT's state in verl's checkpoints, so that a resumed run drafts from its first step as it would have.

Owns the ``tlt/`` folder inside verl's ``global_step_N`` folder. The ``tlt`` trainer writes it at the
end of a step that verl checkpointed, after that step's drafter push, so it holds what step N + 1
would have served:

    state.json           the drafter pusher's record (version served, accepted and previous spot
                         steps, the guard's figures), the newest spot step then, and each
                         replica's tuner statistics
    spot/step-XXXXXXXX   the accepted and previous spot checkpoints (hard links where the file
                         system allows): the spot trainer may prune them before the run resumes
    history.jsonl        the draft history as of step N (the run directory's log goes on past N)

With tail batching, ``global_step_N/tlt_tail_batching.pt`` (beside ``tlt/``) holds the queue of
dropped prompts, the prompts fetched and not launched yet, and the epoch's position
(:mod:`.tail_batching`). It is written before verl's own checkpoint, so a checkpoint verl resumes
from always has it.

A resumed run reads it once its replicas hold the checkpoint's policy (verl's ``on_init_end``):
spot checkpoints the abandoned run wrote after it are set aside, the spot steps go back into the
spot root where they are missing, the history log is replaced and
replayed into every replica, every replica serves the accepted drafter under its version (the
pusher's read-back checks that each one does), and each replica's tuner takes its statistics back.
The folder is written to ``tlt.tmp`` and renamed, so it is whole or absent. A checkpoint without it
(written before this existed, or cut off between verl's files and this one) resumes with the newest
spot checkpoint and the whole history log, with a warning.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import ray
import torch

from tlt.drafter.checkpoint import complete_steps, latest, step_dir
from tlt.integrations.verl.drafter_push import DrafterPusher
from tlt.integrations.verl.history_log import read_history

log = logging.getLogger(__name__)

FOLDER = "tlt"
STATE = "state.json"
ROUNDS = "tlt_tail_batching.pt"  # beside tlt/, in global_step_N
ABANDONED = "abandoned"  # under the spot root: checkpoints an abandoned run wrote after the resumed-from one


@dataclasses.dataclass
class ResumePoint:
    """Where a run stands against verl's checkpoints (the trainer's driver thread owns it)."""

    checkpointed: int = -1  # the step verl saved last (its TLT state follows at the step's end)
    folder: Path | None = None  # verl's global_step_N folder this run resumed from
    restored: dict | None = None  # what the resume restored: the first step's record takes it
    rounds: dict | None = None  # tail batching's checkpointed state, until its driver is built

    def take_restored(self) -> dict | None:
        out, self.restored = self.restored, None
        return out


def save(step_folder: Path, pusher: DrafterPusher, servers: Callable[[], list], spot_root: str | None,
         history: Path | None) -> Path:
    """Write ``step_folder/tlt`` (whole or not at all); returns it."""
    final, tmp = Path(step_folder) / FOLDER, Path(step_folder) / f"{FOLDER}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    spot = [s for s in (pusher.accepted, pusher.previous) if s is not None]
    for s in spot:
        _link_tree(step_dir(spot_root, s), step_dir(tmp / "spot", s))
    if history is not None and history.is_file():
        shutil.copy2(history, tmp / "history.jsonl")
    tuners = ray.get([s.tuner_state.remote() for s in servers()], timeout=120)
    newest = latest(spot_root) if spot_root else None  # the spot trainer resumes from it
    (tmp / STATE).write_text(json.dumps({"pusher": pusher.state(), "spot_steps": spot, "spot_latest": newest,
                                         "tuners": tuners}))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    log.info("tlt: resume state in %s (drafter version %d, spot step %s)", final, pusher.version, pusher.accepted)
    return final


def restore(step_folder: Path, pusher: DrafterPusher, servers: Callable[[], list], spot_root: str | None,
            history: Path | None, add_history: Callable[[int, list], None]) -> dict:
    """Serve what ``step_folder/tlt`` holds on every replica; without it, the newest spot checkpoint
    and the whole history log (a warning). Returns what was restored (the first step's record)."""
    folder = Path(step_folder) / FOLDER
    if not (folder / STATE).is_file():
        log.warning("tlt: %s holds no TLT state (saved before it existed, or cut off): serving the newest spot "
                    "checkpoint and the whole draft history", step_folder)
        pusher.step_end(spot_root, [])
        replayed = _replay(history, add_history)
        return {"from_tlt_state": False, "version": pusher.version, "spot_step": pusher.accepted,
                "history": replayed}
    state = json.loads((folder / STATE).read_text())
    if spot_root:
        if "spot_latest" in state:
            set_aside_newer(spot_root, state["spot_latest"])
        have = set(complete_steps(spot_root))
        for s in state["spot_steps"]:
            if s not in have:
                _link_tree(step_dir(folder / "spot", s), step_dir(spot_root, s))
    if history is not None and (folder / "history.jsonl").is_file():
        shutil.copy2(folder / "history.jsonl", history)
    replayed = _replay(history, add_history)
    pusher.restore(state["pusher"])
    if spot_root and pusher.accepted is not None:
        pusher.serve_accepted(spot_root)
    servers_now = servers()
    tuners = state["tuners"]
    if len(tuners) != len(servers_now):
        log.warning("tlt: %d replicas now, %d at the checkpoint: tuners start afresh", len(servers_now), len(tuners))
        tuners = [None] * len(servers_now)
    loaded = ray.get([s.load_tuner_state.remote(t) for s, t in zip(servers_now, tuners)], timeout=120)
    log.info("tlt: resumed from %s: drafter version %d (spot step %s), %d history responses, tuners %s",
             folder, pusher.version, pusher.accepted, replayed, loaded)
    return {"from_tlt_state": True, "version": pusher.version, "spot_step": pusher.accepted, "history": replayed,
            "tuners": loaded}


def set_aside_newer(spot_root: str | Path, newest: int | None) -> list[int]:
    """Move the spot checkpoints past ``newest`` (the newest when the resumed-from checkpoint was
    saved: None, none yet) out of the spot trainer's sight, into ``ABANDONED/<time>/``: the abandoned
    run wrote them after that checkpoint, and the spot trainer resumes from the newest it sees, so
    the resumed run would train on, and push, a drafter it never had. Kept, not deleted. Returns
    the steps moved."""
    later = [s for s in complete_steps(spot_root) if newest is None or s > newest]
    if not later:
        return []
    dest = Path(spot_root) / ABANDONED / time.strftime("%Y%m%d-%H%M%S")
    dest.mkdir(parents=True, exist_ok=True)
    for s in later:
        os.replace(step_dir(spot_root, s), dest / step_dir(spot_root, s).name)
    log.warning("tlt: spot checkpoints %s were written after the checkpoint this run resumes from; moved to %s",
                later, dest)
    return later


def save_rounds(step_folder: Path, rounds: dict) -> Path:
    """Write tail batching's state into ``step_folder`` (whole or not at all). The trainer calls it
    before verl writes its checkpoint and the tracker file naming it, so a checkpoint a resume finds
    has it; a failure fails the checkpoint."""
    path, tmp = Path(step_folder) / ROUNDS, Path(step_folder) / f"{ROUNDS}.tmp"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(rounds, tmp)
    os.replace(tmp, path)
    return path


def load_rounds(step_folder: Path) -> dict | None:
    """Tail batching's state saved with ``step_folder``; None if there is none (a checkpoint of a
    run without tail batching)."""
    path = Path(step_folder) / ROUNDS
    if not path.is_file():
        return None
    return torch.load(path, weights_only=False)  # our own file: dataloader columns (numpy object arrays)


def _replay(history: Path | None, add_history: Callable[[int, list], None]) -> int:
    """Every step of the history log into every replica; returns the responses replayed."""
    if history is None or not history.is_file():
        return 0
    steps = read_history(history)
    for step, pairs in steps.items():
        add_history(step, pairs)
    return sum(len(p) for p in steps.values())


def _link_tree(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` with hard links where possible (checkpoints are never written in place)."""
    def link(s: str, d: str) -> None:
        try:
            os.link(s, d)
        except OSError:  # another file system, or links refused
            shutil.copy2(s, d)

    tmp = dst.with_name(dst.name + ".linking")  # not the spot trainer's own ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, copy_function=link)
    os.replace(tmp, dst)
