"""Packed drafter training equals per-sample training: loss and gradients (rtol 1e-5, fp32)."""

from __future__ import annotations

import pytest
import torch

from tlt.drafter.eagle import Drafter, DrafterConfig
from tlt.drafter.model_config import ModelConfig
from tlt.drafter.packing import FeatureSample, pack, pack_by_budget, pad
from tlt.drafter.ttt import TTTConfig, ttt_forward


def tiny_target_cfg(**over) -> ModelConfig:
    base = dict(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=64,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    base.update(over)
    return ModelConfig(**base)


def make_drafter(method: str, seed: int = 0) -> Drafter:
    torch.manual_seed(seed)
    tcfg = tiny_target_cfg()
    embed = torch.randn(tcfg.vocab_size, tcfg.hidden_size)
    head = torch.randn(tcfg.vocab_size, tcfg.hidden_size) * 0.3
    cfg = DrafterConfig.for_target(tcfg, method, draft_vocab_size=40 if method == "eagle3" else None)
    d = Drafter(cfg, embed, head)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p))
    if method == "eagle3":
        d.set_vocab_map(torch.randperm(61)[:40].sort().values)
    return d


def make_samples(n: int, hidden: int = 32, aux: bool = False, seed: int = 1) -> list[FeatureSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(3, 30, (1,), generator=g))
        mask = torch.zeros(length, dtype=torch.bool)
        mask[length // 3:] = True
        out.append(FeatureSample(torch.randint(0, 61, (length,), generator=g), mask,
                                 torch.randn(length, hidden, generator=g),
                                 torch.randn(length, 3 * hidden, generator=g) if aux else None))
    return out


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("steps", [1, 3])
def test_packed_equals_per_sample(method, steps):
    cfg = TTTConfig(steps=steps)
    samples = make_samples(6, aux=method == "eagle3")
    d = make_drafter(method)
    packed = ttt_forward(d, pack(samples), cfg)
    loss_p = packed.loss(cfg)
    grads_p = torch.autograd.grad(loss_p, list(d.parameters()))

    per = None
    for s in samples:
        st = ttt_forward(d, pack([s]), cfg)
        per = st if per is None else per.merge(st)
    loss_s = per.loss(cfg)
    grads_s = torch.autograd.grad(loss_s, list(d.parameters()))
    print(f"{method} steps={steps}: packed loss {loss_p.item():.6f} per-sample {loss_s.item():.6f}")
    torch.testing.assert_close(loss_p, loss_s, rtol=1e-5, atol=0)
    for gp, gs in zip(grads_p, grads_s):
        torch.testing.assert_close(gp, gs, rtol=1e-5, atol=1e-7)
    assert packed.count == per.count and packed.top1 == per.top1
    assert packed.chain_accept == per.chain_accept


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_padded_equals_packed(method):
    cfg = TTTConfig(steps=3)
    samples = make_samples(5, aux=method == "eagle3")
    d = make_drafter(method)
    a = ttt_forward(d, pack(samples), cfg)
    b = ttt_forward(d, pad(samples), cfg)
    torch.testing.assert_close(a.loss(cfg), b.loss(cfg), rtol=1e-5, atol=0)
    assert a.count == b.count


def test_no_attention_across_samples():
    """Changing sample 0 must not change anything the drafter computes for sample 1."""
    cfg = TTTConfig(steps=2)
    d = make_drafter("eagle")
    s0, s1 = make_samples(2)
    base = ttt_forward(d, pack([s0, s1]), cfg)
    other = make_samples(1, seed=99)[0]
    changed = ttt_forward(d, pack([other, s1]), cfg)
    alone = ttt_forward(d, pack([s1]), cfg)
    alone0 = ttt_forward(d, pack([s0]), cfg)
    alone_other = ttt_forward(d, pack([other]), cfg)
    for j in range(2):
        torch.testing.assert_close(base.loss_sum[j] - alone0.loss_sum[j], alone.loss_sum[j], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(changed.loss_sum[j] - alone_other.loss_sum[j], alone.loss_sum[j],
                                   rtol=1e-5, atol=1e-6)


def test_pack_by_budget_respects_budget_and_order():
    samples = make_samples(20)
    groups = pack_by_budget(samples, 40)
    assert sum(len(g) for g in groups) == 20
    assert all(sum(len(s) for s in g) <= 40 for g in groups)
    with pytest.raises(ValueError, match="token_budget"):
        pack_by_budget(samples, 0)
    long = FeatureSample(torch.zeros(50, dtype=torch.long), torch.ones(50, dtype=torch.bool), torch.zeros(50, 32))
    assert len(pack_by_budget([long], 40)[0][0]) == 40


def test_positions_restart_per_sample():
    samples = make_samples(3)
    b = pack(samples)
    starts = b.cu_seqlens[:-1]
    assert (b.position_ids[0, starts] == 0).all()
    assert b.num_tokens == sum(len(s) for s in samples)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_varlen_ttt_attention_matches_per_document_sdpa():
    pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    from tlt.drafter.packing import PackedTTTBackend, varlen_ttt_attention

    torch.manual_seed(0)
    cu = torch.tensor([0, 7, 19, 20, 33])
    t, h, kv, d = 33, 4, 2, 32
    q = torch.randn(1, h, t, d, device="cuda", dtype=torch.bfloat16)
    steps = [(torch.randn(1, kv, t, d, device="cuda", dtype=torch.bfloat16),
              torch.randn(1, kv, t, d, device="cuda", dtype=torch.bfloat16)) for _ in range(3)]
    ref = PackedTTTBackend(cu, use_flash=False)
    for j in range(3):  # step 0 alone, then with 1 and 2 diagonal steps
        (k0, v0), diag = steps[0], steps[1:j + 1]
        want = ref.attend(q.float(), k0.float(), v0.float(), [(k.float(), v.float()) for k, v in diag])
        got = varlen_ttt_attention(q, k0, v0, diag, cu)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
