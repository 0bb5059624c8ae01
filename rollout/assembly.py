"""How an engine's speculation is assembled: its proposers, its tuner and a fixed strategy.

Owns the conventions every front end shares (``tlt rollout`` and a verl replica):
- the EAGLE drafter is the main proposer (name ``""``); the model-free suffix drafter is named
  :data:`SUFFIX`, an arm beside EAGLE or the only proposer;
- the EAGLE proposer's cache covers the engine's longest sequence plus its largest draft tree;
- the BEG-MAB tuner learns over the proposers present, unless a strategy is fixed;
- a fixed strategy drafts with EAGLE when the engine has it, else with the suffix drafter.
"""

from __future__ import annotations

import dataclasses

from tlt.drafter.eagle import Drafter
from tlt.rollout.draft_tree import Proposer
from tlt.rollout.eagle_proposer import EagleProposer
from tlt.rollout.engine import EngineConfig
from tlt.rollout.suffix import SuffixProposer
from tlt.rollout.strategy import Arm
from tlt.rollout.tuner import BegMab, TunerConfig

SUFFIX = "suffix"  # the model-free drafter's proposer name in arms (``d4k1v4@suffix``)


def proposers(cfg: EngineConfig, *, drafter: Drafter | None = None,
              suffix: SuffixProposer | None = None) -> dict[str, Proposer]:
    """The engine's proposers by name: EAGLE over ``drafter`` (sized for ``cfg``), the suffix drafter."""
    out: dict[str, Proposer] = {}
    if drafter is not None:
        out[""] = EagleProposer(drafter, max_batch=cfg.max_batch, max_len=cfg.max_len + cfg.max_draft_tokens + 8)
    if suffix is not None:
        out[SUFFIX] = suffix
    return out


def tuner(named: dict[str, Proposer], *, device: str, seed: int, fixed: Arm | None) -> BegMab | None:
    """BEG-MAB over the proposers in ``named`` (None: nothing to tune, or a fixed strategy)."""
    if not named or fixed is not None:
        return None
    return BegMab(TunerConfig.for_device(device, proposers=tuple(sorted(named)), seed=seed))


def fixed_arm(arm: Arm | None, named: dict[str, Proposer]) -> Arm | None:
    """A fixed strategy as the engine runs it: with the suffix drafter alone it drafts there."""
    if arm is None or arm.is_off or "" in named or SUFFIX not in named:
        return arm
    return dataclasses.replace(arm, proposer=SUFFIX)
