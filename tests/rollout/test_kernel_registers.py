"""The draft tree's mask leaves the attention kernel the occupancy its split plans for, and the
engine's tile shapes spill nothing.

Every decode, verify and draft-level step of the engine attends under a tail mask (a plain step's is
one position). ptxas allocates one register count for the whole kernel, so what the tail's programs
hold live is paid by every program of the launch, the prefix parts that stream the context too:
with the mask read as a [rows x positions] tile of int8 loads, the verify (5 tokens) took 191
registers a thread against 138 causal, and an H100 multiprocessor's registers then held 2 of its
programs, not 3, while :func:`~tlt.rollout.attention.default_splits` plans about ``programs_per_sm``
(2) of them per multiprocessor plus its rounding. Read as one bit per position, the mask costs a few
registers.
Tiles of 64 packed rows (prefill chunks, wide trees), and of 32 under a causal tail (a drafter's
catch-up) or over a paged cache, take at most 64 positions: by 128 they spilled.

No GPU here: the kernel is compiled for an H100 (sm_90a) by Triton's own compiler from the engine's
launch arguments, and its bundled ptxas reports the allocation (:mod:`tests.rollout.sm90`).
"""

from __future__ import annotations

import pytest
import torch

from tlt.bench.attention import chain_tail
from tlt.rollout.attention import AttnMeta, Tunings

pytest.importorskip("triton", reason="compiling the kernel needs triton (the dev extra)")
pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's CUDA backend")

from tests.rollout.sm90 import record_launches, resources  # noqa: E402


def partials(launches: list, tuning, q: int, masked: bool, heads: tuple[int, int] = (32, 8),
             block: int | None = None):
    """The prefix-and-tail kernel of one step at batch 8, head dim 128 (``heads``: query and KV heads,
    the Llama-8B shape's by default): ``q`` query tokens, under a tree mask or causal, over one block
    per row or (``block``) a paged cache of blocks this size (``launches``: :func:`record_launches`'s
    list)."""
    from tlt.rollout.attention_triton import paged_attention

    launches.clear()
    (h, kvh), b, slots = heads, 8, 4096
    tail = chain_tail(b, q, q, torch.device("cpu")) if masked else None
    if block is None:
        kl = torch.zeros(b, kvh, slots, 128, dtype=torch.bfloat16)
        meta = AttnMeta.rows(torch.full((b,), 1000), q, slots, tail=tail, splits=5)
    else:
        cols = slots // block
        kl = torch.zeros(b * cols + 1, kvh, block, 128, dtype=torch.bfloat16)  # (the last: scratch)
        blocks = torch.arange(b * cols, dtype=torch.int32).view(b, cols)
        meta = AttnMeta(blocks, block, torch.zeros(b, dtype=torch.long), torch.full((b,), 1000), q, tail, splits=5,
                        scratch=b * cols)
    paged_attention(torch.zeros(b, h, q, 128, dtype=torch.bfloat16), kl, kl, meta, tuning)
    (launch,) = [x for x in launches if x.kernel == "_partials"]
    return resources(launch)


@pytest.mark.parametrize("regime", ["few", "many"])
@pytest.mark.parametrize("q", [1, 5], ids=["plain", "verify"])
@pytest.mark.parametrize("block", [None, 16], ids=["rows", "paged"])
def test_the_tree_mask_leaves_room_for_the_planned_parts(monkeypatch, regime, q, block):
    """Under the mask the kernel spills nothing, and its registers leave a multiprocessor room for the
    ``programs_per_sm`` programs the split plans plus one for its rounding, wherever its shared
    memory does: over one block per row and over a paged cache's blocks of 16 (whose tile offsets
    K and V share: two tiles of them took the paged verify to 201 registers, 2 programs)."""
    tuning = getattr(Tunings(), regime)
    masked = partials(record_launches(monkeypatch), tuning, q, masked=True, block=block)
    assert masked.spill_bytes == 0, masked
    assert masked.by_registers() >= min(tuning.programs_per_sm + 1, masked.by_shared_memory()), masked


@pytest.mark.parametrize("regime", ["few", "many"])
def test_wide_tiles_spill_nothing(monkeypatch, regime):
    """A prefill chunk (64 tokens, causal) and a tree of 8 nodes under Qwen2-1.5B's 6 query heads a
    KV head (48 packed rows) take 64-row tiles, a drafter's catch-up of 5 tokens (causal) a 32-row
    one; with 128-position tiles those spilled."""
    tuning, launches = getattr(Tunings(), regime), record_launches(monkeypatch)
    chunk = partials(launches, tuning, 64, masked=False)
    tree = partials(launches, tuning, 8, masked=True, heads=(12, 2))
    catch_up = partials(launches, tuning, 5, masked=False)
    assert chunk.spill_bytes == tree.spill_bytes == catch_up.spill_bytes == 0, (chunk, tree, catch_up)
