"""EAGLE and EAGLE-3 drafter models and their on-disk checkpoint.

Owns the two single-layer drafters, their frozen config, and save/load. Both reuse the target's
frozen token embedding by reference (a shared tensor, never a copy, never a parameter of the
drafter); EAGLE also reads the target's LM head, EAGLE-3 has its own head over a draft vocabulary
with ``d2t`` (draft id -> target id offset) and ``t2d`` (target id is in the draft vocab) maps.

Pairing convention (EAGLE): the feature ``f_t`` of target position ``t`` is paired with token
``x_{t+1}``; the drafter's output at that slot predicts ``f_{t+1}`` and token ``x_{t+2}``.
Parameter names follow the serving loaders (``fc``, ``layers.0.*``, ``norm``, ``lm_head``) so
export is a rename-free copy.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tlt.drafter.model_core import MLP, Attention, AttentionBackend, RMSNorm, RotaryEmbedding
from tlt.drafter.model_config import ModelConfig

METHODS = ("eagle", "eagle3")
CONFIG_NAME = "tlt_drafter.json"
WEIGHTS_NAME = "model.safetensors"


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3 capture points as HF ``hidden_states`` indices (= input of that decoder layer).

    The serving engines default to (2, L//2, L-3); tiny targets where that repeats a layer get
    three distinct evenly spaced ones instead.
    """
    ids = (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) == 3 and min(ids) >= 1:
        return ids
    return (1, max(2, num_layers // 2), num_layers - 1) if num_layers >= 4 else (1, 1, num_layers)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterConfig:
    method: str
    layer: ModelConfig  # shape of the drafter's decoder layer (hidden size = target's)
    target_vocab_size: int
    target_num_layers: int
    aux_layers: tuple[int, ...] = ()  # EAGLE-3 only
    draft_vocab_size: int = 0  # EAGLE-3 only

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}; use one of {METHODS}")
        if self.method == "eagle3":
            if len(self.aux_layers) != 3:
                raise ValueError(f"EAGLE-3 needs 3 aux layers, got {self.aux_layers}")
            if not all(0 <= i <= self.target_num_layers for i in self.aux_layers):
                raise ValueError(f"aux_layers {self.aux_layers} outside 0..{self.target_num_layers}")
            if not 0 < self.draft_vocab_size <= self.target_vocab_size:
                raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be in "
                                 f"1..{self.target_vocab_size}")

    @classmethod
    def for_target(cls, target: ModelConfig, method: str = "eagle", *,
                   aux_layers: tuple[int, ...] | None = None,
                   draft_vocab_size: int | None = None) -> "DrafterConfig":
        layer = dataclasses.replace(target, model_type="llama", num_hidden_layers=1, qkv_bias=False,
                                    o_bias=False, mlp_bias=False, qk_norm=False,
                                    tie_word_embeddings=False)
        eagle3 = method == "eagle3"
        return cls(method=method, layer=layer, target_vocab_size=target.vocab_size,
                   target_num_layers=target.num_hidden_layers,
                   aux_layers=tuple(aux_layers or default_aux_layers(target.num_hidden_layers)) if eagle3 else (),
                   draft_vocab_size=(draft_vocab_size or target.vocab_size) if eagle3 else 0)

    def check_target(self, target: ModelConfig) -> None:
        """ValueError unless ``target`` is the model this drafter was built for."""
        if (target.hidden_size, target.vocab_size, target.num_hidden_layers) != (
                self.layer.hidden_size, self.target_vocab_size, self.target_num_layers):
            raise ValueError(
                f"drafter/target mismatch: drafter expects hidden={self.layer.hidden_size}, "
                f"vocab={self.target_vocab_size}, layers={self.target_num_layers}; target has "
                f"hidden={target.hidden_size}, vocab={target.vocab_size}, "
                f"layers={target.num_hidden_layers}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer"] = self.layer.to_hf_dict()
        d["aux_layers"] = list(self.aux_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DrafterConfig":
        return cls(method=d["method"], layer=ModelConfig.from_hf_dict(d["layer"]),
                   target_vocab_size=d["target_vocab_size"], target_num_layers=d["target_num_layers"],
                   aux_layers=tuple(d.get("aux_layers", ())), draft_vocab_size=d.get("draft_vocab_size", 0))


class _EagleLayer(nn.Module):
    """EAGLE decoder layer: no input norm (the fc output feeds attention directly)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, 0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, backend):  # x: [B, T, H] -> [B, T, H]
        x = x + self.self_attn(x, cos, sin, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Eagle3Layer(nn.Module):
    """EAGLE-3 layer: attention reads [input_layernorm(embed) ; hidden_norm(hidden)] (2H)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 0, input_size=2 * h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, emb, x, cos, sin, backend):  # emb, x: [B, T, H] -> [B, T, H]
        attn_in = torch.cat([self.input_layernorm(emb), self.hidden_norm(x)], dim=-1)
        x = x + self.self_attn(attn_in, cos, sin, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    """One drafting step over a sequence: ``(token, feature) -> next feature``; ``logits()`` reads it.

    ``Drafter(cfg, ...)`` builds the class of ``cfg.method`` (:class:`EagleDrafter` or
    :class:`Eagle3Drafter`); everything that differs between the methods lives in those two
    classes, so callers never switch on the method name.
    """

    feature_layers: tuple[int, ...] = ()  # target layers whose inputs form the feature; () = last hidden
    regresses_features = True  # its features are the target's: training may regress them (drafter.ttt)

    def __new__(cls, cfg: DrafterConfig, *args: Any, **kwargs: Any) -> "Drafter":
        if cls is Drafter:
            cls = EagleDrafter if cfg.method == "eagle" else Eagle3Drafter
        return super().__new__(cls)

    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor,
                 target_head_weight: torch.Tensor) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.layer.hidden_size
        if embed_weight.shape != (cfg.target_vocab_size, h):
            raise ValueError(f"target embedding has shape {tuple(embed_weight.shape)}, drafter "
                             f"expects {(cfg.target_vocab_size, h)}")
        # Shared by reference and kept out of parameters()/state_dict(): never trained, never saved.
        self.__dict__["embed_weight"] = embed_weight
        self.__dict__["target_head_weight"] = target_head_weight
        self.rotary = RotaryEmbedding(cfg.layer)

    @property
    def input_feature_size(self) -> int:
        """Width of the target feature at step 0 (H for EAGLE, 3H for EAGLE-3)."""
        return self.config.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        """Columns of :meth:`logits`: the draft vocabulary (EAGLE-3) or the target's."""
        return self.config.draft_vocab_size or self.config.target_vocab_size

    def training_feature(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """The target feature the drafter is trained on, from the post-norm last hidden state
        [.., H] and the concatenated aux layers [.., 3H] (None when not captured)."""
        return hidden

    def forward(self, input_ids: torch.Tensor, feature: torch.Tensor, position_ids: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        # input_ids, position_ids: [B, T]; feature: [B, T, H] (or [B, T, 3H] target aux at step 0)
        # -> next feature [B, T, H]
        raise NotImplementedError

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        # feature: [..., H] -> [..., V] (target vocabulary, or the drafter's own)
        raise NotImplementedError

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Map ids of the drafter's vocabulary to target ids (identity when they are the same)."""
        return ids

    def target_logits_to_draft(self, logits: torch.Tensor) -> torch.Tensor:
        """Select the draft-vocabulary columns of target logits [..., V] -> [..., Vd]."""
        return logits

    def fit_vocab(self, token_counts: torch.Tensor) -> None:
        """Choose the draft vocabulary from target token counts [V] (no-op: EAGLE has none)."""

    # ------------------------------------------------------------------ checkpoint I/O
    def save(self, path: str | Path, *, extra: dict[str, Any] | None = None) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
        (path / CONFIG_NAME).write_text(json.dumps({**self.config.to_dict(), **(extra or {})}, indent=2))

    @classmethod
    def load(cls, path: str | Path, embed_weight: torch.Tensor,
             target_head_weight: torch.Tensor) -> "Drafter":
        cfg = read_config(path)
        model = cls(cfg, embed_weight, target_head_weight)
        state = load_file(str(Path(path) / WEIGHTS_NAME))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{path}: drafter checkpoint does not match its config "
                             f"(missing {missing[:4]}, unexpected {unexpected[:4]})")
        return model.to(embed_weight.device)


class EagleDrafter(Drafter):
    """EAGLE: ``fc([embed ; feature])`` feeds one decoder layer; logits through the target's head."""

    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor, target_head_weight: torch.Tensor) -> None:
        super().__init__(cfg, embed_weight, target_head_weight)
        h = cfg.layer.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([_EagleLayer(cfg.layer)])

    def forward(self, input_ids, feature, position_ids, backend):
        emb = nn.functional.embedding(input_ids, self.embed_weight).to(feature.dtype)
        cos, sin = self.rotary(position_ids, feature.dtype)
        return self.layers[0](self.fc(torch.cat([emb, feature], dim=-1)), cos, sin, backend)

    def logits(self, feature):
        return feature @ self.target_head_weight.t().to(feature.dtype)


class Eagle3Drafter(Drafter):
    """EAGLE-3: the target's low/mid/high layer inputs, fused by ``fc`` at step 0, and the embedding
    feed a layer over ``[embed ; hidden]``; own head over a draft vocabulary (``d2t`` / ``t2d``)."""

    regresses_features = False

    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor, target_head_weight: torch.Tensor) -> None:
        super().__init__(cfg, embed_weight, target_head_weight)
        h = cfg.layer.hidden_size
        self.feature_layers = cfg.aux_layers
        self.fc = nn.Linear(len(cfg.aux_layers) * h, h, bias=False)
        self.layers = nn.ModuleList([_Eagle3Layer(cfg.layer)])
        self.norm = RMSNorm(h, cfg.layer.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.target_vocab_size, dtype=torch.bool))

    @property
    def input_feature_size(self) -> int:
        return self.fc.in_features

    def training_feature(self, hidden, aux):
        if aux is None:
            raise ValueError("EAGLE-3 trains on the target's aux layers; capture them (aux_layers)")
        return aux

    def forward(self, input_ids, feature, position_ids, backend):
        emb = nn.functional.embedding(input_ids, self.embed_weight).to(feature.dtype)
        cos, sin = self.rotary(position_ids, feature.dtype)
        if feature.shape[-1] != self.config.layer.hidden_size:
            feature = self.fc(feature)
        return self.layers[0](emb, feature, cos, sin, backend)

    def logits(self, feature):
        return self.lm_head(self.norm(feature))

    def draft_to_target(self, ids):
        return ids + self.d2t[ids]

    def target_logits_to_draft(self, logits):
        return logits[..., torch.arange(self.config.draft_vocab_size, device=logits.device) + self.d2t]

    def fit_vocab(self, token_counts: torch.Tensor) -> None:
        self.set_vocab_map(vocab_by_frequency(token_counts, self.config.draft_vocab_size))

    def set_vocab_map(self, draft_to_target_ids: torch.Tensor) -> None:
        """Install the draft vocabulary given as sorted target ids [Vd]."""
        ids = draft_to_target_ids.to(self.d2t.device)
        if ids.shape != self.d2t.shape:
            raise ValueError(f"draft vocab map has {ids.numel()} ids, config says {self.d2t.numel()}")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True


def read_config(path: str | Path) -> DrafterConfig:
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise ValueError(f"{path}: no {CONFIG_NAME}; pass a directory written by `tlt warmup`")
    return DrafterConfig.from_dict(json.loads(file.read_text()))


def vocab_by_frequency(token_counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent target ids, sorted ascending (the EAGLE-3 draft vocabulary)."""
    if size > token_counts.numel():
        raise ValueError(f"draft vocab size {size} exceeds target vocab {token_counts.numel()}")
    order = torch.sort(-token_counts.double(), stable=True).indices  # ties: lower id first
    return order[:size].sort().values
