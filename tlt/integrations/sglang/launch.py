"""How a TLT run starts its SGLang servers: which speculation, which drafter, which arguments.

Owns the start-up plan of an SGLang rollout replica in a ``tlt`` run (no restart mid-run):

==========================  =============================================================
SGLang / ``tlt.*``          servers start with
==========================  =============================================================
0.5.23, EAGLE               EAGLE (EAGLE3 for ``drafter.method=eagle3``) with the warm-up
                            drafter, or a freshly initialised one: the tuner's
                            steps=0 arm keeps speculation off while the drafter is useless,
                            and draft-only pushes make it useful
0.5.12, EAGLE               the warm-up drafter (``tlt.drafter.init_path``); 0.5.12 has no
                            steps=0, so without one the run is refused (one line naming
                            ``tlt warmup``, SGLang 0.5.23 and ``tlt.sglang.algorithm=ngram``)
``sglang.algorithm=ngram``  SGLang's NGRAM for the whole run (its trie holds the running
                            requests, so GRPO siblings draft from each other; earlier steps'
                            responses join as external corpus); no drafter is trained
==========================  =============================================================

and the server arguments (SGLang ``ServerArgs`` field names) for each. Pure Python: SGLang is
never imported here (its version is read from the installed distribution's metadata), so the
driver validates a run before Ray starts.
"""

from __future__ import annotations

import importlib.metadata
import logging
from pathlib import Path
from typing import Any

import torch

from tlt.integrations.sglang.hook_table import SUPPORTED, version_key

log = logging.getLogger(__name__)

# SGLang 0.5.12's draft-only push: a --custom-weight-loader that loads only into the draft model
DRAFT_LOADER = "tlt.integrations.sglang.draft_loader.load_draft_only"
NGRAM_DEFAULTS = {"speculative_num_draft_tokens": 8}  # SGLang's n-gram drafts per verify
# The tuner's starting step count (one of TLT's candidate steps). SGLang 0.5.12 refuses a
# topk without the step count, and a chain verifies steps + 1 tokens.
EAGLE_START_STEPS = 3


def installed_version() -> str | None:
    """The installed SGLang's version, without importing it (None: not installed)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def has_steps0(version: str) -> bool:
    """Whether SGLang's adaptive speculation has a steps=0 (plain decode) arm: 0.5.23 on."""
    return version_key(version) >= version_key("0.5.23")


def plan(tlt, version: str | None) -> str:
    """``"ngram"``, ``"eagle-warm"`` (the warm-up drafter) or ``"eagle-fresh"`` (a new one);
    ValueError, naming the fix, when this SGLang cannot run the configured speculation."""
    if version is None:
        raise ValueError("actor_rollout_ref.rollout.name=sglang but SGLang is not installed: "
                         "pip install 'tlt-rollout[sglang]' (SGLang 0.5.12 or 0.5.23)")
    if version_key(version) not in set(map(version_key, SUPPORTED)):  # hooks and formats are tested there only
        raise ValueError(f"SGLang {version}: TLT supports {' and '.join(SUPPORTED)}; "
                         f"pip install 'sglang=={SUPPORTED[-1]}'")
    if tlt.sglang.algorithm == "ngram":
        return "ngram"
    if tlt.drafter.init_path:
        return "eagle-warm"
    if not has_steps0(version):
        raise ValueError(f"tlt.drafter.init_path=null with SGLang {version}: it has no steps=0, so a fresh "
                         "drafter would slow every step until training makes it useful; give a warm-up "
                         "drafter (`tlt warmup`), use SGLang 0.5.23, or set tlt.sglang.algorithm=ngram")
    return "eagle-fresh"


def speculation_args(drafter_path: str | None, *, max_running_requests: int) -> dict[str, Any]:
    """EAGLE (with ``drafter_path``) or NGRAM server arguments, either SGLang version."""
    if isinstance(max_running_requests, bool) or not isinstance(max_running_requests, int) \
            or max_running_requests < 1:
        raise ValueError(f"max_running_requests={max_running_requests!r}: give the rollout batch (an int >= 1); "
                         "speculative SGLang otherwise caps it at 48")
    if drafter_path:
        return {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": str(drafter_path),
                "speculative_eagle_topk": 1, "speculative_num_steps": EAGLE_START_STEPS,
                "speculative_num_draft_tokens": EAGLE_START_STEPS + 1, "speculative_adaptive": True,
                "max_running_requests": max_running_requests}
    return {"speculative_algorithm": "NGRAM", **NGRAM_DEFAULTS, "max_running_requests": max_running_requests}


def server_args(tlt, *, version: str, drafter_path: str | None, max_running_requests: int) -> dict[str, Any]:
    """SGLang server arguments for one replica of this run (``drafter_path``: the SGLang-format
    drafter the servers start with; None with ``algorithm=ngram``)."""
    p = plan(tlt, version)
    if p == "ngram":  # SGLang encodes the draft history's documents with its own tokenizer, which
        # verl's default (skip_tokenizer_init) leaves out: every /add_external_corpus would fail
        return {**speculation_args(None, max_running_requests=max_running_requests), "skip_tokenizer_init": False}
    if not drafter_path:
        raise ValueError(f"plan {p}: an exported drafter directory is needed")
    args = speculation_args(drafter_path, max_running_requests=max_running_requests)
    if tlt.drafter.method == "eagle3":
        args["speculative_algorithm"] = "EAGLE3"
    if tlt.sglang.adaptive_config:
        args["speculative_adaptive_config"] = tlt.sglang.adaptive_config
    if not has_steps0(version):  # 0.5.12: draft-only pushes go through TLT's loader
        args["custom_weight_loader"] = [DRAFT_LOADER]
    return args


def frozen_tensors(model_path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding and LM head [V, H] read from its safetensors (no model built)."""
    from safetensors import safe_open

    want = {"model.embed_tokens.weight": None, "lm_head.weight": None}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in want:
                if name in st.keys():
                    want[name] = st.get_tensor(name)
    embed = want["model.embed_tokens.weight"]
    if embed is None:
        raise ValueError(f"{model_path}: no model.embed_tokens.weight in its safetensors")
    return embed, want["lm_head.weight"] if want["lm_head.weight"] is not None else embed  # tied


def start_drafter(tlt, model_path: str | Path, out_dir: str | Path, *, seed: int = 0) -> Path:
    """The SGLang-format drafter the servers start with, written under ``out_dir``: the warm-up
    drafter exported, or (``eagle-fresh``) a freshly initialised one. Returns its directory."""
    from tlt.drafter.eagle import Drafter, DrafterConfig
    from tlt.drafter.export import export_drafter
    from tlt.drafter.model_config import ModelConfig

    out_dir = Path(out_dir)
    src = tlt.drafter.init_path
    if not src:
        torch.manual_seed(seed)
        embed, head = frozen_tensors(model_path)
        cfg = DrafterConfig.for_target(ModelConfig.from_pretrained(model_path), tlt.drafter.method)
        src = out_dir / "fresh"
        Drafter(cfg, embed, head).save(src)
    export_drafter(src, model_path, "sglang", out_dir / "sglang", overwrite=True)
    log.info("SGLang servers start with drafter %s (%s)", out_dir / "sglang", "warm-up" if tlt.drafter.init_path
             else "freshly initialised")
    return out_dir / "sglang"
