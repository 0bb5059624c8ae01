"""Export a trained drafter as a checkpoint the serving engines load (SGLang, vLLM).

Owns the per-loader export spec (architecture strings, tensor names/shapes/dtypes, config keys)
and the atomic writer. The facts behind every choice are in ``docs/export_formats.md``
(SGLang 0.5.12-0.5.23, vLLM 0.33); section numbers below refer to it. One export targets one
loader: ``fmt="sglang"`` or ``fmt="vllm"``, each with a minimal tensor set, because the
loaders disagree on the EAGLE-1 architecture name, on ``fc.bias`` and on the aux-layer id
numbering. Neither loader checks for missing tensors (a missing one is silently garbage), so the
export validates the full tensor set against :func:`expected_tensors` before writing.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tlt.drafter.eagle import METHODS, WEIGHTS_NAME, DrafterConfig, read_config
from tlt.drafter.model_config import ModelConfig

log = logging.getLogger(__name__)
EXPORT_FILES = frozenset({"config.json", WEIGHTS_NAME})  # all an export writes

FORMATS = ("sglang", "vllm")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# (method, fmt) -> config.json "architectures" (section 1-4: architectures[0] is resolved first).
ARCHITECTURES: dict[tuple[str, str], list[str]] = {
    ("eagle", "sglang"): ["LlamaForCausalLMEagle"],  # no alias for the vLLM name in SGLang
    ("eagle", "vllm"): ["EagleLlamaForCausalLM"],  # vLLM would rename SGLang's to an unknown one
    ("eagle3", "sglang"): ["LlamaForCausalLMEagle3"],
    ("eagle3", "vllm"): ["LlamaForCausalLMEagle3"],  # registered alias of Eagle3LlamaForCausalLM
}


def _check_choice(method: str, fmt: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method={method!r}; use one of {METHODS}")
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r}; use one of {FORMATS}")


def expected_tensors(method: str, fmt: str, H: int, I: int, n_heads: int, n_kv: int,
                     head_dim: int, V: int, Vd: int, n_aux: int = 3
                     ) -> dict[str, tuple[tuple[int, ...], str]]:
    """Exact tensor set one loader needs: name -> (shape, dtype kind "float" | "int64").

    The drafter's hidden size equals the target's, so ``target_hidden_size`` (Ht) is H here.
    Never ``model.``-prefixed, never ``embed_tokens`` (both loaders take the target's, section 5.7).
    """
    _check_choice(method, fmt)
    q, kv = n_heads * head_dim, n_kv * head_dim
    return _BY_METHOD[method].tensors(fmt, H, I, q, kv, V, Vd, n_aux)


def _layer_tensors(H: int, I: int, q: int, kv: int, attn_in: int, fc_in: int
                   ) -> dict[str, tuple[tuple[int, ...], str]]:
    p = "layers.0."
    return {
        "fc.weight": ((H, fc_in), "float"),
        p + "self_attn.q_proj.weight": ((q, attn_in), "float"),
        p + "self_attn.k_proj.weight": ((kv, attn_in), "float"),
        p + "self_attn.v_proj.weight": ((kv, attn_in), "float"),
        p + "self_attn.o_proj.weight": ((H, q), "float"),
        p + "mlp.gate_proj.weight": ((I, H), "float"),
        p + "mlp.up_proj.weight": ((I, H), "float"),
        p + "mlp.down_proj.weight": ((H, I), "float"),
        p + "post_attention_layernorm.weight": ((H,), "float"),
    }


class _EagleExport:
    """EAGLE-1: fc over [embed ; hidden], no head of its own; SGLang's fc has a bias."""

    def draft_vocab(self, dcfg: DrafterConfig) -> int:
        return dcfg.target_vocab_size

    def tensors(self, fmt, H, I, q, kv, V, Vd, n_aux):
        spec = _layer_tensors(H, I, q, kv, attn_in=H, fc_in=2 * H)
        # SGLang's fc has bias=True and would keep a random init without it (section 1); vLLM
        # drops any .bias anyway (section 0), so it is left out there. Layer-0 input_layernorm,
        # norm and lm_head make vLLM raise and are ignored by SGLang: never written.
        if fmt == "sglang":
            spec["fc.bias"] = ((H,), "float")
        return spec

    def check(self, dcfg, fmt, state, weights, V, Vd) -> None:
        return None

    def config(self, cfg, dcfg, fmt, target, Vd) -> None:
        return None


class _Eagle3Export:
    """EAGLE-3: fc over the aux layers, a layer over [embed ; hidden], own norm, head and d2t."""

    def draft_vocab(self, dcfg: DrafterConfig) -> int:
        return dcfg.draft_vocab_size

    def tensors(self, fmt, H, I, q, kv, V, Vd, n_aux):
        spec = _layer_tensors(H, I, q, kv, attn_in=2 * H, fc_in=n_aux * H)  # attention reads [embed ; hidden]
        p = "layers.0."
        spec.update({
            p + "input_layernorm.weight": ((H,), "float"),
            p + "hidden_norm.weight": ((H,), "float"),
            "norm.weight": ((H,), "float"),
            "lm_head.weight": ((Vd, H), "float"),
        })
        # vLLM has no d2t parameter when Vd == V and raises if one is present (section 4). t2d is
        # skipped by both loaders, so it is never written (d2t alone defines the vocab map).
        if Vd < V:
            spec["d2t"] = ((Vd,), "int64")
        return spec

    def check(self, dcfg, fmt, state, weights, V, Vd) -> None:
        if fmt == "sglang" and min(dcfg.aux_layers) < 1:
            raise ValueError(f"aux_layers {dcfg.aux_layers}: SGLang cannot capture hidden_states[0] "
                             "(the embeddings); retrain with aux layers >= 1")
        d2t = state.get("d2t")
        if d2t is None:
            raise ValueError(f"incomplete export: {weights} has no d2t vocab map")
        ids = torch.arange(d2t.numel()) + d2t.long()  # draft id -> target id
        if ids.numel() != Vd or ids.min() < 0 or ids.max() >= V or ids.unique().numel() != Vd:
            raise ValueError(f"{weights}: d2t does not map {Vd} draft ids to distinct target ids")
        if Vd == V and bool(d2t.any()):
            raise ValueError("d2t is not the identity but draft vocab == target vocab; the "
                             "loaders drop d2t in that case (vLLM) - cannot export")

    def config(self, cfg, dcfg, fmt, target, Vd) -> None:
        aux_layers = dcfg.aux_layers
        cfg.update(draft_vocab_size=Vd, target_hidden_size=target.hidden_size,
                   num_aux_hidden_states=len(aux_layers))
        if fmt == "sglang":
            # SGLang reads only eagle_config's ids and captures the input of layer id+1 (section 2).
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in aux_layers],
                                   "use_aux_hidden_state": True}
        else:
            # vLLM reads the top-level key first, in its own numbering (= HF hidden_states index).
            # The nested ids key is left out so no runner can fall back to SGLang-numbered ids.
            cfg["eagle_aux_hidden_state_layer_ids"] = list(aux_layers)
            cfg["eagle_config"] = {"use_aux_hidden_state": True}


_BY_METHOD = {"eagle": _EagleExport(), "eagle3": _Eagle3Export()}


def _config_json(dcfg: DrafterConfig, fmt: str, target: ModelConfig, draft_vocab: int,
                 dtype: str) -> dict[str, Any]:
    layer = dcfg.layer
    cfg = layer.to_hf_dict()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "rope_scaling"):
        cfg.pop(key, None)
    t = target.to_hf_dict()
    # RoPE and context length come from the target: SGLang 0.5.23 raises if the draft's
    # max_position_embeddings x rope factor is below the target's context (section 0).
    for key in ("rope_parameters", "rope_theta", "rope_scaling", "max_position_embeddings"):
        if key in t:
            cfg[key] = t[key]
    if layer.rope_parameters != target.rope_parameters:
        log.warning("drafter was trained with rope %s; export uses the target's %s",
                    layer.rope_parameters, target.rope_parameters)
    cfg.update(architectures=ARCHITECTURES[dcfg.method, fmt], model_type="llama", num_hidden_layers=1,
               vocab_size=target.vocab_size, hidden_act="silu", tie_word_embeddings=False,
               attention_bias=False, mlp_bias=False, bias=False, torch_dtype=dtype)
    _BY_METHOD[dcfg.method].config(cfg, dcfg, fmt, target, draft_vocab)
    return cfg


def _validate(tensors: dict[str, torch.Tensor], spec: dict[str, tuple[tuple[int, ...], str]],
              dtype: torch.dtype) -> None:
    missing = sorted(set(spec) - set(tensors))
    extra = sorted(set(tensors) - set(spec))
    bad = [f"{n}: {tuple(t.shape)} {t.dtype}, want {spec[n][0]} "
           f"{dtype if spec[n][1] == 'float' else torch.int64}"
           for n, t in sorted(tensors.items()) if n in spec and (
               tuple(t.shape) != spec[n][0]
               or t.dtype != (dtype if spec[n][1] == "float" else torch.int64))]
    if missing or extra or bad:
        raise ValueError(f"incomplete export: missing {missing}, unexpected {extra}, "
                         f"wrong shape/dtype {bad}")


def format_tensors(dcfg: DrafterConfig, fmt: str, state: dict[str, torch.Tensor], dtype: torch.dtype, *,
                   source: Any = "drafter") -> dict[str, torch.Tensor]:
    """A drafter's state dict as the ``fmt`` loader's tensors (names, extra zeros, dtype): what an
    export writes, and what a draft-only push into a running server sends. ValueError if incomplete."""
    _check_choice(dcfg.method, fmt)
    lc, method = dcfg.layer, _BY_METHOD[dcfg.method]
    V, Vd = dcfg.target_vocab_size, method.draft_vocab(dcfg)
    spec = expected_tensors(dcfg.method, fmt, lc.hidden_size, lc.intermediate_size,
                            lc.num_attention_heads, lc.num_key_value_heads, lc.head_dim, V, Vd,
                            n_aux=len(dcfg.aux_layers) or 3)
    tensors: dict[str, torch.Tensor] = {}
    for name, (shape, kind) in spec.items():
        if name == "fc.bias":  # trained without bias: zeros keep SGLang's fc exact
            tensors[name] = torch.zeros(shape, dtype=dtype)
        elif name in state:
            t = state[name]
            tensors[name] = (t.to(dtype) if kind == "float" else t).contiguous()
    method.check(dcfg, fmt, state, source, V, Vd)
    dropped = sorted(set(state) - set(tensors) - {"d2t", "t2d"})
    if dropped:
        log.info("not exported (unused by %s): %s", fmt, dropped)
    _validate(tensors, spec, dtype)
    return tensors


def export_drafter(drafter_dir: str | Path, target_dir: str | Path, fmt: str,
                   out_dir: str | Path, *, dtype: str = "bfloat16",
                   overwrite: bool = False) -> dict[str, Any]:
    """Write ``out_dir/{config.json,model.safetensors}`` for the ``fmt`` loader.

    Returns ``{format, method, architectures, num_tensors, bytes, out_dir}``. Raises ValueError on a
    drafter/target mismatch, a non-empty ``out_dir`` without ``overwrite``, an ``out_dir`` that is not
    an earlier export (``overwrite`` replaces only one: never the drafter, the target, or a folder
    holding anything else), or an incomplete export.
    """
    drafter_dir, out_dir = Path(drafter_dir), Path(out_dir)
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; use one of {sorted(DTYPES)}")
    dcfg = read_config(drafter_dir)
    _check_choice(dcfg.method, fmt)
    target = ModelConfig.from_pretrained(target_dir)
    dcfg.check_target(target)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not overwrite:
            raise ValueError(f"{out_dir} is not empty; replace it with --overwrite (overwrite=True)")
        other = sorted(p.name for p in out_dir.iterdir() if p.name not in EXPORT_FILES)
        if other:
            raise ValueError(f"{out_dir} is not an earlier export (it holds {', '.join(other[:3])}), so "
                             "--overwrite would delete it; choose a new directory")
    weights = drafter_dir / WEIGHTS_NAME
    if not weights.is_file():
        raise ValueError(f"{drafter_dir}: no {WEIGHTS_NAME}")
    state = load_file(str(weights))

    torch_dtype = DTYPES[dtype]
    tensors = format_tensors(dcfg, fmt, state, torch_dtype, source=weights)
    Vd = _BY_METHOD[dcfg.method].draft_vocab(dcfg)
    config = _config_json(dcfg, fmt, target, Vd, dtype)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    old: Path | None = None  # holds a replaced out_dir until the new one is in place
    try:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        size = (tmp / WEIGHTS_NAME).stat().st_size
        if out_dir.exists():  # empty, or overwrite=True: move aside, swap in, then delete
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            out_dir.rename(old / "prev")
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            if (old / "prev").exists() and not out_dir.exists():
                (old / "prev").rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    summary = {"format": fmt, "method": dcfg.method, "architectures": config["architectures"],
               "num_tensors": len(tensors), "bytes": size, "out_dir": str(out_dir)}
    log.info("exported %s drafter for %s: %d tensors, %.1f MB -> %s", dcfg.method, fmt,
             len(tensors), size / 1e6, out_dir)
    return summary
