"""DataBuffer: the target features the spot trainer learns from, cached in host memory.

Owns the samples (token ids, loss mask, target hidden states of one or several layers) tagged with
the RL step that produced them, kept in host memory (pinned on CUDA machines) under a byte budget;
their eviction; and one-step offset sampling into token-budget batches for packing. It lives as
long as its replica process and is not persisted: a restarted replica refills it from the next
rollout (evicted samples are dropped). Nothing in training clears it: sampling never
removes a sample (the reference implementation's "buffers cleared every session" trap).

Steps. The current step is the newest step given to ``add`` or ``advance``. The *previous* side is
the newest earlier step that still holds samples (normally ``current - 1``). Older steps stay while
the budget allows and are evicted first.

Eviction (while resident bytes exceed ``max_bytes``), ascending key ``(step, length, insertion)``:
oldest step first; within a step the shortest sequences first, so the previous step's long
sequences outlive its short ones; the current step only once nothing older is left. A sample larger
than the whole budget is rejected with a warning and ``add`` returns False (the rollout thread that
feeds the buffer must not crash).

Sampling (one-step offset): about ``prev_ratio`` of each batch's tokens come from the longest
``long_fraction`` of the previous step's samples, the rest from the current step's. Each side is a
seeded shuffle drawn without replacement; every pick goes to the side furthest below its token
target among those with a sample that still fits. A side that is empty (or cannot fit anything)
leaves the room to the other; a ratio of exactly 0 or 1 uses the other side only when the chosen
side has no samples at all. A sample longer than the budget is truncated to it (as
``pack_by_budget`` does) and only ever fills a batch alone.

Thread safety: one lock guards all state.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import logging
import math
import random
import threading
from collections.abc import Iterator

import torch

from tlt.drafter.packing import FeatureSample

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
DTYPES = tuple(sorted(_DTYPES))  # the storage dtypes: the one list tlt.buffer.dtype is checked against


@dataclasses.dataclass(frozen=True, kw_only=True)
class BufferConfig:
    max_bytes: int = 16 << 30  # resident sample bytes (ids + mask + hidden + aux)
    dtype: str = "bfloat16"  # storage dtype of hidden/aux: "bfloat16" | "float32"
    prev_ratio: float = 0.5  # fraction of each batch's tokens from the previous step
    long_fraction: float = 0.5  # previous-step samples eligible: this longest fraction (by count)
    pin_memory: bool | None = None  # None: pin only when torch.cuda.is_available()
    seed: int = 0

    def __post_init__(self) -> None:
        def bad(field: str, fix: str) -> None:
            raise ValueError(f"BufferConfig.{field}={getattr(self, field)!r}: {fix}")

        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes <= 0:
            bad("max_bytes", "use a positive int byte budget, e.g. 16 << 30")
        if self.dtype not in _DTYPES:
            bad("dtype", f"use one of {sorted(_DTYPES)}")
        if not 0.0 <= self.prev_ratio <= 1.0:
            bad("prev_ratio", "use a fraction in [0, 1] (0.5 = half the tokens from the previous step)")
        if not 0.0 < self.long_fraction <= 1.0:
            bad("long_fraction", "use a fraction in (0, 1] (1.0 = every previous-step sample)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


@dataclasses.dataclass(slots=True)
class _Entry:
    seq: int  # insertion order (tie-break for eviction)
    step: int
    sample: FeatureSample  # stored copy: ids long, mask bool, hidden/aux in the storage dtype
    nbytes: int

    @property
    def length(self) -> int:
        return len(self.sample)


class DataBuffer:
    """Thread-safe host-memory buffer of ``FeatureSample`` s keyed by RL step (see module doc)."""

    def __init__(self, cfg: BufferConfig) -> None:
        if cfg.pin_memory and not torch.cuda.is_available():
            raise ValueError("BufferConfig.pin_memory=True needs CUDA; leave it None (auto) on this machine")
        self.cfg = cfg
        self._pin = torch.cuda.is_available() if cfg.pin_memory is None else cfg.pin_memory
        self._lock = threading.Lock()
        self._steps: dict[int, dict[int, _Entry]] = {}  # step -> seq -> entry
        self._heap: list[tuple[int, int, int]] = []  # (step, length, seq) of every resident entry
        self._bytes = 0
        self._seq = 0
        self._current: int | None = None
        self._widths: tuple[int, int | None] | None = None  # (H, A*H or None), fixed by the first add
        self._rng = random.Random(cfg.seed)
        self._counts: collections.Counter[str] = collections.Counter()

    # ---------------------------------------------------------------- insertion and eviction
    def add(self, sample: FeatureSample, step: int) -> bool:
        """Store a host copy of ``sample`` for RL ``step``; False if it was rejected or evicted at once."""
        ids, mask, hidden, aux = sample.input_ids, sample.loss_mask, sample.hidden, sample.aux
        if ids.dim() != 1 or hidden.dim() != 2 or (aux is not None and aux.dim() != 2):
            raise ValueError("DataBuffer.add wants input_ids [n], hidden [n, H], aux [n, A*H] | None; got "
                             f"{tuple(ids.shape)}, {tuple(hidden.shape)}, {None if aux is None else tuple(aux.shape)}")
        widths = (int(hidden.shape[1]), None if aux is None else int(aux.shape[1]))
        dt = self.cfg.torch_dtype
        n = int(ids.shape[0])
        nbytes = n * (8 + 1) + (hidden.numel() + (0 if aux is None else aux.numel())) * dt.itemsize
        if nbytes > self.cfg.max_bytes:
            log.warning("DataBuffer: rejected a %d-token sample of %d bytes (> max_bytes %d)",
                        n, nbytes, self.cfg.max_bytes)
            with self._lock:
                self._counts["rejected"] += 1
            return False
        stored = FeatureSample(self._host(ids, torch.long), self._host(mask, torch.bool),
                               self._host(hidden, dt), None if aux is None else self._host(aux, dt))
        with self._lock:
            if self._widths is None:
                self._widths = widths
            elif widths != self._widths:
                raise ValueError(f"DataBuffer holds features of widths (hidden, aux) = {self._widths}; "
                                 f"got {widths}: one buffer per drafter feature layout")
            if self._current is None or step > self._current:
                self._current = step
            entry = _Entry(self._seq, step, stored, nbytes)
            self._seq += 1
            self._steps.setdefault(step, {})[entry.seq] = entry
            heapq.heappush(self._heap, (step, n, entry.seq))
            self._bytes += nbytes
            self._counts["added"] += 1
            evicted = self._evict_locked()
        return entry.seq not in evicted

    def _host(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous host copy the buffer owns (pinned when configured)."""
        t = t.detach()
        if self._pin:
            return torch.empty(t.shape, dtype=dtype, pin_memory=True).copy_(t)
        return t.to(device="cpu", dtype=dtype, copy=True).contiguous()

    def _evict_locked(self) -> set[int]:
        evicted: set[int] = set()
        while self._bytes > self.cfg.max_bytes:
            step, _, seq = heapq.heappop(self._heap)
            entry = self._steps[step].pop(seq)
            if not self._steps[step]:
                del self._steps[step]
            self._bytes -= entry.nbytes
            self._counts["evictions"] += 1
            self._counts["evicted_bytes"] += entry.nbytes
            evicted.add(seq)
        return evicted

    def advance(self, step: int) -> None:
        """Declare RL ``step`` current: the newest earlier step becomes the previous side."""
        with self._lock:
            if self._current is not None and step < self._current:
                raise ValueError(f"DataBuffer.advance({step}) goes back from current step {self._current}")
            self._current = step

    # ---------------------------------------------------------------- sampling
    def sample_batch(self, token_budget: int, *, seed: int | None = None,
                     dtype: torch.dtype | None = torch.float32) -> list[FeatureSample]:
        """One batch of at most ``token_budget`` tokens (one-step offset mix; see module doc).

        ``seed`` makes the draw independent of earlier calls; otherwise the buffer's own seeded
        generator advances. Features come back in ``dtype`` (None: the storage dtype, no copy);
        treat every returned tensor as read-only, it may be a view of the buffer's storage.
        """
        return self._sample(token_budget, random.Random(seed) if seed is not None else None, dtype)

    def batches(self, token_budget: int, n: int, *, seed: int | None = None,
                dtype: torch.dtype | None = torch.float32) -> Iterator[list[FeatureSample]]:
        """``n`` successive batches (deterministic as a sequence given ``seed``)."""
        rng = random.Random(seed) if seed is not None else None
        for _ in range(n):
            yield self._sample(token_budget, rng, dtype)

    def _sample(self, budget: int, rng: random.Random | None,
                dtype: torch.dtype | None) -> list[FeatureSample]:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise ValueError(f"token_budget must be a positive int, got {budget!r}")
        with self._lock:
            cur, prev = self._pools_locked()
            ratio = self.cfg.prev_ratio
            picks = _fill([cur, prev], [(1 - ratio) * budget, ratio * budget], budget, rng or self._rng)
            self._counts["truncated"] += sum(e.length > budget for e in picks)
        return [_read(e.sample, budget, dtype) for e in picks]

    def _pools_locked(self) -> tuple[list[_Entry], list[_Entry]]:
        """Current-step entries, and the longest ``long_fraction`` of the previous step's."""
        if self._current is None:
            return [], []
        cur = list(self._steps.get(self._current, {}).values())
        older = [s for s in self._steps if s < self._current]
        if not older:
            return cur, []
        prev = sorted(self._steps[max(older)].values(), key=lambda e: (-e.length, e.seq))
        return cur, prev[:max(1, math.ceil(self.cfg.long_fraction * len(prev)))]

    # ---------------------------------------------------------------- metrics
    def stats(self) -> dict:
        """Resident bytes/samples/tokens, per-step counts and tokens, and event counters."""
        with self._lock:
            steps = {s: {"samples": len(d), "tokens": sum(e.length for e in d.values()),
                         "bytes": sum(e.nbytes for e in d.values())} for s, d in sorted(self._steps.items())}
            return {"bytes": self._bytes, "max_bytes": self.cfg.max_bytes,
                    "samples": sum(v["samples"] for v in steps.values()),
                    "tokens": sum(v["tokens"] for v in steps.values()),
                    "current_step": self._current, "steps": steps,
                    **{k: self._counts[k] for k in ("added", "rejected", "evictions", "evicted_bytes",
                                                    "truncated")}}

    def __len__(self) -> int:
        with self._lock:
            return sum(len(d) for d in self._steps.values())

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    @property
    def current_step(self) -> int | None:
        with self._lock:
            return self._current


def _fill(pools: list[list[_Entry]], targets: list[float], budget: int,
          rng: random.Random) -> list[_Entry]:
    """Greedy token-deficit fill from shuffled pools; total tokens (truncated to budget) <= budget."""
    queues = [rng.sample(p, len(p)) for p in pools]
    pos, taken, room, out = [0] * len(pools), [0.0] * len(pools), budget, []

    def next_fit(i: int) -> _Entry | None:
        q = queues[i]
        while pos[i] < len(q):  # room only shrinks, so a sample skipped once never fits later
            e = q[pos[i]]
            pos[i] += 1
            if min(e.length, budget) <= room:
                return e
        return None

    while room > 0:
        order = sorted(range(len(pools)), key=lambda i: taken[i] - targets[i])
        for i in order:
            if targets[i] == 0 and any(pools[j] for j in range(len(pools)) if j != i):
                continue  # a side with no share is used only when every other side is empty
            e = next_fit(i)
            if e is not None:
                break
        else:
            break
        n = min(e.length, budget)
        out.append(e)
        taken[i] += n
        room -= n
    return out


def _read(s: FeatureSample, budget: int, dtype: torch.dtype | None) -> FeatureSample:
    ids, mask, hidden, aux = s.input_ids, s.loss_mask, s.hidden, s.aux
    if len(s) > budget:
        ids, mask, hidden = ids[:budget], mask[:budget], hidden[:budget]
        aux = None if aux is None else aux[:budget]
    if dtype is not None:
        hidden, aux = hidden.to(dtype), None if aux is None else aux.to(dtype)
    return FeatureSample(ids, mask, hidden, aux)


