"""Attention over a block-table cache (tlt.rollout.attention) against a float64 reference built from
explicit positions: random row lengths, floors, tree and drafter-level tail masks, causal chunks,
block sizes 1, 16 and one block per row, split counts 1-5, batch 1-64. The Triton kernel runs the
same cases under TRITON_INTERPRET=1 on CPU (and natively in the gpu-marked test)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tlt.rollout.attention import AttnMeta, PagedBackend, attend_torch, merge_partials, partial_attention

ROOT = Path(__file__).resolve().parents[2]


def make_case(seed: int, *, b: int, h: int = 4, kvh: int = 2, d: int = 16, q: int = 5, w: int | None = None,
              bs: int | None = 16, max_ctx: int = 80, splits: int = 1, tail: str = "tree",
              dtype: torch.dtype = torch.float32, device: str = "cpu", spare: int = 1) -> dict:
    """A random paged layout: each row's blocks drawn from a shuffled pool (the last block is scratch),
    table columns past a row's need point at scratch (``spare`` of them past the longest row's; 0 with
    ``bs=None``: a one-column table, the static cache's layout). ``tail``: "tree" (Q == W, ancestor closure of
    random parents), "levels" (W > Q, random visibility, every query sees itself) or "causal"."""
    g = torch.Generator().manual_seed(seed)
    w = q if w is None else w
    ctx = torch.randint(0, max_ctx + 1, (b,), generator=g)
    start = torch.where(torch.rand(b, generator=g) < 0.3, torch.randint(0, max_ctx + 1, (b,), generator=g) % (ctx + 1), 0)
    need = ctx + w
    bs = int(need.max()) if bs is None else bs  # None: one block per row
    cols = [math.ceil(int(n) / bs) for n in need]
    width = max(cols) + spare
    n_blocks = sum(cols) + 1
    perm = torch.randperm(n_blocks - 1, generator=g).tolist()
    scratch = n_blocks - 1
    blocks = torch.full((b, width), scratch, dtype=torch.int32)
    at = 0
    for r, c in enumerate(cols):
        blocks[r, :c] = torch.tensor(perm[at: at + c], dtype=torch.int32)
        at += c
    kl = torch.randn(n_blocks, kvh, bs, d, generator=g)
    vl = torch.randn(n_blocks, kvh, bs, d, generator=g)
    qs = torch.randn(b, h, q, d, generator=g)
    mask = None
    if tail == "tree":
        parents = torch.stack([torch.tensor([-1] + [int(torch.randint(0, j, (1,), generator=g)) for j in range(1, q)])
                               for _ in range(b)])
        anc = torch.eye(q, dtype=torch.bool).repeat(b, 1, 1)
        for j in range(1, q):
            anc[:, j] |= anc[torch.arange(b), parents[:, j].clamp(min=0)] & (parents[:, j] >= 0)[:, None]
        mask = anc
    elif tail == "levels":
        mask = torch.rand(b, q, w, generator=g) < 0.4
        mask[:, torch.arange(q), w - q + torch.arange(q)] = True
    meta = AttnMeta(blocks.to(device), bs, start.to(device), ctx.to(device), w, None if mask is None else mask.to(device),
                    splits=splits, scratch=scratch)
    to = dict(device=device, dtype=dtype)
    return {"q": qs.to(**to), "kl": kl.to(**to), "vl": vl.to(**to), "meta": meta, "mask": mask, "start": start,
            "ctx": ctx, "blocks": blocks, "bs": bs, "w": w}


def reference(case: dict) -> torch.Tensor:
    """float64, row by row, from the logical positions each query sees."""
    q, kl, vl, blocks, bs, w = (case[k] for k in ("q", "kl", "vl", "blocks", "bs", "w"))
    b, h, nq, d = q.shape
    g = h // kl.shape[1]
    out = torch.zeros(b, h, nq, d, dtype=torch.float64)
    for r in range(b):
        ctx, start = int(case["ctx"][r]), int(case["start"][r])
        pos = torch.arange(ctx + w)
        blk, off = blocks[r].long()[pos // bs], pos % bs
        keys = kl.cpu().double()[blk, :, off].transpose(0, 1).repeat_interleave(g, 0)  # [H, P, D]
        vals = vl.cpu().double()[blk, :, off].transpose(0, 1).repeat_interleave(g, 0)
        for i in range(nq):
            ti = w - nq + i
            seen = (pos >= start) & (pos < ctx)
            tail = pos - ctx
            inside = tail >= 0
            if case["mask"] is None:
                seen |= inside & (tail <= ti)
            else:
                seen |= inside & case["mask"][r, i][tail.clamp(min=0)]
            s = (keys[:, seen] @ q[r, :, i].cpu().double()[:, :, None])[..., 0] / math.sqrt(d)  # [H, P']
            out[r, :, i] = (s.softmax(-1)[:, None, :] @ vals[:, seen])[:, 0]
    return out


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.cpu().double() - ref).norm() / ref.norm())


CASES = [dict(b=1, q=1, w=1, tail="causal"),  # a plain decode step
         dict(b=3, q=5, tail="tree"), dict(b=5, q=7, tail="tree", bs=1), dict(b=4, q=6, tail="tree", bs=None),
         dict(b=4, q=3, w=9, tail="levels"), dict(b=2, q=24, tail="causal", max_ctx=40),  # a prefill chunk
         dict(b=64, q=5, tail="tree", max_ctx=30), dict(b=2, q=1, w=1, tail="causal", max_ctx=300, bs=16)]


@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_torch_path_equals_the_reference(kw, splits):
    for seed in range(3):
        case = make_case(seed, splits=splits, **kw)
        assert _err(attend_torch(case["q"], case["kl"], case["vl"], case["meta"]), reference(case)) < 1e-5


def test_the_one_block_per_row_layout_reads_views():
    """AttnMeta.rows: row b is cache row row0 + b (what the engine's static cache uses)."""
    g = torch.Generator().manual_seed(0)
    kl, vl = torch.randn(6, 2, 40, 16, generator=g), torch.randn(6, 2, 40, 16, generator=g)
    q = torch.randn(3, 4, 2, 16, generator=g)
    ctx = torch.tensor([5, 30, 0])
    meta = AttnMeta.rows(ctx, 2, 40, row0=2)
    assert meta.gather(kl, 3).data_ptr() == kl[2].data_ptr()
    general = AttnMeta(torch.arange(2, 5, dtype=torch.int32)[:, None], 40, torch.zeros(3, dtype=torch.long), ctx, 2,
                       splits=3)
    torch.testing.assert_close(attend_torch(q, kl, vl, meta), attend_torch(q, kl, vl, general), rtol=1e-5, atol=1e-5)


def test_the_backend_writes_the_queries_at_the_tail_end_and_past_the_table_to_scratch():
    kl, vl = torch.zeros(1, 4, 2, 4, 16), torch.zeros(1, 4, 2, 4, 16)  # [layers, blocks, KV, BS, D]
    blocks = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)  # block 3 doubles as scratch here
    ctx = torch.tensor([2, 5])
    meta = AttnMeta(blocks, 4, torch.zeros(2, dtype=torch.long), ctx, 4, torch.ones(2, 2, 4, dtype=torch.bool),
                    scratch=3)
    k = torch.arange(2 * 2 * 2 * 16, dtype=torch.float32).view(2, 2, 2, 16) + 1  # [B, KV, Q, D]
    PagedBackend(kl, vl, meta)(0, torch.randn(2, 4, 2, 16), k, k)
    assert torch.equal(kl[0, 1, :, 0], k[0, :, 0]) and torch.equal(kl[0, 1, :, 1], k[0, :, 1])  # row 0: positions 4, 5
    assert torch.equal(kl[0, 3, :, 3], k[1, :, 0])  # row 1: position 7 = block 3, offset 3
    assert torch.equal(kl[0, 3, :, 0], k[1, :, 1])  # position 8: past the table -> scratch block 3, offset 0


def test_merge_is_exact_and_empty_parts_weigh_nothing():
    g = torch.Generator().manual_seed(1)
    q, keys, vals = torch.randn(2, 4, 3, 8, generator=g), torch.randn(2, 2, 10, 8, generator=g), torch.randn(2, 2, 10, 8, generator=g)
    vis = torch.rand(2, 3, 10, generator=g) < 0.6
    vis[..., 0] = True
    whole, _ = partial_attention(q, keys, vals, vis)
    cut = torch.arange(10) < 4
    parts = [partial_attention(q, keys, vals, vis & cut), partial_attention(q, keys, vals, vis & ~cut),
             partial_attention(q, keys, vals, torch.zeros_like(vis))]
    assert torch.isneginf(parts[2][1]).all() and (parts[2][0] == 0).all()
    torch.testing.assert_close(merge_partials([o for o, _ in parts], [l for _, l in parts]), whole)


def test_prefix_parts_follow_each_rows_length():
    """One chunk for the whole batch: a row takes parts in proportion to its length, and the parts of
    any batch fit the kernel's B * (splits + 1) prefix slots."""
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        b, splits = int(torch.randint(1, 65, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        ctx = torch.randint(0, 40000, (b,), generator=g) * (torch.rand(b, generator=g) < 0.8)
        meta = AttnMeta.rows(ctx, 1, 40064, splits=splits)
        chunk = int(meta.prefix_chunk())
        parts = -(-ctx // chunk)
        assert int(parts.sum()) <= b * (splits + 1) and chunk >= 1
        if int(ctx.sum()):
            assert int(parts.sum()) >= min(b * splits, int(ctx.sum())) // 2
    mixed = AttnMeta.rows(torch.tensor([32768] + [1024] * 7), 5, 32832, splits=5)
    assert (-(-mixed.ctx // mixed.prefix_chunk())).tolist() == [33] + [2] * 7  # the long row: 33 of 47 parts


def triton_cases(device: str = "cpu", big: bool = False) -> list[dict]:
    """The kernel against the reference (run under TRITON_INTERPRET=1 on CPU): the errors by case."""
    from tlt.rollout.attention_triton import paged_attention

    kws = [dict(b=2, q=1, w=1, tail="causal", max_ctx=150), dict(b=2, q=5, tail="tree", splits=3),
           dict(b=2, q=3, w=7, tail="levels", bs=1, splits=2), dict(b=2, q=20, tail="causal", bs=None, max_ctx=70),
           dict(b=5, q=5, tail="tree", bs=None, max_ctx=400, splits=2),  # one block per row, rows of mixed lengths
           dict(b=4, q=1, w=1, tail="causal", bs=16, max_ctx=500, splits=3),
           dict(b=3, q=5, tail="tree", bs=None, spare=0, max_ctx=200, splits=3),  # one column: the block once
           dict(b=2, q=1, w=1, tail="causal", bs=None, spare=0, max_ctx=300, splits=2),
           # tails past one 32-bit word of the mask: two words in one tile; three over two tiles
           dict(b=2, q=40, tail="tree", max_ctx=90), dict(b=2, q=3, w=70, tail="levels", bs=None, splits=2)]
    if big:
        kws += [dict(b=8, h=32, kvh=8, d=128, q=5, tail="tree", max_ctx=3000, splits=8),
                dict(b=3, h=32, kvh=8, d=128, q=64, tail="causal", max_ctx=1000, splits=1, bs=16)]
    out = []
    for i, kw in enumerate(kws):
        for dtype in ([torch.float32, torch.bfloat16] if device == "cuda" else [torch.float32]):
            case = make_case(10 + i, device=device, dtype=dtype, **kw)
            got = paged_attention(case["q"], case["kl"], case["vl"], case["meta"])
            out.append({"case": i, "dtype": str(dtype), "err": _err(got.float(), reference(case))})
    return out


def test_the_kernels_tail_mask_is_one_bit_per_position():
    pytest.importorskip("triton", reason="the kernel's module needs triton (the dev extra)")
    from tlt.rollout.attention_triton import tail_bits

    g = torch.Generator().manual_seed(3)
    for w in (1, 5, 31, 32, 33, 64, 70):
        tail = torch.rand(3, 4, w, generator=g) < 0.5
        tail[0, 0] = True  # every bit of a word set (from w = 32: bit 31, the sign, too)
        words = tail_bits(tail)
        assert words.dtype == torch.int32 and words.shape == (3, 4, -(-w // 32))
        back = torch.stack([(words[..., j // 32] >> (j % 32)) & 1 for j in range(w)], -1).bool()
        assert torch.equal(back, tail), w


def test_the_kernel_refuses_k_and_v_of_different_layouts():
    """A paged tile's offsets serve K and V alike, so the kernel takes them only in one layout."""
    pytest.importorskip("triton", reason="the kernel's module needs triton (the dev extra)")
    from tlt.rollout.attention_triton import paged_attention

    case = make_case(1, b=2)
    vl = case["vl"].transpose(0, 1).contiguous().transpose(0, 1)  # the same values, other strides
    with pytest.raises(ValueError, match="share one layout"):
        paged_attention(case["q"], case["kl"], vl, case["meta"])


def test_triton_kernel_interpreted_equals_the_reference():
    pytest.importorskip("triton", reason="the Triton kernel's interpreter test needs triton (the dev extra)")
    code = ("import json; from tests.rollout.test_attention import triton_cases; "
            "print(json.dumps(triton_cases()))")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    errs = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(errs) == 10 and all(e["err"] < 1e-5 for e in errs), errs


@pytest.mark.gpu
def test_triton_kernel_on_cuda_equals_the_reference():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for e in triton_cases("cuda", big=True):
        assert e["err"] < (1e-5 if "float32" in e["dtype"] else 2e-2), e


def test_splits_fill_the_device_in_whole_waves_when_asked(monkeypatch):
    """About ``programs_per_sm`` programs per multiprocessor over (rows x KV heads), rounded up; with
    ``whole_waves`` rounded down, so that batch 1 of 8 KV heads at one program per multiprocessor
    asks for 16 parts a head, 128 programs on 132 multiprocessors, not 17 (136: 4 of them waiting for
    a second wave where the rounding of a part to whole tiles does not absorb the 17th)."""
    from tlt.rollout import attention
    from tlt.rollout.attention import Tuning, default_splits

    monkeypatch.setattr(attention, "_sms", lambda device: 132)
    monkeypatch.setattr(attention, "_has_triton", lambda: True)
    cuda, few = torch.device("cuda"), Tuning(block_n=128, stages=3, programs_per_sm=1)
    whole = Tuning(block_n=128, stages=3, programs_per_sm=1, whole_waves=True)
    assert [default_splits(b, 8, 32768, cuda, tuning=few) for b in (1, 2, 4)] == [17, 9, 5]
    assert [default_splits(b, 8, 32768, cuda, tuning=whole) for b in (1, 2, 4, 32)] == [16, 8, 4, 1]
    assert default_splits(8, 8, 32768, cuda, tuning=Tuning(programs_per_sm=3, whole_waves=True)) == 6
    assert default_splits(1, 8, 1024, cuda, tuning=whole) == 4  # no part under 256 positions
    assert default_splits(1, 8, 32768, torch.device("cpu"), tuning=whole) == 1  # the torch path: one SDPA call


def test_launch_shapes_by_regime_and_their_override(monkeypatch):
    """Batch 1-4 of 8 KV heads on a 132-multiprocessor card take the ``few`` shape, batch 8 ``many``;
    TLT_ATTENTION_TUNING sets one shape for both or each apart, and a bad value names the variable."""
    from tlt.rollout.attention import Tuning, Tunings

    t = Tunings()
    assert [t.pick(b, 8, 132) is t.few for b in (1, 2, 4, 8, 32)] == [True, True, True, False, False]
    monkeypatch.setenv("TLT_ATTENTION_TUNING", '{"block_n": 32, "stages": 3}')
    one = Tunings.from_env()
    assert one.few == one.many == Tuning(block_n=32, stages=3)
    monkeypatch.setenv("TLT_ATTENTION_TUNING", '{"few": {"block_n": 128}, "many": {"warps": 8}, "few_upto": 0.5}')
    two = Tunings.from_env()
    assert (two.few.block_n, two.many.warps, two.few_upto) == (128, 8, 0.5)
    for bad in ('{"few": 3}', "[1]", '{"block_n": 48}', '{"splits": 2}', '{"whole_waves": 1}', "not json"):
        monkeypatch.setenv("TLT_ATTENTION_TUNING", bad)
        with pytest.raises(ValueError, match="TLT_ATTENTION_TUNING"):
            Tunings.from_env()
