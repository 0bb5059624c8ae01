"""The engine one replica serves with: target, proposers, tuner and feature sink (no Ray, no verl).

Owns :class:`ReplicaEngine`, which the replica's Ray actor wraps (proposers, tuner and a fixed
strategy assembled by :mod:`tlt.rollout.assembly`, as ``tlt rollout`` assembles its engine). Proposers are arms, not
fallbacks: the model-free suffix drafter (the prompt, the live GRPO group, the same prompt's
responses from its last ``tlt.speculation.history_visits`` rollouts and a global pool of recent
responses; :mod:`tlt.rollout.history`) is an arm from the first step, and the EAGLE drafter joins it
once one exists; BEG-MAB learns per batch-size bucket which one (or neither: ``off``) pays.

Drafter swaps touch only the drafter: the EAGLE proposer is replaced in the running engine (its
KV cache, feature buffer and the suffix drafter's state stay), and what the tuner learned about
the old drafter is forgotten (a new drafter's acceptance is not the old one's); the suffix arms
keep theirs. Not thread-safe: the replica calls it between batches (under its serving lock).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence

from tlt.drafter.seeds import replica_seed
from tlt.drafter.digest import module_digest
from tlt.drafter.eagle import Drafter, DrafterConfig
from tlt.rollout import assembly
from tlt.rollout.assembly import SUFFIX
from tlt.rollout.eagle_proposer import kv_position_bytes
from tlt.rollout.engine import EngineConfig, FeatureSink, RolloutEngine
from tlt.rollout.history import ResponseHistory
from tlt.rollout.suffix import SuffixProposer
from tlt.rollout.target import TargetModel
from tlt.rollout.tuner import BegMab
from tlt.integrations.verl.config import TLTConfig

log = logging.getLogger(__name__)


def drafter_room(model: TargetModel, drafter_cfg: DrafterConfig, sink: FeatureSink | None) -> int:
    """Bytes per position a first EAGLE drafter adds to a paged engine: its keys and values, and the
    target features it reads that nothing stores yet (EAGLE: the last hidden state; EAGLE-3: its aux
    layers' inputs). A feature sink already stores the same drafter's features."""
    layer, elem = drafter_cfg.layer, model.embed_weight.element_size()
    feats = 0 if sink is not None else model.config.hidden_size * (len(drafter_cfg.aux_layers) or 1)
    return kv_position_bytes(layer.num_key_value_heads, layer.head_dim, elem) + feats * elem


class ReplicaEngine:
    def __init__(self, model: TargetModel, cfg: TLTConfig, *, max_len: int, seed: int, rank: int,
                 drafter: Drafter | None = None, sink: FeatureSink | None = None, device: str = "cpu",
                 max_num_seqs: int | None = None, gpu_memory_utilization: float | None = None,
                 drafter_later: bool = False) -> None:
        """``max_num_seqs``, ``gpu_memory_utilization``: verl's rollout settings of the same meaning
        (:meth:`~tlt.integrations.verl.config.EngineSection.engine_keys`); ``drafter_later``: spot
        training will push an EAGLE drafter (a pool sized by memory keeps room for it)."""
        spec = cfg.speculation
        self.cfg, self.model, self.seed, self.device = cfg, model, seed, device
        self.max_len = max_len
        self.on = spec.enable and cfg.enable
        keys = cfg.engine.engine_keys(max_num_seqs=max_num_seqs, gpu_memory_utilization=gpu_memory_utilization,
                                      cuda=device == "cuda")
        if self.on and drafter is None and drafter_later and "kv_fraction" in keys:
            keys["draft_position_bytes"] = drafter_room(model, DrafterConfig.for_target(model.config, cfg.drafter.method),
                                                        sink)
        self.engine_cfg = EngineConfig(max_len=max_len, max_draft_tokens=spec.max_draft_tokens,
                                       elastic_threshold=spec.elastic_threshold, seed=replica_seed(seed, rank), **keys)
        hist = spec.history_config()
        self.history = ResponseHistory(hist) if self.on and spec.suffix and hist is not None else None
        self.suffix = SuffixProposer(history=self.history) if self.on and spec.suffix else None
        self.drafter = drafter
        proposers = self._proposers(drafter)
        # a fixed strategy drafts with EAGLE when it is served from the start, else with the suffix drafter
        self.engine_cfg = dataclasses.replace(self.engine_cfg, arm=assembly.fixed_arm(spec.parsed_arm(), proposers))
        self.engine = RolloutEngine(model, self.engine_cfg, proposers=proposers, tuner=self._tuner(proposers),
                                    sink=sink)

    # ------------------------------------------------------------------ assembly
    def _proposers(self, drafter: Drafter | None) -> dict:
        return assembly.proposers(self.engine_cfg, drafter=drafter if self.on else None, suffix=self.suffix)

    def _tuner(self, proposers: dict) -> BegMab | None:
        return assembly.tuner(proposers, device=self.device, seed=self.seed, fixed=self.cfg.speculation.parsed_arm())

    def set_drafter(self, drafter: Drafter | None) -> None:
        """Serve ``drafter`` (None: no EAGLE drafter) without rebuilding the engine. On a ValueError
        (the engine refuses it) nothing changed."""
        proposers = self._proposers(drafter)
        tuner = self.engine.tuner
        fresh = set(proposers) != set(self.engine.proposers) or tuner is None
        if fresh:
            tuner = self._tuner(proposers)  # the arm set changed (a first drafter): new buckets
        self.engine.set_proposers(proposers, tuner)
        if not fresh:
            tuner.forget("")  # a new drafter's acceptance is not the old one's
        self.drafter = drafter

    def add_history(self, step: int, pairs: Iterable[tuple[Sequence[int], Sequence[int]]]) -> int:
        """Step ``step``'s (prompt, response) pairs become draft sources (0 without history)."""
        return self.history.add(step, pairs) if self.history is not None else 0

    def served_drafter_digest(self) -> str | None:
        """Digest of the draft weights the engine's EAGLE proposer runs (None: no EAGLE proposer),
        read from the proposer itself, not from what was last handed to :meth:`set_drafter`."""
        prop = self.engine.proposers.get("")
        return None if prop is None else module_digest(prop.drafter)

    @property
    def proposer_name(self) -> str:
        """The main proposer serving: eagle, suffix (the suffix drafter alone) or none."""
        names = self.engine.proposers
        return "eagle" if "" in names else (SUFFIX if SUFFIX in names else "none")
