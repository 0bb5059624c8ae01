"""The target model: a Llama-family decoder loaded from HF safetensors.

Owns the module tree (HF parameter names, so checkpoints load without renaming), loading and
saving in HF format (single file or sharded index), and the forward pass over explicit positions
with a pluggable attention backend (static KV cache + tree mask during rollout) that also returns
the hidden states the drafters need: the post-norm last hidden state (EAGLE) and the inputs of
chosen decoder layers (EAGLE-3 low/mid/high; index ``i`` equals HF ``hidden_states[i]``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tlt.drafter.model_core import AttentionBackend, CausalBackend, DecoderLayer, RMSNorm, RotaryEmbedding
from tlt.drafter.model_config import ModelConfig


@dataclasses.dataclass
class TargetOutput:
    logits: torch.Tensor | None  # [B, T, V]
    hidden: torch.Tensor  # [B, T, H] post-norm (what the LM head reads)
    aux: dict[int, torch.Tensor]  # layer index -> [B, T, H] input of that layer


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TargetModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg)

    @property
    def embed_weight(self) -> torch.Tensor:  # [V, H]
        return self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                backend: AttentionBackend | None = None, *, capture: tuple[int, ...] = (),
                logits: bool = True) -> TargetOutput:
        # input_ids, position_ids: [B, T]
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        backend = backend or CausalBackend()
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(position_ids, x.dtype)
        aux: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in capture:
                aux[i] = x
            x = layer(x, cos, sin, backend)
        if len(self.model.layers) in capture:
            aux[len(self.model.layers)] = x
        hidden = self.model.norm(x)
        return TargetOutput(self.lm_head(hidden) if logits else None, hidden, aux)

    # ---------------------------------------------------------------- HF checkpoint I/O
    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "TargetModel":
        path = Path(path)
        cfg = ModelConfig.from_pretrained(path)
        state = load_hf_state_dict(path)
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to_empty(device=device)
        model.rotary = RotaryEmbedding(cfg).to(device)
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
            model.lm_head.weight = model.model.embed_tokens.weight
        expected = set(model.state_dict())
        if cfg.tie_word_embeddings:
            expected.discard("lm_head.weight")
        got = set(state)
        missing, unexpected = expected - got, got - expected
        unexpected = {k for k in unexpected if not k.endswith("rotary_emb.inv_freq")}
        if missing:
            raise ValueError(f"{path}: checkpoint lacks {sorted(missing)[:5]} "
                             f"({len(missing)} tensors missing) for {cfg.architecture}")
        if unexpected:
            raise ValueError(f"{path}: checkpoint has tensors this {cfg.architecture} does not use: "
                             f"{sorted(unexpected)[:5]}")
        for name, p in model.state_dict().items():
            if name in state:
                if tuple(state[name].shape) != tuple(p.shape):
                    raise ValueError(f"{path}: {name} has shape {tuple(state[name].shape)}, "
                                     f"config.json implies {tuple(p.shape)}")
        model.load_state_dict(state, strict=False)
        return model.to(dtype).eval()

    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(self.config.to_hf_dict(), indent=2))


def load_hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a HF model directory: ``model.safetensors`` or a sharded index."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            state.update(load_file(str(path / shard)))
        return state
    if single.is_file():
        return load_file(str(single))
    raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json "
                     "(only safetensors checkpoints are loaded)")
