"""The Triton kernels of :mod:`tlt.rollout.attention` (CUDA; on CPU under ``TRITON_INTERPRET=1``).

Owns :func:`paged_attention` (two launches per layer), :func:`tile_positions` (the tiles that
would spill registers get shorter ones) and :func:`tail_bits`, the tree mask in the form the kernel
reads: one bit per position.
1. ``_partials``: one program per (KV head, slot, tile of packed query rows). The packed rows of one
   KV head are its ``G`` query heads times the step's ``Q`` tokens (row ``m``: token ``m // G``,
   head ``m % G``), so K and V are read once per KV head, not once per query head. The first
   ``B * (splits + 1)`` slots are prefix parts: every part is one chunk of the batch's total prefix
   length over ``B * splits`` (rounded up to ``BLOCK_N``), so row ``b`` takes
   ``ceil(len_b / chunk)`` consecutive slots, read through the block table with no mask, and slots
   past the last row's exit at once; the last ``B`` slots are the rows' tails, under the tree mask
   (or causally). With one block per row (the static cache) a program looks its block up once, not
   per tile. Online softmax in base 2, fp32 accumulators; each program writes its part's output and
   log-sum-exp.
2. ``_merge``: per (row x KV head, tile), the row's parts merged exactly in one pass, a group of
   parts at a time (their loads in flight together: 8 parts of 16 packed rows, 4 of 32, 2 of 64, what
   fits the registers without spilling at head dim 128).

Bytes read follow the sum of the rows' lengths, and so does the work of each program: the launch
grid is sized by the batch and the split count only, so one captured graph serves every length,
and a batch of one 32K row and seven 1K rows spreads the 32K row over most of the programs.

One compile per tile shape, not per step shape: the batch, the query and tail lengths, the split
count and the strides that follow them are run-time arguments Triton does not specialize on, so a
new batch size, arm, prefill or catch-up length compiles nothing (a compile costs seconds on a GPU,
inside a tuner's timed rollout).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tlt.rollout.attention import AttnMeta, Tuning, tuning_for

LOG2E = 1.4426950408889634
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# What changes from step to step of one engine is not specialized on, and the rows' lengths are read
# in blocks of at least MIN_BP rows; what stays compile-time is fixed per cache and launch regime
# (head counts and size, block layout, tile shapes).
STEP_ARGS = ("QL", "W", "NB", "SPLITS", "st_b", "st_q", "sl_h", "sl_p", "sbt_b")
SMALL_TENSORS = ("BT", "START", "CTX", "TAIL")  # read a few values per program: alignment buys nothing
MIN_BP = 64


@triton.jit
def _tile(q, K, V, BT, TAIL, b, kvh, kb, vb, lo, limit, p0, t, m_ok, offs_d, is_tail, m_i, l_i, acc,
          sk_n, sk_h, sk_s, sv_n, sv_h, sv_s, sbt_b, st_b, st_q, scale2, scratch,
          QL, W, C: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          CAUSAL: tl.constexpr, PREC: tl.constexpr):
    """One tile of BLOCK_N positions lo + p0 .. of a part: the online-softmax update. ``kb``, ``vb``:
    the row's K and V at its one block (C == 1), read by position with no table lookup in the loop.
    ``TAIL``: the tree mask as bits (:func:`tail_bits`), a word per query and 32 tail positions."""
    offs_n = p0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < limit
    pos = lo + offs_n
    if C == 1:
        n_ok = n_ok & (pos < BS)  # (a position past the row's slots reads nothing)
        kp = kb + pos[:, None] * sk_s + offs_d[None, :]
        vp = vb + pos[:, None] * sv_s + offs_d[None, :]
    else:
        col = pos // BS
        blk = tl.load(BT + b * sbt_b + col, mask=n_ok & (col < C), other=scratch).to(tl.int64)
        # one tile of offsets for K and V (V laid out as K: paged_attention checks), not two
        row = blk * sk_n + (pos % BS) * sk_s  # [BLOCK_N]
        kp = (K + kvh * sk_h) + row[:, None] + offs_d[None, :]
        vp = (V + kvh * sk_h) + row[:, None] + offs_d[None, :]
    k = tl.load(kp, mask=n_ok[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale2  # [BLOCK_M, BLOCK_N], base 2
    vis = n_ok[None, :] & m_ok[:, None]
    if is_tail:
        qi = t + (W - QL)  # each query's tail index
        if CAUSAL:
            vis = vis & (offs_n[None, :] <= qi[:, None])
        else:
            # a word per query row, not a mask element per (row, position): a [BLOCK_M, BLOCK_N] tile of
            # pointers and loads would take registers from every program of the kernel, prefix parts too
            seen = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
            w0 = p0 // 32
            for i in tl.static_range((BLOCK_N + 31) // 32):
                word = tl.load(TAIL + b * st_b + t * st_q + w0 + i, mask=m_ok & (w0 + i < tl.cdiv(W, 32)), other=0)
                bit = (word[:, None] >> (offs_n % 32)[None, :]) & 1
                seen = tl.where((offs_n // 32 == w0 + i)[None, :], bit, seen)
            vis = vis & (seen != 0)
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(vp, mask=n_ok[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _layout(START, CTX, NB, SPLITS, BP: tl.constexpr, BLOCK_N: tl.constexpr):
    """The parts of every row's prefix: one chunk size for the whole batch (its total length over
    ``NB * SPLITS`` chunks, a multiple of BLOCK_N), so a row takes parts in proportion to its length
    and the work follows the sum of the lengths. -> (lengths [BP], chunk, parts per row [BP],
    cumulative parts [BP] inclusive)."""
    offs_b = tl.arange(0, BP)
    b_ok = offs_b < NB
    lens = tl.load(CTX + offs_b, mask=b_ok, other=0) - tl.load(START + offs_b, mask=b_ok, other=0)
    total = tl.sum(lens, 0)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(total, NB * SPLITS), BLOCK_N), 1) * BLOCK_N
    n = tl.cdiv(lens, chunk)
    return lens, chunk, n, tl.cumsum(n, 0)


@triton.jit(do_not_specialize=STEP_ARGS, do_not_specialize_on_alignment=SMALL_TENSORS)
def _partials(Q, K, V, BT, START, CTX, TAIL, OP, LP,
              sq_b, sq_h, sq_t, sk_n, sk_h, sk_s, sv_n, sv_h, sv_s, sbt_b, st_b, st_q,
              so_h, so_p, so_m, sl_h, sl_p,
              scale2, scratch, QL, W, NB, SPLITS,
              C: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, BP: tl.constexpr,
              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr):
    kvh = tl.program_id(0)
    j = tl.program_id(1)  # a slot: prefix parts 0 .. NB * (SPLITS + 1) - 1, then one tail per row
    mt = tl.program_id(2)
    prefix_slots = NB * (SPLITS + 1)  # >= the parts the rows take (each rounds up by less than one)
    is_tail = j >= prefix_slots
    lens, chunk, n, cum = _layout(START, CTX, NB, SPLITS, BP, BLOCK_N)
    offs_b = tl.arange(0, BP)
    b = tl.where(is_tail, j - prefix_slots, tl.sum((cum <= j).to(tl.int32), 0))  # this part's row
    if b < NB:  # (a prefix slot past every row's parts has nothing to do)
        first = tl.sum(tl.where(offs_b == b, cum - n, 0), 0)
        row_len = tl.sum(tl.where(offs_b == b, lens, 0), 0)
        offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)  # packed rows
        m_ok = offs_m < QL * G
        t = offs_m // G
        h = kvh * G + offs_m % G
        offs_d = tl.arange(0, D)
        q = tl.load(Q + b * sq_b + h[:, None] * sq_h + t[:, None] * sq_t + offs_d[None, :], mask=m_ok[:, None],
                    other=0.0)
        start = tl.load(START + b)
        ctx = tl.load(CTX + b)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        # a prefix part: chunk k of [start, ctx), no mask
        k0 = (j - first) * chunk
        p_len = tl.minimum(chunk, row_len - k0)
        # the tail: positions ctx + i, i < W, under the mask; causally, no query of this tile sees past
        # its last token's tail index
        t_len = ctx * 0 + W
        if CAUSAL:
            t_len = tl.minimum(t_len, tl.minimum((mt * BLOCK_M + BLOCK_M - 1) // G, QL - 1) + (W - QL) + 1)
        lo = tl.where(is_tail, ctx, start + k0)
        limit = tl.where(is_tail, t_len, p_len).to(tl.int32)
        blk = tl.load(BT + b * sbt_b).to(tl.int64)  # C == 1: the row's one block
        kb = K + blk * sk_n + kvh * sk_h
        vb = V + blk * sv_n + kvh * sv_h
        if INTERPRET:  # the interpreter cannot bound a for loop by a loaded value (numpy >= 2.4)
            p0 = 0
            while p0 < limit:
                m_i, l_i, acc = _tile(q, K, V, BT, TAIL, b, kvh, kb, vb, lo, limit, p0, t, m_ok, offs_d, is_tail,
                                      m_i, l_i, acc, sk_n, sk_h, sk_s, sv_n, sv_h, sv_s, sbt_b, st_b, st_q, scale2,
                                      scratch, QL, W, C, BS, BLOCK_M, BLOCK_N, CAUSAL, PREC)
                p0 += BLOCK_N
        else:
            for p0 in range(0, limit, BLOCK_N):
                m_i, l_i, acc = _tile(q, K, V, BT, TAIL, b, kvh, kb, vb, lo, limit, p0, t, m_ok, offs_d, is_tail,
                                      m_i, l_i, acc, sk_n, sk_h, sk_s, sv_n, sv_h, sv_s, sbt_b, st_b, st_q, scale2,
                                      scratch, QL, W, C, BS, BLOCK_M, BLOCK_N, CAUSAL, PREC)
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(OP + kvh * so_h + j * so_p + offs_m[:, None] * so_m + offs_d[None, :], out, mask=m_ok[:, None])
        tl.store(LP + kvh * sl_h + j * sl_p + offs_m, lse, mask=m_ok)


@triton.jit(do_not_specialize=STEP_ARGS, do_not_specialize_on_alignment=SMALL_TENSORS)
def _merge(OP, LP, O, START, CTX, so_h, so_p, so_m, sl_h, sl_p, sout_b, sout_h, sout_t, QL, NB, SPLITS,
           KVH: tl.constexpr, BP: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr,
           D: tl.constexpr, BLOCK_M: tl.constexpr, PG: tl.constexpr, INTERPRET: tl.constexpr):
    """Per (row x KV head, tile): the row's prefix parts and its tail, merged exactly in one pass
    (a running maximum of the log-sum-exps rescales what is summed so far)."""
    bh = tl.program_id(0)
    mt = tl.program_id(1)
    b = bh // KVH
    kvh = bh % KVH
    lens, chunk, n, cum = _layout(START, CTX, NB, SPLITS, BP, BLOCK_N)
    offs_b = tl.arange(0, BP)
    last = tl.sum(tl.where(offs_b == b, cum, 0), 0)
    first = last - tl.sum(tl.where(offs_b == b, n, 0), 0)
    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < QL * G
    offs_d = tl.arange(0, D)
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    num = tl.zeros([BLOCK_M, D], tl.float32)
    tail = NB * (SPLITS + 1) + b
    top, den, num = _merge_one(OP, LP, kvh, tail, tail + 1, offs_m, m_ok, offs_d, so_h, so_p, so_m, sl_h, sl_p,
                               top, den, num)  # the tail's part
    # PG parts per iteration, unrolled: their loads do not wait on the running state, so they are in
    # flight together (one part at a time, a merge of 34 parts waits 34 load latencies)
    if INTERPRET:
        p = first
        while p < last:
            for i in tl.static_range(PG):
                top, den, num = _merge_one(OP, LP, kvh, p + i, last, offs_m, m_ok, offs_d, so_h, so_p, so_m, sl_h,
                                           sl_p, top, den, num)
            p += PG
    else:
        for p in range(first, last, PG):
            for i in tl.static_range(PG):
                top, den, num = _merge_one(OP, LP, kvh, p + i, last, offs_m, m_ok, offs_d, so_h, so_p, so_m, sl_h,
                                           sl_p, top, den, num)
    out = num / tl.where(den > 0, den, 1.0)[:, None]
    t = offs_m // G
    h = kvh * G + offs_m % G
    tl.store(O + b * sout_b + h[:, None] * sout_h + t[:, None] * sout_t + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=m_ok[:, None])


@triton.jit
def _merge_one(OP, LP, kvh, p, end, offs_m, m_ok, offs_d, so_h, so_p, so_m, sl_h, sl_p, top, den, num):
    """Fold part ``p`` (none if ``p >= end``) into the running (maximum, denominator, numerator)."""
    m_ok = m_ok & (p < end)
    lse = tl.load(LP + kvh * sl_h + p * sl_p + offs_m, mask=m_ok, other=float("-inf"))
    new = tl.maximum(top, lse)
    safe = tl.where(new == float("-inf"), 0.0, new)  # nothing seen yet: every weight is 0
    scale = tl.exp2(top - safe)
    w = tl.exp2(lse - safe)
    o = tl.load(OP + kvh * so_h + p * so_p + offs_m[:, None] * so_m + offs_d[None, :], mask=m_ok[:, None], other=0.0)
    return new, den * scale + w, num * scale[:, None] + w[:, None] * o


def paged_attention(q: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor, meta: AttnMeta,
                    tuning: Tuning | None = None) -> torch.Tensor:
    """q [B, H, Q, D] over one layer's cache kl, vl [NB, KV, BS, D] -> [B, H, Q, D] (q's dtype)."""
    t = tuning or tuning_for(q.shape[0], kl.shape[1], q.device)
    b, h, ql, d = q.shape
    kvh = kl.shape[1]
    g = h // kvh
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kl.stride(-1) != 1 or vl.stride() != kl.stride():
        raise ValueError(f"the cache's K and V must share one layout with a contiguous head dimension "
                         f"(strides {kl.stride()}, {vl.stride()})")
    start, ctx = meta.start.contiguous(), meta.ctx.contiguous()  # [B] each, read as a whole by every program
    rows = ql * g
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    block_n = tile_positions(t, block_m, d, causal=meta.tail is None, paged=meta.blocks.shape[1] > 1)
    slots = b * (meta.splits + 1) + b  # prefix parts (at most b * (splits + 1)), then one tail per row
    bp = max(MIN_BP, triton.next_power_of_2(b))
    tail = meta.cached("tail_bits", lambda: tail_bits(meta.tail) if meta.tail is not None else None)
    op = torch.empty(kvh, slots, rows, d, dtype=torch.float32, device=q.device)
    lp = torch.empty(kvh, slots, rows, dtype=torch.float32, device=q.device)
    tails = (tail, tail.stride(0), tail.stride(1)) if tail is not None else (q, 0, 0)  # any pointer when causal
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    mtiles = triton.cdiv(rows, block_m)
    _partials[(kvh, slots, mtiles)](
        q, kl, vl, meta.blocks, start, ctx, tails[0], op, lp,
        q.stride(0), q.stride(1), q.stride(2), kl.stride(0), kl.stride(1), kl.stride(2),
        vl.stride(0), vl.stride(1), vl.stride(2), meta.blocks.stride(0), tails[1], tails[2],
        op.stride(0), op.stride(1), op.stride(2), lp.stride(0), lp.stride(1),
        LOG2E / d ** 0.5, meta.scratch, ql, meta.width, b, meta.splits,
        C=meta.blocks.shape[1], BS=meta.block_size, G=g, BP=bp, D=d, BLOCK_M=block_m,
        BLOCK_N=block_n, CAUSAL=meta.tail is None, PREC=prec, INTERPRET=INTERPRET, num_warps=t.warps,
        num_stages=t.stages)
    out = torch.empty_like(q)
    merge_warps = 4 if block_m <= 32 else 8
    group = max(1, 128 // block_m)
    _merge[(b * kvh, mtiles)](
        op, lp, out, start, ctx, op.stride(0), op.stride(1), op.stride(2), lp.stride(0), lp.stride(1),
        out.stride(0), out.stride(1), out.stride(2), ql, b, meta.splits, KVH=kvh, BP=bp, BLOCK_N=block_n,
        G=g, D=d, BLOCK_M=block_m, PG=group, INTERPRET=INTERPRET, num_warps=merge_warps)
    return out


def tile_positions(t: Tuning, block_m: int, d: int, causal: bool, paged: bool) -> int:
    """Positions per tile: the tuning's, but at most 32 past head dim 128, and at most 64 for the
    tiles that spill registers at 128 with head dim 128 (ptxas for sm_90: 64 packed rows, 255
    registers and 112 bytes a thread; 32 rows of a causal tail, as a drafter's catch-up of a few
    tokens, 20 bytes; 32 rows over a paged cache's blocks, 196 bytes; a masked 32-row tile over one
    block per row stays at 200 registers)."""
    if d > 128:
        return min(t.block_n, 32)
    if d == 128 and (block_m == 64 or (block_m == 32 and (causal or paged))):
        return min(t.block_n, 64)
    return t.block_n


def tail_bits(tail: torch.Tensor) -> torch.Tensor:
    """tail [B, Q, W] bool -> [B, Q, ceil(W / 32)] int32: bit ``j % 32`` of word ``j // 32`` is
    ``tail[b, i, j]`` (the bits are distinct, so their int32 sum is their OR, bit 31 included). Three
    small launches per step where W <= 32 (a shift by position, a sum), a padding copy above."""
    b, q, w = tail.shape
    words = -(-w // 32)
    if words > 1 and words * 32 != w:
        tail = torch.nn.functional.pad(tail, (0, words * 32 - w))
    n = tail.shape[-1] // words  # bits per word: 32, or W for one word
    shifts = torch.arange(n, dtype=torch.int32, device=tail.device)
    return (tail.reshape(b, q, words, n) << shifts).sum(-1, dtype=torch.int32)  # [B, Q, words]
