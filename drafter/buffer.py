"""DataBuffer: the target features the spot trainer learns from, cached in host memory.

Owns the samples (token ids, loss mask, target hidden states of one or several layers) tagged with
the RL step that produced them, kept in host memory (pinned on CUDA machines) under a byte budget;
their eviction; one-step offset sampling into token-budget batches for packing; and the optional
spill to disk (safetensors shards) with reload. Nothing in training clears it: sampling never
removes a sample (the reference implementation's "buffers cleared every session" trap).

Steps. The current step is the newest step given to ``add`` or ``advance``. The *previous* side is
the newest earlier step that still holds samples (normally ``current - 1``). Older steps stay while
the budget allows and are evicted first.

Eviction (while resident bytes exceed ``max_bytes``), ascending key ``(step, length, insertion)``:
oldest step first; within a step the shortest sequences first, so the previous step's long
sequences outlive its short ones; the current step only once nothing older is left. A sample larger
than the whole budget is rejected with a warning and ``add`` returns False (the rollout thread that
feeds the buffer must not crash). With ``spill_evicted`` evicted samples go to ``evicted-*`` shards
(see ``read_evicted``) instead of being dropped; up to ``shard_bytes`` of them wait in memory.

Sampling (one-step offset): about ``prev_ratio`` of each batch's tokens come from the longest
``long_fraction`` of the previous step's samples, the rest from the current step's. Each side is a
seeded shuffle drawn without replacement; every pick goes to the side furthest below its token
target among those with a sample that still fits. A side that is empty (or cannot fit anything)
leaves the room to the other; a ratio of exactly 0 or 1 uses the other side only when the chosen
side has no samples at all. A sample longer than the budget is truncated to it (as
``pack_by_budget`` does) and only ever fills a batch alone.

Thread safety: one lock guards all state; disk writes happen outside it (under a spill lock).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import json
import logging
import math
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from drafter.packing import FeatureSample

log = logging.getLogger(__name__)

_SHARD_IDS = itertools.count()  # unique evicted-shard names within a process
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
MANIFEST = "manifest.json"
FORMAT = "tlt-databuffer/1"


@dataclasses.dataclass(frozen=True, kw_only=True)
class BufferConfig:
    max_bytes: int = 16 << 30  # resident sample bytes (ids + mask + hidden + aux)
    dtype: str = "bfloat16"  # storage dtype of hidden/aux: "bfloat16" | "float32"
    prev_ratio: float = 0.5  # fraction of each batch's tokens from the previous step
    long_fraction: float = 0.5  # previous-step samples eligible: this longest fraction (by count)
    spill_dir: str | os.PathLike | None = None
    spill_evicted: bool = False  # write evicted samples to spill_dir instead of dropping them
    shard_bytes: int = 256 << 20  # target size of one safetensors shard
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
        if isinstance(self.shard_bytes, bool) or not isinstance(self.shard_bytes, int) or self.shard_bytes <= 0:
            bad("shard_bytes", "use a positive int, e.g. 256 << 20")
        if self.spill_evicted and self.spill_dir is None:
            bad("spill_evicted", "set spill_dir too, or leave spill_evicted False to drop evicted samples")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


@dataclasses.dataclass(slots=True)
class _Entry:
    seq: int  # insertion order (tie-break for eviction, order of spill shards)
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
        self._spill_lock = threading.Lock()  # order: _spill_lock, then _lock; never the reverse
        self._steps: dict[int, dict[int, _Entry]] = {}  # step -> seq -> entry
        self._heap: list[tuple[int, int, int]] = []  # (step, length, seq) of every resident entry
        self._bytes = 0
        self._seq = 0
        self._current: int | None = None
        self._widths: tuple[int, int | None] | None = None  # (H, A*H or None), fixed by the first add
        self._rng = random.Random(cfg.seed)
        self._pending: list[_Entry] = []  # evicted, waiting to be spilled
        self._pending_bytes = 0
        self._counts: collections.Counter[str] = collections.Counter()

    # ---------------------------------------------------------------- insertion and eviction
    def add(self, sample: FeatureSample, step: int) -> bool:
        """Store a host copy of ``sample`` for RL ``step``; False if it was rejected or evicted at once."""
        return self._add(sample, step, spill=True)

    def _add(self, sample: FeatureSample, step: int, *, spill: bool, seq: int | None = None) -> bool:
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
            entry = _Entry(self._seq if seq is None else seq, step, stored, nbytes)
            self._seq = max(self._seq, entry.seq) + 1
            self._steps.setdefault(step, {})[entry.seq] = entry
            heapq.heappush(self._heap, (step, n, entry.seq))
            self._bytes += nbytes
            self._counts["added"] += 1
            evicted = self._evict_locked(spill and self.cfg.spill_evicted)
            flush = self._take_pending_locked(self.cfg.shard_bytes)
        if flush:
            self._write_evicted(flush, raise_errors=False)
        return entry.seq not in evicted

    def _host(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous host copy the buffer owns (pinned when configured)."""
        t = t.detach()
        if self._pin:
            return torch.empty(t.shape, dtype=dtype, pin_memory=True).copy_(t)
        return t.to(device="cpu", dtype=dtype, copy=True).contiguous()

    def _evict_locked(self, spill: bool) -> set[int]:
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
            if spill:
                self._pending.append(entry)
                self._pending_bytes += entry.nbytes
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
                    "current_step": self._current, "steps": steps, "pending_spill_bytes": self._pending_bytes,
                    **{k: self._counts[k] for k in ("added", "rejected", "evictions", "evicted_bytes",
                                                    "truncated", "spilled_evicted", "spill_errors")}}

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

    # ---------------------------------------------------------------- spill and reload
    def _spill_root(self) -> Path:
        if self.cfg.spill_dir is None:
            raise ValueError("BufferConfig.spill_dir is None: set it to spill the buffer to disk")
        root = Path(self.cfg.spill_dir)
        root.mkdir(parents=True, exist_ok=True)
        return root

    def spill(self) -> Path:
        """Write every resident sample to ``spill_dir`` (replacing the previous spill atomically).

        Shards are written under new names, then ``manifest.json`` is replaced (the commit point),
        then the previous spill's shards are removed; a failure leaves the previous spill intact.
        """
        root = self._spill_root()
        self.flush_evicted()
        with self._lock:
            entries = sorted((e for d in self._steps.values() for e in d.values()), key=lambda e: e.seq)
            current = self._current
        with self._spill_lock:
            old = _read_manifest(root)
            gen = old["generation"] + 1 if old else 0
            shards, written = [], []
            try:
                for k, group in enumerate(_shard_groups(entries, self.cfg.shard_bytes)):
                    path = root / f"buffer-{gen:06d}-{k:05d}.safetensors"
                    _write_shard(path, group)
                    written.append(path)
                    shards.append({"file": path.name, "steps": [e.step for e in group],
                                   "lengths": [e.length for e in group]})
                manifest = {"format": FORMAT, "generation": gen, "current_step": current,
                            "dtype": self.cfg.dtype, "samples": len(entries), "shards": shards}
                tmp = root / f".{MANIFEST}.tmp"
                tmp.write_text(json.dumps(manifest))
                os.replace(tmp, root / MANIFEST)
            except BaseException:
                for p in written:
                    p.unlink(missing_ok=True)
                raise
            keep = {s["file"] for s in shards}
            for p in root.glob("buffer-*.safetensors"):
                if p.name not in keep:
                    p.unlink(missing_ok=True)
        log.info("DataBuffer: spilled %d samples in %d shards to %s", len(entries), len(shards), root)
        return root

    @classmethod
    def load(cls, spill_dir: str | os.PathLike, cfg: BufferConfig) -> DataBuffer:
        """A buffer holding the last committed ``spill()`` of ``spill_dir`` (under ``cfg``'s budget)."""
        root = Path(spill_dir)
        manifest = _read_manifest(root)
        if manifest is None:
            raise FileNotFoundError(f"no {MANIFEST} in {root}: DataBuffer.spill() never completed there")
        buf = cls(cfg)
        for shard in manifest["shards"]:
            for rec, sample in _read_shard(root / shard["file"]):
                buf._add(sample, rec["step"], spill=False, seq=rec["seq"])
        if manifest["current_step"] is not None:
            with buf._lock:
                buf._current = max(manifest["current_step"], buf._current if buf._current is not None else -1)
        log.info("DataBuffer: loaded %d samples from %s", len(buf), root)
        return buf

    def _take_pending_locked(self, threshold: int) -> list[_Entry]:
        if not self._pending or self._pending_bytes < threshold:
            return []
        out, self._pending, self._pending_bytes = self._pending, [], 0
        return out

    def flush_evicted(self) -> None:
        """Write evicted samples still waiting in memory (``spill_evicted``) to a shard now."""
        with self._lock:
            flush = self._take_pending_locked(1)
        if flush:
            self._write_evicted(flush, raise_errors=True)

    def _write_evicted(self, entries: list[_Entry], *, raise_errors: bool) -> None:
        with self._spill_lock:
            root = self._spill_root()
            try:
                for group in _shard_groups(entries, self.cfg.shard_bytes):
                    name = f"evicted-{time.time_ns():020d}-{os.getpid()}-{next(_SHARD_IDS)}.safetensors"
                    _write_shard(root / name, group)
            except Exception:
                with self._lock:
                    self._counts["spill_errors"] += 1
                if raise_errors:
                    raise
                log.exception("DataBuffer: could not spill %d evicted samples; they are dropped", len(entries))
                return
            with self._lock:
                self._counts["spilled_evicted"] += len(entries)


def read_evicted(spill_dir: str | os.PathLike) -> Iterator[tuple[int, FeatureSample]]:
    """(step, sample) for every evicted sample spilled to ``spill_dir``, oldest shard first."""
    for path in sorted(Path(spill_dir).glob("evicted-*.safetensors")):
        for rec, sample in _read_shard(path):
            yield rec["step"], sample


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


def _shard_groups(entries: list[_Entry], shard_bytes: int) -> Iterator[list[_Entry]]:
    group, size = [], 0
    for e in entries:
        if group and size + e.nbytes > shard_bytes:
            yield group
            group, size = [], 0
        group.append(e)
        size += e.nbytes
    if group:
        yield group


def _write_shard(path: Path, entries: list[_Entry]) -> None:
    """One safetensors file: ``s{i}.input_ids|loss_mask|hidden|aux`` + per-sample records as metadata."""
    tensors, records = {}, []
    for i, e in enumerate(entries):
        s = e.sample
        tensors.update({f"s{i}.input_ids": s.input_ids, f"s{i}.loss_mask": s.loss_mask, f"s{i}.hidden": s.hidden})
        if s.aux is not None:
            tensors[f"s{i}.aux"] = s.aux
        records.append({"key": f"s{i}", "step": e.step, "length": e.length, "seq": e.seq})
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={"format": FORMAT, "samples": json.dumps(records)})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read_shard(path: Path) -> list[tuple[dict, FeatureSample]]:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not a DataBuffer shard (format {meta.get('format')!r}, want {FORMAT})")
        keys = set(f.keys())
        return [(r, FeatureSample(f.get_tensor(f"{r['key']}.input_ids"), f.get_tensor(f"{r['key']}.loss_mask"),
                                  f.get_tensor(f"{r['key']}.hidden"),
                                  f.get_tensor(f"{r['key']}.aux") if f"{r['key']}.aux" in keys else None))
                for r in json.loads(meta["samples"])]


def _read_manifest(root: Path) -> dict | None:
    path = root / MANIFEST
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a DataBuffer manifest (format {manifest.get('format')!r}, want {FORMAT})")
    return manifest
