"""Drafter export matches what the SGLang / vLLM loaders read (docs/export_formats.md).

The expected tensor tables are written here by hand from the loader facts, independently of
``tlt.drafter.export.expected_tensors``, so the test checks the spec as well as the writer.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tlt.drafter import export as export_mod
from tlt.drafter.eagle import Drafter, DrafterConfig
from tlt.drafter.export import expected_tensors, export_drafter
from tests.drafter.test_packing import tiny_target_cfg

V, H, I, NH, NKV, HD = 61, 32, 64, 4, 2, 16  # head_dim * heads != H on purpose
AUX = (1, 2, 3)
CASES = [("eagle", "sglang", None), ("eagle", "vllm", None), ("eagle3", "sglang", 40),
         ("eagle3", "vllm", 40), ("eagle3", "sglang", V), ("eagle3", "vllm", V)]


def loader_table(method: str, fmt: str, vd: int) -> dict[str, tuple[int, ...]]:
    """Sections 1-4 of docs/export_formats.md, literally."""
    if method == "eagle":
        t = {
            "fc.weight": (H, 2 * H),
            "layers.0.self_attn.q_proj.weight": (NH * HD, H),
            "layers.0.self_attn.k_proj.weight": (NKV * HD, H),
            "layers.0.self_attn.v_proj.weight": (NKV * HD, H),
            "layers.0.self_attn.o_proj.weight": (H, NH * HD),
            "layers.0.mlp.gate_proj.weight": (I, H),
            "layers.0.mlp.up_proj.weight": (I, H),
            "layers.0.mlp.down_proj.weight": (H, I),
            "layers.0.post_attention_layernorm.weight": (H,),
        }
        if fmt == "sglang":
            t["fc.bias"] = (H,)
        return t
    t = {
        "fc.weight": (H, 3 * H),
        "layers.0.self_attn.q_proj.weight": (NH * HD, 2 * H),
        "layers.0.self_attn.k_proj.weight": (NKV * HD, 2 * H),
        "layers.0.self_attn.v_proj.weight": (NKV * HD, 2 * H),
        "layers.0.self_attn.o_proj.weight": (H, NH * HD),
        "layers.0.mlp.gate_proj.weight": (I, H),
        "layers.0.mlp.up_proj.weight": (I, H),
        "layers.0.mlp.down_proj.weight": (H, I),
        "layers.0.input_layernorm.weight": (H,),
        "layers.0.hidden_norm.weight": (H,),
        "layers.0.post_attention_layernorm.weight": (H,),
        "norm.weight": (H,),
        "lm_head.weight": (vd, H),
    }
    if vd < V:
        t["d2t"] = (vd,)
    return t


def _target_cfg(**over):
    return tiny_target_cfg(head_dim=HD, **over)


def _write_target(path, cfg) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    return str(path)


def _make(tmp_path, method, vd=None, aux=AUX, seed=0):
    """(drafter, drafter_dir, target_dir, draft->target ids or None)."""
    torch.manual_seed(seed)
    tcfg = _target_cfg()
    cfg = DrafterConfig.for_target(tcfg, method, aux_layers=aux if method == "eagle3" else None,
                                   draft_vocab_size=vd)
    d = Drafter(cfg, torch.randn(V, H), torch.randn(V, H))
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids = None
    if method == "eagle3" and cfg.draft_vocab_size < V:
        ids = torch.randperm(V)[:cfg.draft_vocab_size].sort().values
        d.set_vocab_map(ids)
    d.save(tmp_path / "drafter")
    # The target's context is longer than the drafter's: export must take the target's.
    target = _write_target(tmp_path / "target", dataclasses.replace(tcfg, max_position_embeddings=8192))
    return d, tmp_path / "drafter", target, ids


@pytest.mark.parametrize("method,fmt,vd", CASES)
def test_export_matches_loader_table(tmp_path, method, fmt, vd):
    d, ddir, tdir, ids = _make(tmp_path, method, vd)
    vd = vd or V
    summary = export_drafter(ddir, tdir, fmt, tmp_path / "out", dtype="float32")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]

    # tensor names and shapes: exactly the loader's table; the spec agrees with it
    table = loader_table(method, fmt, vd)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == table
    assert {k: s for k, (s, _) in expected_tensors(method, fmt, H, I, NH, NKV, HD, V, vd).items()} == table
    assert not any(k.startswith("model.") or "embed_tokens" in k or k == "t2d" for k in tensors)
    assert summary["num_tensors"] == len(table) and summary["format"] == fmt
    assert summary["method"] == method and summary["bytes"] > 0

    # copied values equal the drafter's
    state = d.state_dict()
    for k, v in tensors.items():
        if k not in ("fc.bias", "d2t"):
            assert v.dtype == torch.float32
            torch.testing.assert_close(v, state[k], rtol=0, atol=0)
    if "fc.bias" in tensors:
        assert torch.equal(tensors["fc.bias"], torch.zeros(H))
    if vd < V:
        assert tensors["d2t"].dtype == torch.int64
        assert torch.equal(torch.arange(vd) + tensors["d2t"], ids)  # target = draft + d2t[draft]

    # config.json
    arch = {("eagle", "sglang"): ["LlamaForCausalLMEagle"], ("eagle", "vllm"): ["EagleLlamaForCausalLM"],
            ("eagle3", "sglang"): ["LlamaForCausalLMEagle3"],
            ("eagle3", "vllm"): ["LlamaForCausalLMEagle3"]}[method, fmt]
    assert cfg["architectures"] == arch == summary["architectures"]
    assert cfg["model_type"] == "llama" and cfg["hidden_act"] == "silu"
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]) == (H, I, NH, NKV, HD, V)
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert cfg["attention_bias"] is False and cfg["mlp_bias"] is False and cfg["bias"] is False
    assert cfg["max_position_embeddings"] == 8192 and cfg["torch_dtype"] == "float32"
    if method == "eagle":
        assert "eagle_config" not in cfg and "eagle_aux_hidden_state_layer_ids" not in cfg
        return
    assert "draft_vocab_size" in cfg and cfg["draft_vocab_size"] == vd
    assert cfg["target_hidden_size"] == H
    if fmt == "sglang":  # SGLang reads only eagle_config, ids = HF index - 1
        assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2],
                                       "use_aux_hidden_state": True}
        assert "eagle_aux_hidden_state_layer_ids" not in cfg
    else:  # vLLM reads the top-level key first, ids = HF index
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
        assert "eagle_aux_hidden_state_layer_ids" not in cfg.get("eagle_config", {})


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_default_dtype_bf16_casts_floats_only(tmp_path, method):
    d, ddir, tdir, _ = _make(tmp_path, method, 40 if method == "eagle3" else None)
    export_drafter(ddir, tdir, "sglang", tmp_path / "out")
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    state = d.state_dict()
    for k, v in tensors.items():
        if k == "d2t":
            assert v.dtype == torch.int64 and torch.equal(v, state["d2t"])
        else:
            assert v.dtype == torch.bfloat16
            if k != "fc.bias":
                assert torch.equal(v, state[k].to(torch.bfloat16))


def test_rope_copied_from_target(tmp_path):
    _, ddir, _, _ = _make(tmp_path, "eagle3", 40)
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    tdir = _write_target(tmp_path / "t2", _target_cfg(rope_parameters=rope, max_position_embeddings=8192))
    export_drafter(ddir, tdir, "vllm", tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["rope_scaling"] == rope and cfg["rope_parameters"] == rope
    assert cfg["rope_theta"] == 500000.0 and cfg["max_position_embeddings"] == 8192


def test_refuses_target_mismatch(tmp_path):
    _, ddir, _, _ = _make(tmp_path, "eagle")
    other = _write_target(tmp_path / "other", _target_cfg(hidden_size=48))
    with pytest.raises(ValueError, match="mismatch"):
        export_drafter(ddir, other, "vllm", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_refuses_bad_format_and_dtype(tmp_path):
    _, ddir, tdir, _ = _make(tmp_path, "eagle")
    with pytest.raises(ValueError, match="format"):
        export_drafter(ddir, tdir, "tensorrt", tmp_path / "out")
    with pytest.raises(ValueError, match="dtype"):
        export_drafter(ddir, tdir, "vllm", tmp_path / "out", dtype="int8")


def test_refuses_aux_layer_zero_for_sglang(tmp_path):
    _, ddir, tdir, _ = _make(tmp_path, "eagle3", 40, aux=(0, 2, 3))
    with pytest.raises(ValueError, match="SGLang"):
        export_drafter(ddir, tdir, "sglang", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    export_drafter(ddir, tdir, "vllm", tmp_path / "out")  # vLLM id 0 = embeddings is expressible


def test_non_empty_out_dir_and_overwrite(tmp_path):
    _, ddir, tdir, _ = _make(tmp_path, "eagle3", 40)
    out = tmp_path / "out"
    out.mkdir()
    export_drafter(ddir, tdir, "sglang", out)  # an empty dir is fine
    with pytest.raises(ValueError, match="not empty"):
        export_drafter(ddir, tdir, "vllm", out)
    assert json.loads((out / "config.json").read_text())["eagle_config"]  # untouched sglang export
    export_drafter(ddir, tdir, "vllm", out, overwrite=True)
    assert "eagle_config" in json.loads((out / "config.json").read_text())
    assert json.loads((out / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "out", "target"]


def test_incomplete_checkpoint_refused(tmp_path):
    d, ddir, tdir, _ = _make(tmp_path, "eagle3", 40)
    state = {k: v for k, v in d.state_dict().items() if k != "norm.weight"}
    save_file(state, str(ddir / "model.safetensors"))
    with pytest.raises(ValueError, match="incomplete export"):
        export_drafter(ddir, tdir, "vllm", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    _, ddir, tdir, _ = _make(tmp_path, "eagle3", 40)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(export_mod, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        export_drafter(ddir, tdir, "sglang", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "target"]

    # a failed overwrite keeps the previous export intact
    monkeypatch.undo()
    export_drafter(ddir, tdir, "sglang", tmp_path / "out")
    before = (tmp_path / "out" / "config.json").read_text()
    monkeypatch.setattr(export_mod, "save_file", boom)
    with pytest.raises(OSError):
        export_drafter(ddir, tdir, "vllm", tmp_path / "out", overwrite=True)
    assert (tmp_path / "out" / "config.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "out", "target"]
