"""The ``tlt`` trainer's records in the run directory, and the failures the run went on after.

Owns three files: the first two beside each other (``tlt.record_path``, default
``<default_local_dir>/tlt_steps.jsonl``), the third in the run directory (``default_local_dir``),
where a restarted replica reads it:

    tlt_steps.jsonl      one JSON line per RL step: TLT's metrics and the step's extra fields
                         (``tlt report`` plots them)
    tlt_responses.jsonl  one line per response: step, prompt index, sample index, length, token hash
    tlt_history.jsonl    the draft history (:class:`~.history_log.HistoryLog`), for a replica that restarts

and the count of failures the run went on after, by what failed (:func:`counted`). Paths are fixed at
construction; nothing is written before the first step's record. Owner: the trainer's driver thread.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
from pathlib import Path

from tlt.integrations.verl.history_log import HISTORY_FILE, HistoryLog
from tlt.rollout.history import HistoryConfig

log = logging.getLogger(__name__)


class RunRecords:
    def __init__(self, steps_path: Path, run_dir: Path | None = None) -> None:
        self.steps_path = Path(steps_path)
        self.responses_path = self.steps_path.with_name("tlt_responses.jsonl")
        self.history_path = (Path(run_dir) if run_dir is not None else self.steps_path.parent) / HISTORY_FILE
        self.failures: collections.Counter = collections.Counter()  # swallowed failures, by what failed
        self._history: HistoryLog | None = None  # opened at the first step with a draft history

    def write_step(self, record: dict) -> None:
        self.steps_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.steps_path, "a") as f:
            f.write(json.dumps(record, default=float) + "\n")

    def write_responses(self, keys: list[str], responses: list[list[int]], step: int,
                        uid_index: dict[str, int]) -> None:
        """One line per response; ``keys`` are verl's ``{uid}_{sample}_{output}``, ``uid_index``
        maps a prompt uid to its dataset index (-1 when unknown)."""
        with open(self.responses_path, "a") as f:
            for key, toks in zip(keys, responses):
                uid, sample, _ = key.rsplit("_", 2)
                f.write(json.dumps({"step": step, "index": uid_index.get(uid, -1), "sample": int(sample),
                                    "length": len(toks),
                                    "sha1": hashlib.sha1(json.dumps(toks).encode()).hexdigest()}) + "\n")

    def log_history(self, step: int, pairs: list, config: HistoryConfig) -> None:
        """Append the step's (prompt, response) pairs to the draft history's log."""
        if self._history is None:
            self._history = HistoryLog(self.history_path, config)
        self._history.add(step, pairs)

    def counted(self, what: str, fn, *args):
        """``fn(*args)``, a failure counted under ``what`` (see :func:`counted`)."""
        return counted(self.failures, what, fn, *args)


def counted(failures: collections.Counter, what: str, fn, *args):
    """``fn(*args)``; a failure is logged and counted under ``what`` (the run goes on), and gives None."""
    try:
        return fn(*args)
    except Exception:
        failures[what] += 1
        log.exception("tlt: %s failed (%d so far this run); the run goes on", what, failures[what])
        return None
