"""The draft history's record in the run directory, for a replica that restarts.

Owns :class:`HistoryLog`. The trainer is its only writer: after each RL step it appends the step's
(prompt, response) pairs, one JSON line each, and mirrors them into a
:class:`tlt.rollout.history.ResponseHistory` with the replicas' bounds. Once the file holds more than
twice what the history keeps, it is rewritten from the mirror (to a temporary file, then renamed),
so it stays bounded by the history's own bounds. A restarted replica reads it back
(:func:`read_history`) and adds the steps in order, which replays the same trimming rules: it gets
what it would have kept, had it not restarted (the mirror drops nothing a replica keeps), but for
the pool across prompts when ``history_visits`` is 0 (nothing is kept per prompt to rebuild it
from): that refills from the next step. A line cut
short by a crash mid-append is skipped with a warning.
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Sequence
from pathlib import Path

from tlt.rollout.history import HistoryConfig, ResponseHistory

log = logging.getLogger(__name__)

HISTORY_FILE = "tlt_history.jsonl"  # in the run directory


class HistoryLog:
    """Appends each step's pairs to ``path``; compacts it from a mirror of the history."""

    def __init__(self, path: Path, config: HistoryConfig) -> None:
        self.path, self.mirror, self.lines = Path(path), ResponseHistory(config), 0
        if self.path.is_file():  # a resumed run: what the replicas were given before stays
            for step, pairs in read_history(self.path).items():
                self.mirror.add(step, pairs)
                self.lines += len(pairs)

    def add(self, step: int, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
        self.mirror.add(step, pairs)
        if self.lines + len(pairs) > 2 * self.mirror.stats()["responses"]:
            kept = self.mirror.pairs()
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(_line(s, p, r) for s, p, r in kept))
            tmp.replace(self.path)  # atomic: a restarting replica reads a whole file
            self.lines = len(kept)
        else:
            with open(self.path, "a") as f:
                f.write("".join(_line(step, p, r) for p, r in pairs))
            self.lines += len(pairs)


def read_history(path: Path) -> dict[int, list[tuple[list[int], list[int]]]]:
    """The recorded pairs by step (steps ascending)."""
    by_step: dict[int, list] = collections.defaultdict(list)
    for i, line in enumerate(Path(path).read_text().splitlines()):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            log.warning("%s: line %d is cut short (a crash mid-append?); skipped", path, i + 1)
            continue
        by_step[rec["step"]].append((rec["prompt"], rec["response"]))
    return dict(sorted(by_step.items()))


def _line(step: int, prompt: Sequence[int], response: Sequence[int]) -> str:
    return json.dumps({"step": step, "prompt": list(prompt), "response": list(response)}) + "\n"
