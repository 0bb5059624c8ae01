"""The target runner matches transformers' own Llama/Qwen2/Qwen3 to < 1e-4 in fp32."""

from __future__ import annotations

import pytest
import torch

from tlt.rollout.draft_tree import tree_depths
from tlt.rollout.attention import AttnMeta
from tlt.rollout.kv_cache import StaticKVCache, tree_ancestors
from tlt.rollout.target import TargetModel
from tests.hf import hf_model

TOL = 1e-4


def _load(hf, tmp_path, **save_kw):
    hf.save_pretrained(tmp_path, **save_kw)
    return TargetModel.from_pretrained(tmp_path)


def test_full_forward_and_hidden_capture(family, tmp_path):
    hf = hf_model(family)
    ours = _load(hf, tmp_path)
    ids = torch.randint(0, 97, (2, 23))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        out = ours(ids, capture=(0, 1, 2))
    diff = (ref.logits - out.logits).abs().max().item()
    print(f"{family} full-forward max|dlogit| = {diff:.2e}")
    assert diff < TOL
    for i in (0, 1, 2):
        assert (ref.hidden_states[i] - out.aux[i]).abs().max() < TOL
    # HF's last hidden_states entry is post-norm: the EAGLE feature.
    assert (ref.hidden_states[-1] - out.hidden).abs().max() < TOL


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
])
def test_rope_scaling_types(rope, tmp_path):
    params = {"rope_theta": 10000.0, **rope}
    hf = hf_model("llama", rope_parameters=params, max_position_embeddings=128)
    ours = _load(hf, tmp_path)
    # 150 > max_position_embeddings exercises dynamic NTK's stretched base.
    ids = torch.randint(0, 97, (1, 150))
    with torch.no_grad():
        diff = (hf(ids).logits - ours(ids).logits).abs().max().item()
    print(f"rope {rope['rope_type']} max|dlogit| = {diff:.2e}")
    assert diff < TOL


def test_sharded_checkpoint_loads(tmp_path):
    hf = hf_model("qwen2")
    ours = _load(hf, tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids).logits).abs().max() < TOL


def test_tied_embeddings_share_storage(tmp_path):
    hf = hf_model("qwen2", tie_word_embeddings=True)
    ours = _load(hf, tmp_path)
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids).logits).abs().max() < TOL


def test_batched_prefill_then_decode_with_static_cache(family, tmp_path):
    """Right-padded prefill of different-length prompts, then decode steps written by slot."""
    hf = hf_model(family)
    ours = _load(hf, tmp_path)
    lengths = torch.tensor([5, 11, 8])
    prompts = [torch.randint(0, 97, (int(n),)) for n in lengths]
    cfg = ours.config
    cache = StaticKVCache(cfg.num_hidden_layers, 3, cfg.num_key_value_heads, 32, cfg.head_dim)
    t = int(lengths.max())
    ids = torch.zeros(3, t, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    pos = torch.arange(t).expand(3, t)
    span = 32
    with torch.no_grad():
        out = ours(ids, pos, cache.backend(AttnMeta.rows(torch.zeros(3, dtype=torch.long), t, span, span=t)))
        seqs = [p.tolist() for p in prompts]
        worst = 0.0
        for b in range(3):
            ref = hf(prompts[b][None]).logits[0]
            worst = max(worst, (ref - out.logits[b, : lengths[b]]).abs().max().item())
        nxt = out.logits[torch.arange(3), lengths - 1].argmax(-1)
        cur = lengths.clone()
        for _step in range(4):
            for b in range(3):
                seqs[b].append(int(nxt[b]))
            slots = cur[:, None]
            out = ours(nxt[:, None], slots, cache.backend(AttnMeta.rows(cur, 1, span)))
            for b in range(3):
                ref = hf(torch.tensor(seqs[b])[None]).logits[0, -1]
                worst = max(worst, (ref - out.logits[b, 0]).abs().max().item())
            nxt = out.logits[:, 0].argmax(-1)
            cur = cur + 1
    print(f"{family} batched prefill+decode max|dlogit| = {worst:.2e}")
    assert worst < TOL


def test_tree_forward_matches_branch_recomputation(family, tmp_path):
    hf = hf_model(family)
    ours = _load(hf, tmp_path)
    cfg = ours.config
    prefix = torch.randint(0, 97, (1, 7))
    #        0     1   2   3   4     5   6
    # tree: two roots (0, 4); 0 -> 1 -> 2, 0 -> 3; 4 -> 5 -> 6
    parents = torch.tensor([[-1, 0, 1, 0, -1, 4, 5]])
    nodes = torch.randint(0, 97, (1, 7))
    cache = StaticKVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, 32, cfg.head_dim)
    with torch.no_grad():
        pos = torch.arange(7)[None]
        ours(prefix, pos, cache.backend(AttnMeta.rows(torch.tensor([0]), 7, 32)))
        depth = tree_depths(parents)
        out = ours(nodes, 7 + depth, cache.backend(AttnMeta.rows(torch.tensor([7]), 7, 32, tail=tree_ancestors(parents))))
        worst = 0.0
        for j in range(7):
            path, k = [], j
            while k >= 0:
                path.append(int(nodes[0, k]))
                k = int(parents[0, k])
            seq = torch.cat([prefix[0], torch.tensor(path[::-1])])
            ref = hf(seq[None]).logits[0, -1]
            worst = max(worst, (ref - out.logits[0, j]).abs().max().item())
    print(f"{family} tree forward max|dlogit| = {worst:.2e}")
    assert worst < TOL


def test_bad_checkpoint_is_a_clear_error(tmp_path):
    hf = hf_model("llama")
    hf.save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file
    state = load_file(str(tmp_path / "model.safetensors"))
    state.pop("model.norm.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight"):
        TargetModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no config.json"):
        TargetModel.from_pretrained(tmp_path / "nope")
