"""Tiny random transformers models of each supported family (the parity reference)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="parity tests need the [dev] extra (transformers)")

FAMILIES = ("llama", "qwen2", "qwen3")


def hf_config(family: str, **over):
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-6, tie_word_embeddings=False)
    base.update(over)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config}[family]
    if family == "qwen3":
        base.setdefault("head_dim", 16)
    return cls(**base)


def hf_model(family: str, seed: int = 0, **over):
    torch.manual_seed(seed)
    cfg = hf_config(family, **over)
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM}[family]
    model = cls(cfg).eval()
    # Random init leaves norms at 1 and biases at 0; perturb so every tensor matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model

