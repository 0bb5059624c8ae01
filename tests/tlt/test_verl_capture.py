"""The verl capture yields, per sequence, exactly the features our rollout target computes.

Proves that ``HiddenCapture`` hooked on a transformers Llama during a verl-style old-log-prob
forward, split by ``micro_batch_samples``, gives for every sequence of the micro-batch its token
ids, a response-only loss mask, the post-norm hidden state and the EAGLE-3 aux layers equal to a
forward of that sequence alone, in both layouts verl 0.9.1 uses (remove-padding: one packed row
with restarting position ids; padded: right-padded rows with an attention mask), and that these
equal ``tlt.rollout.target.TargetModel``'s own ``hidden`` / ``aux`` on the same weights. Also covers
the prompt-length fallbacks and the argument checks.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tensordict", reason="the verl capture tests need tensordict (verl's micro-batch type)")
pytest.importorskip("transformers", reason="the verl capture tests need transformers (the HF model verl runs)")

from tensordict import TensorDict  # noqa: E402

from tlt.rollout.target import TargetModel  # noqa: E402
from tests.hf import hf_model  # noqa: E402
from tlt.integrations.verl.capture import (  # noqa: E402
    HiddenCapture,
    _prompt_lengths,
    decoder_parts,
    micro_batch_samples,
)

LENGTHS = (5, 9, 3)
PROMPT_LENS = (2, 4, 1)
AUX = (0, 1, 2)  # 2 == num_layers: the last layer's output (pre-norm)
PAD = 0
ATOL = 1e-5


@pytest.fixture(scope="module")
def hf():
    return hf_model("llama", seed=3, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                    attn_implementation="sdpa").float().eval()


@pytest.fixture(scope="module")
def seqs():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, 64, (n,), generator=g) for n in LENGTHS]


def _jagged(tensors):
    return torch.nested.nested_tensor(list(tensors), layout=torch.jagged)


def _micro_batch(seqs, **extra):
    return TensorDict({"input_ids": _jagged(seqs), **extra}, batch_size=[len(seqs)])


def _reference(hf, ids):
    """Direct forward of one sequence alone: (post-norm hidden [n, H], aux [n, len(AUX)*H])."""
    last = {}
    handle = hf.model.layers[-1].register_forward_hook(
        lambda m, a, out: last.__setitem__("x", out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            out = hf(ids[None], output_hidden_states=True)
    finally:
        handle.remove()
    states = out.hidden_states
    # HF's last hidden_states entry is the final norm's output, not the last layer's output.
    hidden = states[-1][0]
    assert torch.allclose(hidden, hf.model.norm(last["x"])[0], atol=ATOL)
    pre_norm = {i: states[i][0] for i in range(len(hf.model.layers))} | {len(hf.model.layers): last["x"][0]}
    return hidden, torch.cat([pre_norm[i] for i in AUX], -1)


def _capture(hf, **inputs):
    cap = HiddenCapture(hf, AUX)
    with torch.no_grad(), cap.active():
        # verl passes use_cache=False; with a cache transformers ignores packed position ids.
        hf(**inputs, use_cache=False)
    assert len(cap.hidden) == 1
    return cap.features(0)


def _packed_features(hf, seqs):
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    return _capture(hf, input_ids=ids, position_ids=pos, attention_mask=None)


def _padded_features(hf, seqs):
    width = max(LENGTHS)
    ids = torch.full((len(seqs), width), PAD)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = s
        mask[b, :len(s)] = 1
    pos = torch.arange(width).expand(len(seqs), width)
    return _capture(hf, input_ids=ids, attention_mask=mask, position_ids=pos)


def _check_samples(hf, seqs, samples):
    assert len(samples) == len(seqs)
    for s, p, (ids, mask, hidden, aux) in zip(seqs, PROMPT_LENS, samples):
        assert torch.equal(ids, s)
        assert mask.dtype == torch.bool and mask.shape == (len(s),)
        assert not mask[:p].any() and mask[p:].all()
        ref_hidden, ref_aux = _reference(hf, s)
        assert hidden.shape == ref_hidden.shape and aux.shape == ref_aux.shape == (len(s), 32 * len(AUX))
        torch.testing.assert_close(hidden, ref_hidden, atol=ATOL, rtol=0)
        torch.testing.assert_close(aux, ref_aux, atol=ATOL, rtol=0)


@pytest.mark.parametrize("packed", [True, False], ids=["remove_padding", "padded"])
def test_samples_match_per_sequence_forward(hf, seqs, packed):
    hidden, aux = (_packed_features if packed else _padded_features)(hf, seqs)
    mb = _micro_batch(seqs, prompts=_jagged(s[:p] for s, p in zip(seqs, PROMPT_LENS)))
    _check_samples(hf, seqs, micro_batch_samples(mb, hidden, aux, packed=packed))


def test_packed_forward_without_boundaries_would_differ(hf, seqs):
    # Guards the packed test: if sequences attended across boundaries, later ones would change.
    ids = torch.cat(seqs)[None]
    hidden, _ = _capture(hf, input_ids=ids)  # one long causal row, positions 0..total-1
    split = micro_batch_samples(_micro_batch(seqs, prompts=_jagged(s[:p] for s, p in zip(seqs, PROMPT_LENS))),
                                hidden, None, packed=True)
    ref_hidden, _ = _reference(hf, seqs[1])
    assert not torch.allclose(split[1][2], ref_hidden, atol=1e-3)
    assert split[1][3] is None


def test_features_equal_rollout_target(hf, seqs, tmp_path):
    hf.save_pretrained(tmp_path)
    ours = TargetModel.from_pretrained(tmp_path)
    hidden, aux = _packed_features(hf, seqs)
    mb = _micro_batch(seqs, prompts=_jagged(s[:p] for s, p in zip(seqs, PROMPT_LENS)))
    for s, (_, _, h, a) in zip(seqs, micro_batch_samples(mb, hidden, aux, packed=True)):
        with torch.no_grad():
            out = ours(s[None], capture=AUX)
        torch.testing.assert_close(h, out.hidden[0], atol=1e-4, rtol=0)
        torch.testing.assert_close(a, torch.cat([out.aux[i] for i in AUX], -1)[0], atol=1e-4, rtol=0)


def test_prompt_lengths_from_response_mask(seqs):
    resp = _jagged(torch.ones(n - p, dtype=torch.long) for n, p in zip(LENGTHS, PROMPT_LENS))
    assert _prompt_lengths(_micro_batch(seqs, response_mask=resp), len(seqs)) == list(PROMPT_LENS)
    hidden = torch.randn(1, sum(LENGTHS), 8)
    samples = micro_batch_samples(_micro_batch(seqs, response_mask=resp), hidden, None, packed=True)
    assert [int((~m).sum()) for _, m, _, _ in samples] == list(PROMPT_LENS)


def test_prompt_lengths_from_dense_prompts(seqs):
    mb = _micro_batch(seqs, prompts=torch.zeros(len(seqs), 4, dtype=torch.long))
    assert _prompt_lengths(mb, len(seqs)) == [4, 4, 4]


def test_prompt_lengths_without_prompts_or_response_mask_raises(seqs):
    with pytest.raises(ValueError, match="neither 'prompts' nor 'response_mask'"):
        _prompt_lengths(_micro_batch(seqs), len(seqs))


@pytest.mark.parametrize("aux", [(-1,), (0, 3)])
def test_hidden_capture_rejects_out_of_range_aux_layers(hf, aux):
    with pytest.raises(ValueError, match=r"must lie in 0\.\.2"):
        HiddenCapture(hf, aux)


def test_decoder_parts_rejects_non_llama_module(hf):
    norm, layers = decoder_parts(hf)
    assert norm is hf.model.norm and layers is hf.model.layers
    with pytest.raises(ValueError, match="model.model.norm and model.model.layers"):
        decoder_parts(torch.nn.Linear(2, 2))
    bare = torch.nn.Module()
    bare.model = torch.nn.Module()
    bare.model.layers = torch.nn.ModuleList()
    with pytest.raises(ValueError, match="Llama-family"):
        decoder_parts(bare)
