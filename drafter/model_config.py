"""Decoder architecture config read from a Hugging Face ``config.json``.

Owns the one frozen description of a Llama-family decoder (Llama, Qwen2, Qwen3) that both the
target runner and the drafters are built from, and the translation of the several ways HF
configs spell RoPE settings (``rope_parameters`` in transformers 5, ``rope_theta`` +
``rope_scaling`` before) into one normalized dict.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

# model_type -> (q/k/v bias, o bias, q/k RMSNorm, HF architecture name)
_FAMILIES: dict[str, tuple[bool, bool, bool, str]] = {
    "llama": (False, False, False, "LlamaForCausalLM"),
    "qwen2": (True, False, False, "Qwen2ForCausalLM"),
    "qwen3": (False, False, True, "Qwen3ForCausalLM"),
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    rope_parameters: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0}
    )
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # stop tokens that only the model's generation_config.json lists (an instruct model's turn end,
    # e.g. Llama-3's <|eot_id|>): generation stops on them too, as it does in vLLM and SGLang
    generation_eos_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in _FAMILIES:
            raise ValueError(
                f"model_type={self.model_type!r} is not supported; use one of {sorted(_FAMILIES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; only 'silu'")
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_type={rope_type!r} is not supported; use one of {SUPPORTED_ROPE_TYPES}"
            )
        if rope_type != "default" and "factor" not in self.rope_parameters and rope_type != "yarn":
            raise ValueError(f"rope_parameters for rope_type={rope_type!r} need a 'factor'")

    @property
    def architecture(self) -> str:
        return _FAMILIES[self.model_type][3]

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The stop tokens: config.json's ``eos_token_id``, then generation_config.json's others."""
        own = () if self.eos_token_id is None else \
            (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)
        return tuple(dict.fromkeys(own + self.generation_eos_ids))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in _FAMILIES:
            raise ValueError(
                f"config.json model_type={model_type!r} is not supported; "
                f"use one of {sorted(_FAMILIES)}"
            )
        qkv_bias, o_bias, qk_norm, _ = _FAMILIES[model_type]
        if model_type == "llama":
            qkv_bias = o_bias = bool(raw.get("attention_bias", False))
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rope_parameters=normalize_rope(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=qk_norm,
            hidden_act=raw.get("hidden_act", "silu"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg_file = path / "config.json" if path.is_dir() else path
        if not cfg_file.is_file():
            raise ValueError(f"no config.json at {cfg_file}; pass a Hugging Face model directory")
        raw = _read_json(cfg_file)
        cfg = cls.from_hf_dict(raw)
        gen_file = cfg_file.with_name("generation_config.json")
        if not gen_file.is_file():
            return cfg
        eos = _read_json(gen_file).get("eos_token_id")
        eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        return dataclasses.replace(cfg, generation_eos_ids=tuple(int(t) for t in eos))

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that transformers (and SGLang/vLLM) load as this architecture."""
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": dict(self.rope_parameters),
            # Older loaders read these two keys instead of rope_parameters.
            "rope_theta": self.rope_parameters["rope_theta"],
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.hidden_act,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        }
        if self.model_type == "llama":
            out["attention_bias"] = self.qkv_bias
            out["mlp_bias"] = self.mlp_bias
        if self.rope_parameters.get("rope_type", "default") != "default":
            out["rope_scaling"] = dict(self.rope_parameters)
        return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None


def normalize_rope(raw: dict[str, Any]) -> dict[str, Any]:
    """One ``{"rope_type": ..., "rope_theta": ..., **scaling}`` dict from any HF config spelling."""
    if isinstance(raw.get("rope_parameters"), dict):
        rope = dict(raw["rope_parameters"])
    else:
        rope = dict(raw.get("rope_scaling") or {})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", float(raw.get("rope_theta", 10000.0)))
    rope["rope_theta"] = float(rope["rope_theta"])
    if rope["rope_type"] in ("yarn", "llama3"):
        rope.setdefault(
            "original_max_position_embeddings", raw.get("max_position_embeddings", 2048)
        )
    return rope
