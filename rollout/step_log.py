"""The engine's step telemetry: each step's record, by absolute step number, in bounded memory.

Owns :class:`StepLog`: the :class:`~tlt.rollout.engine.StepRecord` of each step and the tokens each
request committed in it (speculative steps), kept from the oldest step its reader has not forgotten
(``forget``: ``generate()`` and the verl batcher, once per generation) and never more than ``cap``
(a caller that steps the engine itself and never forgets loses the oldest half at the cap).

Owner: the engine's thread; readers read between steps.
"""

from __future__ import annotations

from typing import Any


class StepLog:
    def __init__(self, cap: int = 65536) -> None:  # about 10 MB of records
        self.cap = cap
        self._records: list[Any] = []
        self._accept: list[list[int]] = []  # per kept step: committed tokens per request
        self._forgotten = 0  # steps before this one were dropped

    def append(self, record: Any, accepts: list[int]) -> None:
        self._records.append(record)
        self._accept.append(accepts)
        if len(self._records) > self.cap:
            self.forget(self.steps_run - self.cap // 2)

    @property
    def steps_run(self) -> int:
        """Steps logged so far (the absolute number of the next step)."""
        return self._forgotten + len(self._records)

    @property
    def kept(self) -> list[Any]:
        """The kept records, oldest first."""
        return self._records

    def since(self, first: int) -> list[Any]:
        """The records of steps ``first`` (an absolute step number) onward."""
        return self._records[self._index(first):]

    def accept_lengths_since(self, first: int) -> list[int]:
        """Committed tokens per request per speculative step, over the steps from ``first`` on."""
        return [a for acc in self._accept[self._index(first):] for a in acc]

    def forget(self, before: int) -> None:
        """Drop the records of steps before ``before`` (their reader is done with them)."""
        k = max(0, min(before - self._forgotten, len(self._records)))
        del self._records[:k], self._accept[:k]
        self._forgotten += k

    def _index(self, first: int) -> int:
        if first < self._forgotten:
            raise ValueError(f"steps before {self._forgotten} were forgotten (asked from {first}): read a "
                             "generation's steps before forgetting them")
        return first - self._forgotten
