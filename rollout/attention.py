"""Attention over a block-table KV cache that reads each row's real context.

Owns :class:`AttnMeta`, the one contract between whoever lays out a step (the engine, the drafter,
a prefill) and the attention that every layer of that step runs, and :class:`PagedBackend`, the
:class:`~tlt.drafter.model_core.AttentionBackend` that writes a step's keys/values and attends.

What a row sees. Row ``b``'s keys sit at logical positions; position ``p`` lives in physical block
``blocks[b, p // block_size]`` at offset ``p % block_size`` of the cache (a column past the table's
width, or a padding row's table, names the scratch block). A step's queries see
- the *prefix* ``[start_b, ctx_b)``, read without a mask (``start``: the lowest visible position,
  the drafter's floor; 0 for the target), and
- the *tail* ``[ctx_b, ctx_b + W)``: this step's tokens (a draft tree, a prefill chunk, the
  drafter's levels), where query ``i`` sees tail position ``j`` iff ``tail[b, i, j]`` (``tail`` None:
  causal, ``j <= i``). The queries are the tail's last ``Q`` positions, and are written there.

The decomposition (FlashDecoding): the prefix is cut into parts of one length for the whole batch
(its total length over ``B * splits``), so a row takes parts in proportion to its length and a
batch of mixed lengths costs what their lengths sum to; the tail is one more part per row. Each
part yields a partial output and its log-sum-exp, merged exactly. Lengths and tables are device
tensors, so one captured graph serves every context length; ``splits`` is fixed per graph. Two implementations of the same parts: a Triton
kernel on CUDA (:mod:`tlt.rollout.attention_triton`, query tokens packed with the query heads of one
KV head, bytes read following each row's length) and this module's torch path (CPU, and CUDA without
Triton), which with one split is a single part: one SDPA call under the step's mask.

The one-block-per-row layout of :class:`~tlt.rollout.kv_cache.StaticKVCache` is the case
``block_size = slots per row``, ``blocks[b] = [row b]``; a paged cache adds real blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
KERNELS = ("auto", "torch")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tuning:
    """One launch shape of the Triton kernel (``tlt bench attention --sweep`` measures candidates)."""

    block_n: int = 64  # positions per tile
    stages: int = 2  # software-pipelining depth
    warps: int = 4
    programs_per_sm: int = 2  # context splits: about this many programs per multiprocessor
    max_splits: int = 64
    # splits rounded down, so a batch of equal rows fills whole waves of programs_per_sm per
    # multiprocessor (rounded up, the parts past them wait for a second wave where a multiprocessor
    # holds no more than programs_per_sm of them)
    whole_waves: bool = False

    def __post_init__(self) -> None:
        for name in ("block_n", "stages", "warps", "programs_per_sm", "max_splits"):
            if getattr(self, name) < 1:
                raise ValueError(f"Tuning.{name}={getattr(self, name)}: must be >= 1")
        if not isinstance(self.whole_waves, bool):
            raise ValueError(f"Tuning.whole_waves={self.whole_waves!r}: true or false")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"Tuning.block_n={self.block_n}: a power of two >= 16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tunings:
    """The kernel's launch shapes by how many (row x KV head) pairs a step has per multiprocessor:
    ``few`` up to ``few_upto`` of them (batch 1 to 4 of 8 KV heads on an H100/H200, where each row's
    context is split across the device and long tiles in deep pipelines stream best), ``many`` above
    (measured on an H200: `tlt bench attention --sweep`, docs/gpu.md). ``TLT_ATTENTION_TUNING``
    overrides them: a JSON object of :class:`Tuning` fields (both), or ``{"few": {...}, "many": {...}}``."""

    few: Tuning = Tuning(block_n=128, stages=3, warps=4, programs_per_sm=1)
    many: Tuning = Tuning()
    few_upto: float = 0.25

    def __post_init__(self) -> None:
        if not self.few_upto >= 0:
            raise ValueError(f"Tunings.few_upto={self.few_upto}: (rows x KV heads) per multiprocessor, >= 0")

    def pick(self, batch: int, kv_heads: int, sms: int) -> Tuning:
        return self.few if batch * kv_heads <= self.few_upto * sms else self.many

    @classmethod
    def from_env(cls) -> "Tunings":
        text = os.environ.get("TLT_ATTENTION_TUNING", "")
        if not text:
            return cls()
        names = [f.name for f in dataclasses.fields(Tuning)]
        try:
            fields = json.loads(text)
            if not isinstance(fields, dict):
                raise TypeError("not an object")
            if set(fields) <= {"few", "many", "few_upto"}:
                return cls(**{k: Tuning(**v) if k != "few_upto" else v for k, v in fields.items()})
            one = Tuning(**fields)
            return cls(few=one, many=one)
        except (ValueError, TypeError) as e:
            raise ValueError(f"TLT_ATTENTION_TUNING={text!r}: a JSON object of {names}, or of \"few\" and "
                             f"\"many\" such objects ({e})") from e

    def as_dict(self) -> dict:
        return {"few": dataclasses.asdict(self.few), "many": dataclasses.asdict(self.many), "few_upto": self.few_upto}


TUNINGS = Tunings.from_env()


def tuning_for(batch: int, kv_heads: int, device: torch.device) -> Tuning:
    """The launch shape of a step of ``batch`` rows (splits and the kernel must agree on it; off CUDA,
    under Triton's interpreter, ``many``)."""
    return TUNINGS.pick(batch, kv_heads, _sms(device)) if device.type == "cuda" else TUNINGS.many


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclasses.dataclass
class AttnMeta:
    """One step's attention layout, shared by every layer (derived masks are built once, lazily)."""

    blocks: torch.Tensor  # [B, C] int32: physical block of each logical block of each row
    block_size: int  # slots per block
    start: torch.Tensor  # [B] long: first visible prefix position
    ctx: torch.Tensor  # [B] long: prefix end = tail start
    width: int  # W: tail positions
    tail: torch.Tensor | None = None  # [B, Q, W] bool, None: causal (W == Q)
    span: int | None = None  # an upper bound on ctx + W over rows, known on the host (None: the table's width)
    splits: int = 1  # prefix parts per row, on average over the batch (a static shape)
    row0: int | None = None  # host promise: blocks[b] == [row0 + b] (the one-block-per-row layout: views)
    scratch: int = 0  # a block no live row reads: where positions past the table's width are written
    kernel: str = "auto"  # "auto": the Triton kernel on CUDA where Triton imports, else "torch"
    _cache: dict = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.splits < 1:
            raise ValueError(f"splits={self.splits}: at least 1")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel={self.kernel!r}: use one of {KERNELS}")
        if self.tail is not None and self.tail.shape[-1] != self.width:
            raise ValueError(f"tail mask [B, Q, W] has W={self.tail.shape[-1]}, width={self.width}")

    @classmethod
    def rows(cls, ctx: torch.Tensor, width: int, slots: int, *, row0: int = 0, start: torch.Tensor | None = None,
             tail: torch.Tensor | None = None, span: int | None = None, splits: int = 1,
             kernel: str = "auto") -> "AttnMeta":
        """The one-block-per-row layout: row ``b`` is cache row ``row0 + b`` of ``slots`` slots."""
        b = ctx.shape[0]
        blocks = torch.arange(row0, row0 + b, dtype=torch.int32, device=ctx.device)[:, None]
        return cls(blocks, slots, torch.zeros_like(ctx) if start is None else start, ctx, width, tail,
                   span, splits, row0, kernel=kernel)

    @property
    def capacity(self) -> int:
        """Positions the block table addresses per row."""
        return self.blocks.shape[1] * self.block_size

    def cached(self, key, make):
        """``make()`` once per step (what every layer shares: masks, write indices, the tail's bits)."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def physical(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [B, T] long logical positions -> (block [B, T], offset [B, T]); a position past the
        table's width maps to the scratch block (in the one-block-per-row layout: the row's last slot,
        where only a padding query past every real one writes)."""
        if self.row0 is not None:
            rows = torch.arange(self.row0, self.row0 + pos.shape[0], device=pos.device)[:, None]
            return rows.expand_as(pos), pos.clamp(max=self.block_size - 1)
        return physical(self.blocks, self.block_size, pos, self.scratch)

    def query_positions(self, q: int) -> torch.Tensor:
        """[B, Q] the positions of the step's queries: the tail's last ``q``."""
        return self.cached(("qpos", q), lambda: self.ctx[:, None] + (self.width - q) + torch.arange(
            q, device=self.ctx.device))

    def read_span(self) -> int:
        return min(self.span, self.capacity) if self.span is not None else self.capacity

    def visible(self, q: int, part: int | str | None = None) -> torch.Tensor:
        """[B, Q, S] bool over positions [0, S = read_span): what each query sees (``part``: only the
        prefix's part ``part`` of :meth:`prefix_chunk` positions, or ``"tail"``: the step's own tokens)."""
        return self.cached(("vis", q, part), lambda: self._visible(q, part))

    def prefix_chunk(self) -> torch.Tensor:
        """[] long: the length of every prefix part, one for the whole batch: the rows' total length
        over ``B * splits`` (at least 1), so a row takes parts in proportion to its own length and the
        work follows the sum of the lengths (the kernel rounds it up to its tile)."""
        return self.cached("chunk", lambda: torch.div((self.ctx - self.start).sum() + self.ctx.shape[0] * self.splits - 1,
                                                      self.ctx.shape[0] * self.splits, rounding_mode="floor").clamp(min=1))

    def _visible(self, q: int, part: int | str | None) -> torch.Tensor:
        s, dev = self.read_span(), self.ctx.device
        kpos = torch.arange(s, device=dev)[None, None]  # [1, 1, S]
        lo, hi = self.start[:, None, None], self.ctx[:, None, None]
        if isinstance(part, int):
            chunk = self.prefix_chunk()
            lo = lo + part * chunk
            return ((kpos >= lo) & (kpos < torch.minimum(lo + chunk, hi))).expand(-1, q, -1)
        prefix = (kpos >= lo) & (kpos < hi)  # [B, 1, S]
        j = kpos - self.ctx[:, None, None]  # tail index of each position [B, 1, S]
        in_tail = (j >= 0) & (j < self.width)
        if self.tail is None:
            qi = (self.width - q) + torch.arange(q, device=dev)[None, :, None]  # tail index of each query
            seen = in_tail & (j <= qi)
        else:  # the tail mask's entry at each position's tail index
            seen = in_tail & self.tail.gather(2, j.clamp(0, self.width - 1).expand(-1, q, -1))
        return seen if part == "tail" else (seen | prefix)

    def additive(self, q: int, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, Q, S] additive mask of :meth:`visible` (the most negative finite value where hidden,
        so a query with nothing visible stays finite)."""
        return self.cached(("add", q, dtype), lambda: torch.zeros((), dtype=dtype, device=self.ctx.device).masked_fill(
            ~self.visible(q), torch.finfo(dtype).min)[:, None])

    def gather(self, layer_kv: torch.Tensor, b: int) -> torch.Tensor:
        """layer_kv [NB, KV, BS, D] -> [B, KV, S, D] the rows' positions [0, S)."""
        s = self.read_span()
        if self.row0 is not None:  # a view
            return layer_kv[self.row0: self.row0 + b, :, :s]
        n = -(-s // self.block_size)  # the blocks covering [0, S) (within the table: S <= capacity)
        idx = self.cached("read", lambda: self.blocks[:b, :n].reshape(-1))  # [B * n]
        if n == 1:  # one block per row (rows of the static cache): its first S slots
            return layer_kv[:, :, :s].index_select(0, idx)  # [B, KV, S, D]
        kv = layer_kv.index_select(0, idx)  # whole blocks, not positions: [B * n, KV, BS, D]
        # (then one more copy, to put each row's blocks end to end)
        return kv.view(b, n, *kv.shape[1:]).transpose(1, 2).flatten(2, 3)[:, :, :s]  # [B, KV, S, D]


def physical(blocks: torch.Tensor, block_size: int, pos: torch.Tensor, scratch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical positions pos [B, T] of rows with tables blocks [B, C] -> (block [B, T] long, offset
    [B, T] long); a position past the table's width maps to the scratch block."""
    col = torch.div(pos, block_size, rounding_mode="floor")
    inside = col < blocks.shape[1]
    blk = blocks.gather(1, col.clamp(0, blocks.shape[1] - 1)).long()
    return torch.where(inside, blk, scratch), pos - col * block_size


class PagedBackend:
    """Writes a step's keys/values at its query positions, then attends by :class:`AttnMeta`.
    ``k``, ``v`` [NL, NB, KV, BS, D]: the cache's tensors (every layer). What does not change from
    layer to layer (write indices, the path, the mask) is settled at the first layer."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, meta: AttnMeta) -> None:
        self.k, self.v, self.meta = k, v, meta
        self._plan: tuple | None = None

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [B, H, Q, D]; k, v: [B, KV, Q, D] -> [B, H, Q, D]
        if self._plan is None:
            self._plan = self._settle(q, k)
        rows, idx, sdpa = self._plan
        kl, vl = self.k[layer_idx], self.v[layer_idx]
        if rows is not None:  # the one-block-per-row layout: a scatter along each row's slots
            kl[rows].scatter_(2, idx, k)
            vl[rows].scatter_(2, idx, v)
        else:
            kl[idx[0], :, idx[1]] = k.transpose(1, 2)  # [B, Q, KV, D] at (block, offset)
            vl[idx[0], :, idx[1]] = v.transpose(1, 2)
        if sdpa is not None:  # one part over row views: a single SDPA call under the step's mask
            span, mask = sdpa
            return F.scaled_dot_product_attention(q, kl[rows, :, :span], vl[rows, :, :span], attn_mask=mask,
                                                  enable_gqa=True)
        return attend(q, kl, vl, self.meta)

    def _settle(self, q: torch.Tensor, k: torch.Tensor) -> tuple:
        m, (b, kvh, nq, d) = self.meta, k.shape
        blk, off = m.physical(m.query_positions(nq))
        if m.row0 is None:
            return None, (blk, off), None
        rows = slice(m.row0, m.row0 + b)
        idx = off[:, None, :, None].expand(-1, kvh, -1, d)
        one_part = m.splits == 1 and not (q.is_cuda and m.kernel == "auto" and _triton_ok(q, self.k[0]))
        return rows, idx, (m.read_span(), m.additive(nq, q.dtype)) if one_part else None


def attend(q: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
    """q [B, H, Q, D] over one layer's cache kl, vl [NB, KV, BS, D] -> [B, H, Q, D]."""
    if q.is_cuda and meta.kernel == "auto" and _triton_ok(q, kl):
        from tlt.rollout.attention_triton import paged_attention

        return paged_attention(q, kl, vl, meta)
    return attend_torch(q, kl, vl, meta)


def attend_torch(q: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
    """The decomposition in torch: the prefix in parts of :meth:`AttnMeta.prefix_chunk` positions and
    the tail part, merged by log-sum-exp; with one split the parts are one (a single SDPA call under
    the step's mask). With more, the number of parts is read on the host (a check of the algorithm
    on CPU; where the kernel runs, the grid is sized for the most parts a batch can take)."""
    b, _, nq, _ = q.shape
    keys, vals = meta.gather(kl, b), meta.gather(vl, b)  # [B, KV, S, D]
    if meta.splits == 1:
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=meta.additive(nq, q.dtype), enable_gqa=True)
    chunk = meta.prefix_chunk()
    n = int(torch.div(meta.ctx - meta.start + chunk - 1, chunk, rounding_mode="floor").max())  # parts of the longest row
    parts = [partial_attention(q, keys, vals, meta.visible(nq, p)) for p in [*range(n), "tail"]]
    return merge_partials([o for o, _ in parts], [lse for _, lse in parts]).to(q.dtype)


def partial_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
                      visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over the visible keys only: (output [B, H, Q, D] fp32, log-sum-exp [B, H, Q]
    fp32, -inf where nothing is visible, with a zero output). q [B, H, Q, D]; keys, vals [B, KV, S, D];
    visible [B, Q, S] bool."""
    g = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(g, 1)
    v = vals.float().repeat_interleave(g, 1)
    scores = (q.float() @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # [B, H, Q, S]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    m = scores.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)
    l = p.sum(-1, keepdim=True)  # [B, H, Q, 1]
    out = (p @ v) / l.clamp_min(torch.finfo(torch.float32).tiny)
    return out, (m + l.log())[..., 0]


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Exact merge of partial attentions over disjoint key sets: weights exp(lse_i - max lse)."""
    lse = torch.stack(lses)  # [P, B, H, Q]
    top = lse.amax(0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(lse - top)  # [P, B, H, Q]; 0 for an empty part
    num = sum(wi[..., None] * o for wi, o in zip(w, outs))
    return num / w.sum(0)[..., None].clamp_min(torch.finfo(torch.float32).tiny)


def default_splits(batch: int, kv_heads: int, slots: int, device: torch.device, kernel: str = "auto",
                   tuning: Tuning | None = None, head_dim: int = 128) -> int:
    """Prefix chunks per row so that a step fills the device: for the Triton kernel about
    ``programs_per_sm`` programs per multiprocessor over (rows x KV heads; at most that with
    ``whole_waves``), no chunk under 256 positions, at most ``max_splits``; 1 wherever the torch
    path runs (one SDPA call)."""
    if device.type != "cuda" or kernel != "auto" or head_dim < 16 or head_dim & (head_dim - 1) or not _has_triton():
        return 1
    sms = _sms(device)
    t = tuning or TUNINGS.pick(batch, kv_heads, sms)
    programs, pairs = t.programs_per_sm * sms, max(batch * kv_heads, 1)
    want = programs // pairs if t.whole_waves else -(-programs // pairs)
    return max(1, min(want, t.max_splits, slots // 256))


def _triton_ok(q: torch.Tensor, kl: torch.Tensor) -> bool:
    """The kernel takes a power-of-two head dimension >= 16 and whole GQA groups; Triton imports."""
    d = q.shape[-1]
    return d >= 16 and not d & (d - 1) and q.shape[1] % kl.shape[1] == 0 and _has_triton()


@functools.cache
def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        log.warning("triton is not installed: attention runs the torch path (pip install triton)")
        return False
    return True
