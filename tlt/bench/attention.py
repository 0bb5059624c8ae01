"""``tlt bench attention``: one layer's attention, alone, against the bound of reading K and V once.

Owns the attention bench. For each context length and batch it times one layer's decode (1 query
token), verify (a depth-4 chain: 5 tokens under their tree mask) and drafter-level (1 token after a
4-token tail) attention of the Llama-8B shape (32 query heads, 8 KV heads, head dim 128; bf16 on
CUDA, fp32 on CPU), with two kernels side by side on the same cache:
- ``engine``: :func:`tlt.rollout.attention.attend` (the Triton kernel on CUDA: each row reads its
  own length, the context split to fill the device);
- ``sdpa``: the engine before it, SDPA under an additive mask over the whole cache (the torch path
  with one split and no length hint).
Every step attends under its tree mask, as the engine's do (a plain step's is one position); each
row also times the kernel's causal variant over the same positions (``causal_ms``; at batch 1 a
5-token causal tail takes shorter tiles, as a drafter's catch-up does, and so does a paged verify).
The bound is the bytes of K and V the rows' real lengths hold, divided by the device's bandwidth
(nominal: 3.35 TB/s for an H100 SXM, 4.8 TB/s for an H200; measured: a device-to-device copy, in
the record too). ``--sweep`` times candidate launch shapes of the kernel
(:class:`~tlt.rollout.attention.Tuning`) at batch 1 and at batch 8 (the two regimes of
:class:`~tlt.rollout.attention.Tunings`) and records them, best first. A mixed-length row (lengths
1K to 32K in one batch, the cache sized for 32K) shows that time follows the sum of the real
lengths, and a paged row times the verify over scattered 16-position blocks. On CUDA each time is
the median over replays of a CUDA graph of 20 calls (launch overhead out), else of eager calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import platform
import statistics
import time

import torch

from tlt.rollout.attention import TUNINGS, AttnMeta, Tuning, attend, default_splits

log = logging.getLogger(__name__)

NOMINAL_TBS = {"H100": 3.35, "H200": 4.8}  # HBM bandwidth, TB/s (vendor datasheets, SXM)
SHAPE = {"heads": 32, "kv_heads": 8, "head_dim": 128}
MIXED = (1024, 2048, 4096, 8192, 16384, 32768, 1024, 2048)  # one batch of mixed lengths


def _bandwidth(dev: torch.device) -> tuple[float | None, float]:
    """(nominal TB/s or None, measured TB/s: read + write of a device-to-device copy)."""
    nominal = None
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        nominal = next((v for k, v in NOMINAL_TBS.items() if k in name), None)
    n = (1 << 28) if dev.type == "cuda" else (1 << 24)  # bytes per buffer
    a, b = torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8, device=dev)
    times = []
    for _ in range(10):
        t = _clock(dev, lambda: b.copy_(a))
        times.append(t)
    return nominal, 2 * n / statistics.median(times[2:]) / 1e12


def _clock(dev: torch.device, fn) -> float:
    if dev.type == "cuda":
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_call(dev: torch.device, fn, repeats: int) -> float:
    """Median seconds of one ``fn()``: on CUDA a graph of 20 calls replayed ``repeats`` times."""
    fn()  # compile, warm up
    if dev.type != "cuda":
        return statistics.median(_clock(dev, fn) for _ in range(repeats))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            fn()
    g.replay()
    return statistics.median(_clock(dev, g.replay) for _ in range(repeats)) / 20


SWEEP = (Tuning(block_n=64, stages=3, warps=4, programs_per_sm=2), Tuning(block_n=64, stages=4, warps=4, programs_per_sm=2),
         Tuning(block_n=64, stages=3, warps=4, programs_per_sm=4), Tuning(block_n=128, stages=2, warps=4, programs_per_sm=2),
         Tuning(block_n=128, stages=3, warps=4, programs_per_sm=1), Tuning(block_n=128, stages=2, warps=8, programs_per_sm=2),
         Tuning(block_n=32, stages=4, warps=4, programs_per_sm=4),
         # the parts in whole waves: batch 1's at one program per multiprocessor (shared memory holds no
         # more at 128-position tiles in 3 stages); batch 8's at 3 (what the verify's registers allow)
         Tuning(block_n=128, stages=3, warps=4, programs_per_sm=1, whole_waves=True),
         Tuning(block_n=64, stages=2, warps=4, programs_per_sm=3, whole_waves=True))
PAGED_BLOCK = 16  # the paged rows' block size (tlt.rollout.blocks)


def chain_tail(b: int, q: int, w: int, dev: torch.device) -> torch.Tensor:
    """[B, Q, W] bool: a chain's tree mask over a tail of ``w`` whose last ``q`` are the queries (each
    sees the tail up to itself: the positions a causal tail shows)."""
    return torch.ones(w, w, dtype=torch.bool, device=dev).tril()[w - q:].expand(b, q, w)


def case(dev: torch.device, dtype: torch.dtype, lengths: list[int], q: int, w: int, slots: int, kernel: str,
         repeats: int, seed: int, tuning: Tuning | None = None, block: int | None = None,
         masked: bool = True) -> float:
    """Seconds of one attention call: rows of ``lengths`` cached tokens (prefix), a tail of ``w`` with
    the last ``q`` as queries, a cache of ``slots`` per row (``tuning``: the Triton kernel's;
    ``block``: a paged cache of blocks this size, each row's blocks scattered over the pool).
    ``masked``: the tail under a chain's tree mask, as the engine's steps attend (``False``: causal,
    the kernel's other variant; the same positions seen)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    b, h, kvh, d = len(lengths), SHAPE["heads"], SHAPE["kv_heads"], SHAPE["head_dim"]
    qs = torch.randn(b, h, q, d, generator=g, device=dev, dtype=dtype)
    ctx = torch.tensor(lengths, device=dev)
    splits = default_splits(b, kvh, slots, dev, kernel, tuning, d)
    tail = chain_tail(b, q, w, dev) if masked else None
    if block is None:
        kl = torch.randn(b, kvh, slots, d, generator=g, device=dev, dtype=dtype)
        vl = torch.randn(b, kvh, slots, d, generator=g, device=dev, dtype=dtype)
        meta = AttnMeta.rows(ctx, w, slots, tail=tail, splits=splits, kernel=kernel)
    else:
        cols = -(-slots // block)
        kl = torch.randn(b * cols + 1, kvh, block, d, generator=g, device=dev, dtype=dtype)  # (the last: scratch)
        vl = torch.randn(b * cols + 1, kvh, block, d, generator=g, device=dev, dtype=dtype)
        blocks = torch.randperm(b * cols, generator=g, device=dev).to(torch.int32).view(b, cols)
        meta = AttnMeta(blocks, block, torch.zeros_like(ctx), ctx, w, tail, splits=splits, scratch=b * cols, kernel=kernel)
    if tuning is not None:
        from tlt.rollout.attention_triton import paged_attention

        return time_call(dev, lambda: paged_attention(qs, kl, vl, meta, tuning), repeats)
    return time_call(dev, lambda: attend(qs, kl, vl, meta), repeats)


def sweep(dev: torch.device, dtype: torch.dtype, kv_bytes: int, tbs: float, repeats: int, seed: int) -> dict:
    """The kernel's launch shapes on decode and verify, scored apart for the two regimes of
    :class:`~tlt.rollout.attention.Tunings`: ``few`` at batch 1, ``many`` at batch 8, each at 30,000
    and 15,000 tokens; each candidate's time over the bound, summed per regime; the best first. (Not
    at a power of two: there the rounding of a part to whole tiles can hide how a split rounds, as a
    batch-1 row of 32,768 tokens asking for 17 parts gets 16 of 2,048, and of 30,000 gets 17.)"""
    regimes = {"few": ((30000, 1), (15000, 1)), "many": ((30000, 8), (15000, 8))}
    seen = {}
    for t in (TUNINGS.few, TUNINGS.many, *SWEEP):
        if t in seen:
            continue
        cells = {}
        for name, shapes in regimes.items():
            for ctx, b in shapes:
                for kind, q in (("decode", 1), ("verify", 5)):
                    s = case(dev, dtype, [ctx] * b, q, q, ctx + 64, "auto", repeats, seed, t)
                    cells[f"{kind} {ctx}x{b}"] = s / (b * (ctx + q) * kv_bytes / (tbs * 1e12))
        seen[t] = cells
        log.info("%s: %s", t, cells)
    out = {}
    for name, shapes in regimes.items():
        keys = [f"{kind} {ctx}x{b}" for ctx, b in shapes for kind in ("decode", "verify")]
        rows = [{"tuning": dataclasses.asdict(t), "over_bound": {k: c[k] for k in keys},
                 "score": sum(c[k] for k in keys)} for t, c in seen.items()]
        out[name] = sorted(rows, key=lambda r: r["score"])
    return {**out, "default": TUNINGS.as_dict()}


def run(args: argparse.Namespace) -> dict:
    quick = bool(args.quick)
    cuda = torch.cuda.is_available()
    dev, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    contexts = (256, 1024) if quick or not cuda else (8192, 16384, 32768)
    batches = getattr(args, "batches", None) or ((1, 2) if quick or not cuda else (1, 8))
    repeats = 3 if quick else (args.repeats or 20)
    nominal, measured = _bandwidth(dev)
    tbs = nominal or measured
    kv_bytes = 2 * SHAPE["kv_heads"] * SHAPE["head_dim"] * torch.finfo(dtype).bits // 8  # K + V per token
    kinds = {"decode": (1, 1), "verify": (5, 5), "draft level": (1, 5)}
    rows, lines = [], []
    for ctx in contexts:
        for b in batches:
            for kind, (q, w) in kinds.items():
                bound = b * (ctx + w) * kv_bytes / (tbs * 1e12)
                t = {k: case(dev, dtype, [ctx] * b, q, w, ctx + 64, k, repeats, args.seed) for k in ("auto", "torch")}
                causal = case(dev, dtype, [ctx] * b, q, w, ctx + 64, "auto", repeats, args.seed, masked=False)
                rows.append({"context": ctx, "batch": b, "kind": kind, "engine_ms": 1e3 * t["auto"],
                             "causal_ms": 1e3 * causal, "sdpa_ms": 1e3 * t["torch"], "bound_ms": 1e3 * bound})
                lines.append(f"  {ctx:6d} x {b}: {kind:11s} engine {1e3 * t['auto']:.3f} ms ({t['auto'] / bound:.1f}x the "
                             f"bound; causal {1e3 * causal:.3f} ms), SDPA over the cache {1e3 * t['torch']:.3f} ms "
                             f"({t['torch'] / bound:.1f}x); bound {1e3 * bound:.3f} ms")
    paged = []  # the paged layout (the memory issue's): the same verify over blocks of PAGED_BLOCK, scattered
    for b in batches:
        ctx = max(contexts)
        bound = b * (ctx + 5) * kv_bytes / (tbs * 1e12)
        t = case(dev, dtype, [ctx] * b, 5, 5, ctx + 64, "auto", repeats, args.seed, block=PAGED_BLOCK)
        paged.append({"context": ctx, "batch": b, "kind": "verify", "block_size": PAGED_BLOCK,
                      "engine_ms": 1e3 * t, "bound_ms": 1e3 * bound})
        lines.append(f"  {ctx:6d} x {b}: verify, paged (blocks of {PAGED_BLOCK}) {1e3 * t:.3f} ms "
                     f"({t / bound:.1f}x the bound)")
    mixed = None
    if not quick and cuda:
        lens = list(MIXED)
        slots = max(lens) + 64
        t_mixed = case(dev, dtype, lens, 5, 5, slots, "auto", repeats, args.seed)
        t_full = case(dev, dtype, [max(lens)] * len(lens), 5, 5, slots, "auto", repeats, args.seed)
        bound = sum(n + 5 for n in lens) * kv_bytes / (tbs * 1e12)
        mixed = {"lengths": lens, "verify_ms": 1e3 * t_mixed, "bound_ms": 1e3 * bound,
                 "all_at_max_ms": 1e3 * t_full, "sum_over_max": sum(lens) / (len(lens) * max(lens))}
        lines.append(f"  mixed lengths {lens[0]}..{max(lens)} (sum {sum(lens)}): verify {1e3 * t_mixed:.3f} ms "
                     f"({t_mixed / bound:.1f}x the bound of its real lengths); every row at {max(lens)}: "
                     f"{1e3 * t_full:.3f} ms; time ratio {t_mixed / t_full:.2f} vs length ratio "
                     f"{mixed['sum_over_max']:.2f}")
    swept = None
    if getattr(args, "sweep", False) and cuda:
        swept = sweep(dev, dtype, kv_bytes, tbs, repeats, args.seed)
        for name in ("few", "many"):
            for r in swept[name]:
                lines.append(f"  {name}: tuning {r['tuning']}: sum over the bound {r['score']:.1f} ("
                             + ", ".join(f"{k} {v:.1f}x" for k, v in r["over_bound"].items()) + ")")
    where = torch.cuda.get_device_name() if cuda else platform.processor() or "CPU"
    head = (f"attention, one layer (32 heads, 8 KV heads, d128, {dtype}) on {where}: median of {repeats}; bound = "
            f"K and V of the rows' real lengths at {tbs:.2f} TB/s ({'nominal' if nominal else 'measured'}; a copy "
            f"measured {measured:.2f} TB/s)")
    return {"bench": "attention", "quick": quick, "dtype": str(dtype), "device": where, "shape": SHAPE,
            "bandwidth_tbs": {"nominal": nominal, "measured_copy": measured, "used": tbs}, "rows": rows,
            "paged": paged, "mixed": mixed, "tuning": TUNINGS.as_dict(), "sweep": swept, "machine": {"python": platform.python_version(), "torch": torch.__version__},
            "summary": [head, *lines]}
