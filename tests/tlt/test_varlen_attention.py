"""``tlt_varlen_sdpa``: a packed row attends exactly as each of its sequences alone.

verl's remove-padding layout (one row, ``position_ids`` restarting at 0 per sequence) through a
transformers Llama with TLT's attention function gives, for every sequence, the logits and the
gradients of a forward of that sequence alone; attention across a boundary (what a missing
boundary would do) changes the later sequences' logits, so the test would see it. A padded batch
is refused with the fix named.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the attention function plugs into transformers")

from tests.hf import hf_model  # noqa: E402
from tlt.integrations.verl import varlen_attention  # noqa: E402

LENGTHS = (7, 12, 1, 5)
ATOL = 1e-5


@pytest.fixture(scope="module")
def models():
    varlen_attention.register()
    kw = dict(seed=5, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=64)
    return (hf_model("llama", attn_implementation=varlen_attention.NAME, **kw).float(),
            hf_model("llama", attn_implementation="sdpa", **kw).float())


@pytest.fixture(scope="module")
def seqs():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(1, 64, (n,), generator=g) for n in LENGTHS]


def _packed(seqs):
    ids = torch.cat(seqs)[None]  # [1, S]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]  # [1, S]
    return ids, pos


def test_packed_row_matches_each_sequence_alone(models, seqs):
    varlen, sdpa = models
    ids, pos = _packed(seqs)
    logits = varlen(input_ids=ids, position_ids=pos, use_cache=False).logits[0]  # [S, V]
    solo = torch.cat([sdpa(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
    torch.testing.assert_close(logits, solo, atol=ATOL, rtol=0)
    # one causal sequence over the whole row (no boundaries) would differ after the first one
    joined = sdpa(input_ids=ids, use_cache=False).logits[0]
    first = len(seqs[0])
    assert (joined[first:] - solo[first:]).abs().max() > 1e-2


def test_gradients_match_each_sequence_alone(models, seqs):
    varlen, sdpa = models
    ids, pos = _packed(seqs)
    varlen.zero_grad()
    varlen(input_ids=ids, position_ids=pos, use_cache=False).logits.float().square().mean().backward()
    sdpa.zero_grad()
    n = sum(LENGTHS)
    sum(sdpa(input_ids=s[None], use_cache=False).logits.float().square().sum() / (n * 64) for s in seqs).backward()
    for (name, a), (_, b) in zip(varlen.named_parameters(), sdpa.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_padded_batch_is_refused_with_the_fix(models, seqs):
    varlen, _ = models
    ids = torch.stack([seqs[0], seqs[0]])  # [2, 7]
    with pytest.raises(ValueError, match="use_remove_padding=true"):
        varlen(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
