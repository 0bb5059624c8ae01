"""Coupled sampling: every sampled token is a Gumbel-max draw keyed by (request seed, position, token).

Owns the sampling rule the engine, the plain reference loop and the drafters share. For a request
with seed ``s`` the token at absolute position ``t`` (prompt included) is

    y_t = argmax_v  lp(v) + G(s, t, v),     G = -log(-log(U(s, t, v)))

where ``lp`` are the processed log-probs (logits / temperature, then top-k and top-p masking, in
fp32) and ``U`` a uniform from a counter-based hash of the key (no generator state, no int64
overflow: 32-bit words multiplied in 16-bit halves). Gumbel-max makes ``y_t`` an exact sample of
softmax(lp); since the draw depends only on the logits and the key, a speculative step that
verifies a draft samples exactly the token plain decoding samples for the same seed (up to
floating-point near-ties between two forward shapes), and target-only verification becomes an
argmax walk. A drafter that drafts ``argmax(log q + G)`` with the same noise predicts the target's
*sample*, not only its argmax (exact all the same: committed tokens depend only on the target's
logits and the noise). Greedy rows (temperature 0) take the raw argmax and no noise.

Log-probs are ``log_softmax(logits / T)`` of the chosen token (T = 1 when greedy): what RL
trainers recompute as old log-probs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
# Salts that separate the key's fields (seed halves, position, token id).
_SALT_SEED, _SALT_POS, _SALT_TOK = 0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35
# Vocabulary chunk of the noisy argmax: bounds the int64 scratch to about 64 MiB per call.
_CHUNK_ELEMENTS = 1 << 23


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32): the multiply split in 16-bit halves of c."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) of int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def request_keys(seeds: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """[B] int64 32-bit keys of 64-bit request seeds (any Python ints; taken mod 2^64)."""
    s = [int(x) & _M64 for x in seeds]
    hi = torch.tensor([x >> 32 for x in s], dtype=torch.long, device=device)
    lo = torch.tensor([x & _M32 for x in s], dtype=torch.long, device=device)
    return mix32(mix32(hi ^ _SALT_SEED) ^ lo)


def token_hash(token_ids: torch.Tensor) -> torch.Tensor:
    """The token-id word of the key [K] (hashed once per vocabulary, then reused)."""
    return mix32((token_ids & _M32) ^ _SALT_TOK)


_VOCAB_HASH: dict[tuple[int, str], torch.Tensor] = {}


def vocab_hash(size: int, device: torch.device) -> torch.Tensor:
    """token_hash(0..size-1), cached per (size, device)."""
    key = (size, str(device))
    if key not in _VOCAB_HASH:
        _VOCAB_HASH[key] = token_hash(torch.arange(size, device=device))
    return _VOCAB_HASH[key]


def gumbel(keys: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Gumbel noise [B, N, K] (fp32) for keys [B], absolute positions [B, N] and hashed token ids
    [K] (:func:`token_hash`)."""
    kp = mix32(keys[:, None] ^ mix32((positions & _M32) ^ _SALT_POS))  # [B, N]
    h = mix32(kp[..., None] ^ tokens)  # [B, N, K]
    u = ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))  # 24-bit uniforms in (0, 1)
    return -torch.log(-torch.log(u))


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Per-row sampling settings as device tensors (one row per running request)."""

    keys: torch.Tensor  # [B] int64: request_keys of the rows' seeds
    temperature: torch.Tensor  # [B] fp32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] fp32, 1 = off
    masked: bool  # some row uses top-k or top-p (the sort is skipped otherwise)
    sampled: bool  # some row samples (temperature > 0); False: every row is greedy, no noise

    @classmethod
    def build(cls, params: Sequence, seeds: Sequence[int], device: torch.device | str = "cpu") -> "RowSampling":
        """From SamplingParams-like objects (temperature, top_k, top_p) and one seed per row."""
        if len(params) != len(seeds):
            raise ValueError(f"{len(params)} sampling params but {len(seeds)} seeds")
        return cls(request_keys(seeds, device),
                   torch.tensor([float(p.temperature) for p in params], device=device),
                   torch.tensor([int(p.top_k) for p in params], dtype=torch.long, device=device),
                   torch.tensor([float(p.top_p) for p in params], device=device),
                   any(p.top_k or p.top_p < 1 for p in params), any(p.temperature > 0 for p in params))

    def select(self, rows: torch.Tensor) -> "RowSampling":
        """The settings of rows [B'] (indices into these rows)."""
        return RowSampling(self.keys[rows], self.temperature[rows], self.top_k[rows], self.top_p[rows],
                           self.masked, self.sampled)

    def cat(self, other: "RowSampling") -> "RowSampling":
        """These rows, then ``other``'s (requests joining a running batch)."""
        return RowSampling(torch.cat([self.keys, other.keys]), torch.cat([self.temperature, other.temperature]),
                           torch.cat([self.top_k, other.top_k]), torch.cat([self.top_p, other.top_p]),
                           self.masked or other.masked, self.sampled or other.sampled)


def _scaled(logits: torch.Tensor, s: RowSampling) -> torch.Tensor:
    """logits / T in fp32 ([B, N, V]); greedy rows are scaled by 1."""
    t = torch.where(s.temperature > 0, s.temperature, torch.ones_like(s.temperature))
    return logits.float() / t[:, None, None]


def processed_logprobs(logits: torch.Tensor, s: RowSampling) -> torch.Tensor:
    """log softmax after temperature, top-k, then top-p (fp32, -inf on dropped tokens).

    logits: [B, N, V]; greedy rows are scaled by 1 (their draw is the raw argmax anyway).
    """
    return _masked(_scaled(logits, s), s).log_softmax(-1)


def _masked(x: torch.Tensor, s: RowSampling) -> torch.Tensor:
    """Scaled logits x [B, N, V] with top-k / top-p dropped tokens at -inf."""
    if s.masked:
        v = x.shape[-1]
        srt = x.sort(-1, descending=True).values  # [B, N, V]
        k = torch.where(s.top_k > 0, s.top_k.clamp(max=v), v)  # [B]
        kth = srt.gather(-1, (k - 1)[:, None, None].expand(-1, x.shape[1], 1))  # [B, N, 1]
        x = x.masked_fill(x < kth, float("-inf"))
        srt = srt.masked_fill(srt < kth, float("-inf"))
        probs = srt.softmax(-1)
        # keep the smallest prefix reaching top_p: drop a token when the mass before it reaches it
        before = probs.cumsum(-1) - probs
        last_kept = (before < s.top_p[:, None, None]).sum(-1, keepdim=True) - 1  # [B, N, 1]
        last_kept = torch.where(s.top_p[:, None, None] >= 1, v - 1, last_kept)  # no rounding drops
        floor = srt.gather(-1, last_kept.clamp(min=0))
        x = x.masked_fill(x < floor, float("-inf"))
    return x


def noisy_argmax(scores: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                 tokens: torch.Tensor | None = None) -> torch.Tensor:
    """argmax_v scores + G(key, position, token v) per row and position -> [B, N] (indices into the
    last dim). scores: [B, N, K] fp32; tokens: [K] hashed token ids (default: of 0..K-1). Chunked
    over K."""
    b, n, k = scores.shape
    ids = vocab_hash(k, scores.device) if tokens is None else tokens
    step = max(1, _CHUNK_ELEMENTS // max(1, b * n))
    best_val = best_idx = None
    for lo in range(0, k, step):
        z = scores[..., lo: lo + step] + gumbel(keys, positions, ids[lo: lo + step])
        val, idx = z.max(-1)
        if best_val is None:
            best_val, best_idx = val, idx
        else:
            better = val > best_val
            best_val, best_idx = torch.where(better, val, best_val), torch.where(better, idx + lo, best_idx)
    return best_idx


def sample(logits: torch.Tensor, s: RowSampling, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Coupled draws and their log-probs. logits: [B, N, V]; positions: [B, N] absolute position
    of the token each logits row produces. Returns tokens [B, N] long and log-probs [B, N] fp32
    (log_softmax(logits / T) of the token; T = 1 for greedy rows). No host read."""
    x = _scaled(logits, s)  # [B, N, V]
    plain = x.log_softmax(-1)
    if s.sampled:
        lp = _masked(x, s).log_softmax(-1) if s.masked else plain
        drawn = noisy_argmax(lp, s.keys, positions)
        tokens = torch.where((s.temperature == 0)[:, None], logits.argmax(-1), drawn)
    else:
        tokens = logits.argmax(-1)
    return tokens, plain.gather(-1, tokens[..., None]).squeeze(-1)
