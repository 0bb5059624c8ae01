"""The drafter tensors a draft-only push sends into an SGLang server, and what the guard reads back.

Owns the sources of a push (a spot checkpoint step, or an exported SGLang-format drafter such as
the one the servers started with), their conversion to SGLang's draft-model tensors
(:func:`tlt.drafter.export.format_tensors`, the names an export writes), and the hard check's canary:
the draft ``fc`` weight (unfused in SGLang's EAGLE and EAGLE-3 draft models, replicated across TP
ranks, and trained), read back by name through TLT's SGLang plugin.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tlt.drafter.digest import canary_digest, checkpoint_weights
from tlt.drafter.eagle import WEIGHTS_NAME, DrafterConfig, read_config

# the canary tensor: its name in a drafter / checkpoint / export, and in SGLang's draft model
CANARY = {"pushed": "fc.weight", "served": "model.fc.weight"}


def drafter_config(cfg, model_path: str | Path) -> DrafterConfig:
    """The run's drafter shape: the warm-up drafter's, else the method's default for the target."""
    from tlt.drafter.model_config import ModelConfig

    if cfg.drafter.init_path:
        return read_config(cfg.drafter.init_path)
    return DrafterConfig.for_target(ModelConfig.from_pretrained(model_path), cfg.drafter.method)


def source_tensors(source: dict, dcfg: DrafterConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """SGLang draft-model tensors of a push source: ``{"kind": "spot", "root", "step"}`` or
    ``{"kind": "export", "path"}`` (an SGLang-format drafter directory)."""
    from safetensors.torch import load_file

    from tlt.drafter.export import format_tensors

    if source["kind"] == "spot":
        return format_tensors(dcfg, "sglang", checkpoint_weights(source["root"], int(source["step"])), dtype)
    if source["kind"] == "export":
        return {k: (v.to(dtype) if v.is_floating_point() else v)
                for k, v in load_file(str(Path(source["path"]) / WEIGHTS_NAME)).items()}
    raise ValueError(f"unknown drafter push source {source!r}")


def expected_canary(root: str | Path, step: int, dtype: torch.dtype, elements: int) -> str:
    """The canary digest a server serving spot checkpoint ``step`` in ``dtype`` must read back."""
    w = checkpoint_weights(root, step)[CANARY["pushed"]]
    return canary_digest([(CANARY["pushed"], w)], dtype, elements)
