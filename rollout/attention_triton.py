"""The Triton kernels of :mod:`tlt.rollout.attention` (CUDA; on CPU under ``TRITON_INTERPRET=1``).

Owns :func:`paged_attention`: two launches per layer.
1. ``_partials``: one program per (row x KV head, part, tile of packed query rows). The packed rows
   of one KV head are its ``G`` query heads times the step's ``Q`` tokens (row ``m``: token
   ``m // G``, head ``m % G``), so K and V are read once per KV head, not once per query head.
   Parts ``0 .. splits-1`` each take one chunk of the row's prefix ``[start, ctx)`` (its own
   length's share, rounded up to ``BLOCK_N``: a short row's chunks are short, an empty one exits
   after one compare), read through the block table with no mask; part ``splits`` takes the tail
   under the tree mask (or causally). Online softmax in base 2, fp32 accumulators; each program
   writes its part's output and log-sum-exp.
2. ``_merge``: per (row x KV head, tile), the exact log-sum-exp merge of the parts.

Bytes read per row follow ``ctx - start``: the launch grid is sized by the batch and the split
count only, so one captured graph serves every length. The query and tail lengths are run-time
arguments, so a new prefill or catch-up length compiles nothing.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tlt.rollout.attention import TUNING, AttnMeta, Tuning

LOG2E = 1.4426950408889634
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _tile(q, K, V, BT, TAIL, b, kvh, lo, limit, p0, t, m_ok, offs_d, is_tail, m_i, l_i, acc,
          sk_n, sk_h, sk_s, sv_n, sv_h, sv_s, sbt_b, st_b, st_q, scale2, scratch,
          QL, W, C: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
          PREC: tl.constexpr):
    """One tile of BLOCK_N positions lo + p0 .. of a part: the online-softmax update."""
    offs_n = p0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < limit
    pos = lo + offs_n
    col = pos // BS
    blk = tl.load(BT + b * sbt_b + col, mask=n_ok & (col < C), other=scratch).to(tl.int64)
    off = pos % BS
    k = tl.load(K + blk[:, None] * sk_n + kvh * sk_h + off[:, None] * sk_s + offs_d[None, :], mask=n_ok[:, None],
                other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale2  # [BLOCK_M, BLOCK_N], base 2
    vis = n_ok[None, :] & m_ok[:, None]
    if is_tail:
        qi = t + (W - QL)  # each query's tail index
        if CAUSAL:
            vis = vis & (offs_n[None, :] <= qi[:, None])
        else:
            tm = tl.load(TAIL + b * st_b + t[:, None] * st_q + offs_n[None, :], mask=vis, other=0)
            vis = vis & (tm != 0)
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + blk[:, None] * sv_n + kvh * sv_h + off[:, None] * sv_s + offs_d[None, :], mask=n_ok[:, None],
                other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _partials(Q, K, V, BT, START, CTX, TAIL, OP, LP,
              sq_b, sq_h, sq_t, sk_n, sk_h, sk_s, sv_n, sv_h, sv_s, sbt_b, st_b, st_q,
              so_b, so_h, so_p, so_m, sl_b, sl_h, sl_p,
              scale2, scratch, QL, W,
              KVH: tl.constexpr, C: tl.constexpr, BS: tl.constexpr, G: tl.constexpr,
              SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr):
    bh = tl.program_id(0)
    part = tl.program_id(1)
    mt = tl.program_id(2)
    b = bh // KVH
    kvh = bh % KVH
    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)  # packed rows
    m_ok = offs_m < QL * G
    t = offs_m // G
    h = kvh * G + offs_m % G
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b * sq_b + h[:, None] * sq_h + t[:, None] * sq_t + offs_d[None, :], mask=m_ok[:, None], other=0.0)
    start = tl.load(START + b)
    ctx = tl.load(CTX + b)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    is_tail = part == SPLITS
    # a prefix chunk (part < SPLITS): its share of [start, ctx), no mask
    chunk = tl.cdiv(tl.cdiv(ctx - start, SPLITS), BLOCK_N) * BLOCK_N
    p_lo = start + part * chunk
    p_len = tl.minimum(p_lo + chunk, ctx) - p_lo
    # the tail (part == SPLITS): positions ctx + j, j < W, under the mask; causally, no query of this
    # tile sees past its last token's tail index
    t_len = ctx * 0 + W
    if CAUSAL:
        t_len = tl.minimum(t_len, tl.minimum((mt * BLOCK_M + BLOCK_M - 1) // G, QL - 1) + (W - QL) + 1)
    lo = tl.where(is_tail, ctx, p_lo)
    limit = tl.where(is_tail, t_len, p_len).to(tl.int32)
    if INTERPRET:  # the interpreter cannot bound a for loop by a loaded value (numpy >= 2.4)
        p0 = 0
        while p0 < limit:
            m_i, l_i, acc = _tile(q, K, V, BT, TAIL, b, kvh, lo, limit, p0, t, m_ok, offs_d, is_tail, m_i, l_i, acc,
                                  sk_n, sk_h, sk_s, sv_n, sv_h, sv_s, sbt_b, st_b, st_q, scale2, scratch,
                                  QL, W, C, BS, BLOCK_N, CAUSAL, PREC)
            p0 += BLOCK_N
    else:
        for p0 in range(0, limit, BLOCK_N):
            m_i, l_i, acc = _tile(q, K, V, BT, TAIL, b, kvh, lo, limit, p0, t, m_ok, offs_d, is_tail, m_i, l_i, acc,
                                  sk_n, sk_h, sk_s, sv_n, sv_h, sv_s, sbt_b, st_b, st_q, scale2, scratch,
                                  QL, W, C, BS, BLOCK_N, CAUSAL, PREC)
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(OP + b * so_b + kvh * so_h + part * so_p + offs_m[:, None] * so_m + offs_d[None, :], out,
             mask=m_ok[:, None])
    tl.store(LP + b * sl_b + kvh * sl_h + part * sl_p + offs_m, lse, mask=m_ok)


@triton.jit
def _merge(OP, LP, O, so_b, so_h, so_p, so_m, sl_b, sl_h, sl_p, sout_b, sout_h, sout_t, QL,
           KVH: tl.constexpr, PARTS: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr):
    bh = tl.program_id(0)
    mt = tl.program_id(1)
    b = bh // KVH
    kvh = bh % KVH
    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < QL * G
    offs_d = tl.arange(0, D)
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for p in range(PARTS):
        top = tl.maximum(top, tl.load(LP + b * sl_b + kvh * sl_h + p * sl_p + offs_m, mask=m_ok, other=float("-inf")))
    top = tl.where(top == float("-inf"), 0.0, top)
    num = tl.zeros([BLOCK_M, D], tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    for p in range(PARTS):
        w = tl.exp2(tl.load(LP + b * sl_b + kvh * sl_h + p * sl_p + offs_m, mask=m_ok, other=float("-inf")) - top)
        o = tl.load(OP + b * so_b + kvh * so_h + p * so_p + offs_m[:, None] * so_m + offs_d[None, :],
                    mask=m_ok[:, None], other=0.0)
        num += w[:, None] * o
        den += w
    out = num / tl.where(den > 0, den, 1.0)[:, None]
    t = offs_m // G
    h = kvh * G + offs_m % G
    tl.store(O + b * sout_b + h[:, None] * sout_h + t[:, None] * sout_t + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=m_ok[:, None])


def paged_attention(q: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor, meta: AttnMeta,
                    tuning: Tuning | None = None) -> torch.Tensor:
    """q [B, H, Q, D] over one layer's cache kl, vl [NB, KV, BS, D] -> [B, H, Q, D] (q's dtype)."""
    t = tuning or TUNING
    b, h, ql, d = q.shape
    kvh = kl.shape[1]
    g = h // kvh
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kl.stride(-1) != 1 or vl.stride(-1) != 1:
        raise ValueError("the cache's head dimension must be contiguous")
    rows = ql * g
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    block_n = t.block_n if d <= 128 else min(t.block_n, 32)
    parts = meta.splits + 1
    tail = meta.cached("tail_i8", lambda: meta.tail.to(torch.int8) if meta.tail is not None else None)
    op = torch.empty(b, kvh, parts, rows, d, dtype=torch.float32, device=q.device)
    lp = torch.empty(b, kvh, parts, rows, dtype=torch.float32, device=q.device)
    tails = (tail, tail.stride(0), tail.stride(1)) if tail is not None else (q, 0, 0)  # any pointer when causal
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (b * kvh, parts, triton.cdiv(rows, block_m))
    _partials[grid](q, kl, vl, meta.blocks, meta.start, meta.ctx, tails[0], op, lp,
                    q.stride(0), q.stride(1), q.stride(2), kl.stride(0), kl.stride(1), kl.stride(2),
                    vl.stride(0), vl.stride(1), vl.stride(2), meta.blocks.stride(0), tails[1], tails[2],
                    op.stride(0), op.stride(1), op.stride(2), op.stride(3), lp.stride(0), lp.stride(1), lp.stride(2),
                    LOG2E / d ** 0.5, meta.scratch, ql, meta.width,
                    KVH=kvh, C=meta.blocks.shape[1], BS=meta.block_size, G=g,
                    SPLITS=meta.splits, D=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=meta.tail is None,
                    PREC=prec, INTERPRET=INTERPRET, num_warps=t.warps, num_stages=t.stages)
    out = torch.empty_like(q)
    _merge[(b * kvh, triton.cdiv(rows, block_m))](
        op, lp, out, op.stride(0), op.stride(1), op.stride(2), op.stride(3), lp.stride(0), lp.stride(1), lp.stride(2),
        out.stride(0), out.stride(1), out.stride(2), ql, KVH=kvh, PARTS=parts, G=g, D=d, BLOCK_M=block_m,
        num_warps=4)
    return out
