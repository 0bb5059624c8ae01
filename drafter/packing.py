"""Drafter training batches: sequence packing without cross-sample attention, and padding.

Owns the training sample record, packing samples into rows up to a token budget (positions
restart per sample, attention never crosses samples), the padded layout used as the baseline, and
the attention backends for both, including the training-time-test (TTT) attention where step
``j`` sees the step-0 keys causally plus its own keys from steps 1..j on the diagonal, and the
splits of a sample list across ranks (token-balanced shards) and into chunks of whole samples.

Kernel: flash-attn's varlen kernel over the whole packed row when the tensors are on CUDA and
``flash_attn`` is installed (one launch per layer, ``cu_seqlens`` keep samples apart; later TTT
steps merge their diagonal keys into its output through the returned log-sum-exp, exactly);
otherwise per-document SDPA (the fastest exact option on CPU in torch 2.13). Later TTT steps of
the padded layout use an explicit score matrix.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

try:  # optional CUDA kernel (pip install flash-attn); never needed for correctness
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_varlen_func = None


@dataclasses.dataclass
class FeatureSample:
    """One target sequence with what the drafter learns from."""

    input_ids: torch.Tensor  # [n] long: prompt + response
    loss_mask: torch.Tensor  # [n] bool: True on response tokens
    # [n, H] post-norm last hidden state of the target (training never reads the last position's:
    # no token follows it to be a label)
    hidden: torch.Tensor
    aux: torch.Tensor | None = None  # [n, A*H] EAGLE-3 target features

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def __post_init__(self) -> None:
        n = self.input_ids.shape[0]
        if self.loss_mask.shape != (n,) or self.hidden.shape[0] != n or (
                self.aux is not None and self.aux.shape[0] != n):
            raise ValueError("FeatureSample tensors disagree on sequence length: ids "
                             f"{tuple(self.input_ids.shape)}, mask {tuple(self.loss_mask.shape)}, "
                             f"hidden {tuple(self.hidden.shape)}, aux "
                             f"{None if self.aux is None else tuple(self.aux.shape)}")


@dataclasses.dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T]
    position_ids: torch.Tensor  # [B, T] restarting at 0 per sample
    loss_mask: torch.Tensor  # [B, T] bool
    doc_end: torch.Tensor  # [B, T] exclusive end index of each token's sample within its row
    hidden: torch.Tensor  # [B, T, H]
    aux: torch.Tensor | None  # [B, T, A*H]
    cu_seqlens: torch.Tensor | None  # [D+1] sample boundaries when packed (B == 1)

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens."""
        return int((self.doc_end > torch.arange(self.doc_end.shape[1], device=self.doc_end.device)).sum())

    def backend(self) -> "PackedTTTBackend | PaddedTTTBackend":
        return PackedTTTBackend(self.cu_seqlens) if self.cu_seqlens is not None else PaddedTTTBackend()


def pack(samples: Sequence[FeatureSample]) -> Batch:
    """All ``samples`` concatenated into one row."""
    lens = torch.tensor([len(s) for s in samples])
    cu = torch.zeros(len(samples) + 1, dtype=torch.long)
    cu[1:] = lens.cumsum(0)
    ends = torch.repeat_interleave(cu[1:], lens)
    pos = torch.cat([torch.arange(n) for n in lens.tolist()])
    aux = torch.cat([s.aux for s in samples])[None] if samples[0].aux is not None else None
    return Batch(torch.cat([s.input_ids for s in samples])[None], pos[None],
                 torch.cat([s.loss_mask for s in samples])[None], ends[None],
                 torch.cat([s.hidden for s in samples])[None], aux, cu)


def pad(samples: Sequence[FeatureSample]) -> Batch:
    """One right-padded row per sample (the baseline packing is measured against)."""
    b, t = len(samples), max(len(s) for s in samples)
    h = samples[0].hidden
    ids = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.bool)
    hidden = torch.zeros(b, t, h.shape[1], dtype=h.dtype)
    aux = torch.zeros(b, t, samples[0].aux.shape[1], dtype=h.dtype) if samples[0].aux is not None else None
    ends = torch.zeros(b, t, dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s)
        ids[i, :n], mask[i, :n], hidden[i, :n], ends[i, :n] = s.input_ids, s.loss_mask, s.hidden, n
        if aux is not None:
            aux[i, :n] = s.aux
    return Batch(ids, torch.arange(t).expand(b, t).clone(), mask, ends, hidden, aux, None)


def pack_by_budget(samples: Sequence[FeatureSample], token_budget: int) -> list[list[FeatureSample]]:
    """Group samples, in order, into packs of at most ``token_budget`` tokens (first fit).

    A sample longer than the budget is truncated to it (and logged) rather than dropped.
    """
    if token_budget <= 0:
        raise ValueError(f"token_budget must be > 0, got {token_budget}")
    groups: list[list[FeatureSample]] = []
    room: list[int] = []
    for s in samples:
        if len(s) > token_budget:
            log.warning("sample of %d tokens truncated to the %d-token budget", len(s), token_budget)
            s = FeatureSample(s.input_ids[:token_budget], s.loss_mask[:token_budget],
                              s.hidden[:token_budget], None if s.aux is None else s.aux[:token_budget])
        for i, r in enumerate(room):
            if len(s) <= r:
                groups[i].append(s)
                room[i] -= len(s)
                break
        else:
            groups.append([s])
            room.append(token_budget - len(s))
    return groups


def ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor,
                  diag: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Causal attention over step-0 keys plus same-position keys of later TTT steps.

    q: [B, H, T, D]; k0, v0 and each diag pair: [B, KV, T, D] -> [B, H, T, D].
    """
    rep = q.shape[1] // k0.shape[1]
    if not diag:
        return F.scaled_dot_product_attention(q, k0, v0, is_causal=True, enable_gqa=True)
    t, scale = q.shape[2], q.shape[-1] ** -0.5
    k0, v0 = k0.repeat_interleave(rep, 1), v0.repeat_interleave(rep, 1)
    s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, H, T, T]
    s0 = s0.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    sd = torch.stack([(q * k.repeat_interleave(rep, 1)).sum(-1) for k, _ in diag], -1) * scale
    p = torch.cat([s0, sd], -1).float().softmax(-1).to(q.dtype)  # [B, H, T, T + j]
    out = p[..., :t] @ v0
    for m, (_, v) in enumerate(diag):
        out = out + p[..., t + m, None] * v.repeat_interleave(rep, 1)
    return out


class _TTTBackend:
    """Remembers each step's keys/values; the first call of a batch is step 0."""

    def __init__(self) -> None:
        self.kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        steps = self.kv.setdefault(layer_idx, [])
        steps.append((k, v))
        return self.attend(q, steps[0][0], steps[0][1], steps[1:])

    def attend(self, q, k0, v0, diag):  # pragma: no cover - abstract
        raise NotImplementedError


class PaddedTTTBackend(_TTTBackend):
    """Right-padded rows: causal attention keeps every real query off the padding."""

    def attend(self, q, k0, v0, diag):
        return ttt_attention(q, k0, v0, diag)


class PackedTTTBackend(_TTTBackend):
    """One packed row; nothing attends across a sample boundary (flash-attn varlen on CUDA when
    installed, else per-sample SDPA; ``use_flash=False`` forces the latter)."""

    def __init__(self, cu_seqlens: torch.Tensor, *, use_flash: bool = True) -> None:
        super().__init__()
        self.cu_seqlens = cu_seqlens
        self.bounds = list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
        self.use_flash = use_flash and flash_attn_varlen_func is not None

    def attend(self, q, k0, v0, diag):
        if self.use_flash and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            return varlen_ttt_attention(q, k0, v0, diag, self.cu_seqlens)
        outs = [ttt_attention(q[:, :, s:e], k0[:, :, s:e], v0[:, :, s:e],
                              [(k[:, :, s:e], v[:, :, s:e]) for k, v in diag]) for s, e in self.bounds]
        return torch.cat(outs, dim=2)


def varlen_ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor,
                         diag: list[tuple[torch.Tensor, torch.Tensor]], cu_seqlens: torch.Tensor) -> torch.Tensor:
    """:func:`ttt_attention` for one packed row with flash-attn's varlen kernel (CUDA, fp16/bf16).

    q: [1, H, T, D]; k0, v0 and each diag pair: [1, KV, T, D]; cu_seqlens: [D+1] -> [1, H, T, D].
    Step 0 is causal varlen attention; each later step's same-position key joins the softmax
    through the kernel's log-sum-exp (an exact merge).
    """
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    tq, tk, tv = (x[0].transpose(0, 1).contiguous() for x in (q, k0, v0))  # [T, heads, D]
    out, lse, _ = flash_attn_varlen_func(tq, tk, tv, cu, cu, longest, longest, causal=True,
                                         return_attn_probs=True)  # out [T, H, D], lse [H, T]
    if diag:
        rep, scale = q.shape[1] // k0.shape[1], q.shape[-1] ** -0.5
        qf = q[0].float()  # [H, T, D]
        sd = torch.stack([(qf * k[0].float().repeat_interleave(rep, 0)).sum(-1) for k, _ in diag], -1) * scale
        top = torch.maximum(lse, sd.amax(-1))  # [H, T]
        w0, wd = (lse - top).exp(), (sd - top[..., None]).exp()  # [H, T], [H, T, j]
        acc = w0[..., None] * out.float().transpose(0, 1)  # [H, T, D]
        for m, (_, v) in enumerate(diag):
            acc = acc + wd[..., m, None] * v[0].float().repeat_interleave(rep, 0)
        return (acc / (w0 + wd.sum(-1))[..., None]).to(q.dtype)[None]
    return out.transpose(0, 1)[None]


def shard_samples(samples: Sequence[FeatureSample], rank: int, world_size: int) -> list[FeatureSample]:
    """Token-balanced deterministic shard: longest first onto the least-loaded rank."""
    load_ = [0] * world_size
    mine: list[int] = []
    for i in sorted(range(len(samples)), key=lambda i: -len(samples[i])):
        r = min(range(world_size), key=lambda r: (load_[r], r))
        load_[r] += len(samples[i])
        if r == rank:
            mine.append(i)
    return [samples[i] for i in sorted(mine)]


def split_chunks(samples: Sequence[FeatureSample], max_tokens: int) -> list[list[FeatureSample]]:
    """Whole samples, in order, into chunks of at most ``max_tokens`` (a longer sample alone)."""
    chunks: list[list[FeatureSample]] = []
    used = max_tokens
    for s in samples:
        if used + len(s) > max_tokens:
            chunks.append([])
            used = 0
        chunks[-1].append(s)
        used += len(s)
    return chunks


def empty_like(s: FeatureSample) -> FeatureSample:
    """A two-token sample that contributes nothing to the loss (its FSDP collectives still run)."""
    return FeatureSample(s.input_ids[:2].clone(), torch.zeros(2, dtype=torch.bool), s.hidden[:2].clone(),
                         None if s.aux is None else s.aux[:2].clone())
