"""Resume state of a spot trainer: one rank's training state kept in process memory between sessions
(not the warm-up, which is :mod:`tlt.warmup`).

Owns the snapshot taken when a session ends (this rank's local shards of the drafter's weights and
of its optimizer state, and its saved buffers, EAGLE-3's draft-vocabulary map: plain tensors
detached from the ended process group, kept in host memory so an accelerator's memory goes back to
rollout), the same snapshot read from a checkpoint outside any session (:func:`prefetch`: a replica
that loads a newer drafter to serve also readies it for its next session, so that session does not
spend its short idle window reading the checkpoint), and its
restoration into the next session's freshly sharded drafter, by parameter name (a one-rank state
is cut into any session's FSDP2 shards), and the :class:`WarmStore` its owner passes to each
session. ``tlt.drafter.spot`` decides when a snapshot may be used (every rank agrees nothing
changed); this module only copies.

Also what a first session (no checkpoint yet) resumes from: a ``tlt warmup`` drafter directory
holds its training state (``trainer_state/``) beside its weights, and when that state is the step
the weights record (:func:`warmup_state`) the session continues its optimizer moments (from
memory when prefetched: a replica does at start). Fresh Adam moments would make the first update
lr * sign(grad) on every weight: with the few steps an idle window fits, that undid the warm-up.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tlt.drafter.checkpoint import TrainState, latest, load
from tlt.drafter.eagle import CONFIG_NAME, Drafter, DrafterConfig

STATE_NAME = "trainer_state"  # a drafter directory's training state (a checkpoint root), beside its weights


@dataclasses.dataclass
class Warm:
    """One rank's training state as its last session in this process ended, keyed by parameter name."""

    step: int
    world_size: int
    rank: int
    params: dict[str, torch.Tensor]  # name -> local shard on the host (the full tensor at one rank)
    optim: dict[str, dict[str, torch.Tensor]]  # name -> state name -> local tensor on the host
    samples: int
    buffers: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # saved buffers (EAGLE-3's
                                                                                 # vocabulary map), whole


class WarmStore:
    """Warm states by checkpoint root: what its owner (a replica, a simulated run) keeps between its
    sessions and hands to each :class:`~tlt.drafter.spot.SpotTrainer` it builds. Two owners in one
    process never share one (a module global once let them)."""

    def __init__(self) -> None:
        self._by_root: dict[str, Warm] = {}

    def get(self, root: str | Path) -> Warm | None:
        return self._by_root.get(str(root))

    def put(self, root: str | Path, w: Warm) -> None:
        self._by_root[str(root)] = w

    def clear(self) -> None:
        self._by_root.clear()


def snapshot(d: nn.Module, opt: torch.optim.Optimizer, step: int, world_size: int, rank: int,
             samples: int) -> Warm:
    def host(t):
        return (t.to_local() if isinstance(t, DTensor) else t).detach().to("cpu", copy=True)

    named = list(d.named_parameters())
    optim = {n: {k: host(v) for k, v in opt.state.get(p, {}).items() if isinstance(v, torch.Tensor)}
             for n, p in named if opt.state.get(p)}
    return Warm(step, world_size, rank, {n: host(p) for n, p in named}, optim, samples,
                {n: host(b) for n, b in _saved_buffers(d).items()})


def _saved_buffers(d: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a checkpoint holds (persistent ones: EAGLE-3's d2t/t2d, not RoPE's cache)."""
    keys = set(d.state_dict(keep_vars=True))
    return {n: b for n, b in d.named_buffers() if n in keys}


def usable(w: Warm | None, d: nn.Module, step: int | None, world_size: int, rank: int) -> bool:
    """The warm state is checkpoint ``step`` and holds this rank's local shards of ``d``: the same
    world size and rank, or a one-rank state (every rank takes its own shard from it)."""
    if w is None or step is None or w.step != step:
        return False
    if w.world_size != 1 and (w.world_size, w.rank) != (world_size, rank):
        return False
    named = dict(d.named_parameters())
    if set(named) != set(w.params):
        return False
    buffers = _saved_buffers(d)
    if set(buffers) != set(w.buffers) or any(w.buffers[n].shape != b.shape for n, b in buffers.items()):
        return False
    if w.world_size == 1:
        return all(w.params[n].shape == p.shape for n, p in named.items())
    return all(w.params[n].shape == (p.to_local() if isinstance(p, DTensor) else p).shape
               for n, p in named.items())


def _piece(src: torch.Tensor, p: nn.Parameter, w: Warm, world_size: int, rank: int) -> torch.Tensor:
    """This rank's part of a warm tensor of parameter ``p``: a one-rank (full) state is cut as
    FSDP2 shards it (``Shard(0)``: ``torch.chunk`` pieces, empty past the last one); a sharded one
    is used as is."""
    if w.world_size != 1 or world_size == 1 or not src.dim() or src.shape != p.shape:
        return src
    pieces = src.chunk(world_size, dim=0)
    return pieces[rank] if rank < len(pieces) else src[:0]


def restore(w: Warm, d: nn.Module, opt: torch.optim.Optimizer, world_size: int, rank: int) -> None:
    """Copy the warm shards into ``d`` and set ``opt``'s state from them (``d`` freshly sharded),
    by parameter name. A parameter-shaped optimizer state of a sharded parameter is sharded like it
    (AdamW's moments); the rest (its step count) stays a plain tensor, as the optimizer made them.

    Each rank cuts its own piece with no communication. DCP's ``set_model_state_dict`` /
    ``set_optimizer_state_dict`` do the same by name but took 5-8x longer inside the idle window
    (they scatter from rank 0 and re-key the optimizer): ``tlt bench resume`` measures both."""
    with torch.no_grad():
        for n, b in _saved_buffers(d).items():  # replicated, never sharded
            b.copy_(w.buffers[n])
        for n, p in d.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            local.copy_(_piece(w.params[n], p, w, world_size, rank))
            state = {k: _piece(v, p, w, world_size, rank) for k, v in w.optim.get(n, {}).items()}
            opt.state[p] = {k: DTensor.from_local(v.to(local.device, copy=True), p.device_mesh, p.placements)
                            if isinstance(p, DTensor) and v.dim() and v.shape == local.shape
                            else v.to(local.device, copy=True) for k, v in state.items()}


def prefetch(store: WarmStore, root: str | Path, drafter_config: DrafterConfig, embed_weight: torch.Tensor,
             head_weight: torch.Tensor, *, lr: float, betas: tuple[float, float],
             weight_decay: float, step: int | None = None) -> Warm | None:
    """Read checkpoint ``step`` (default: the newest) under ``root`` into ``store``, as a one-rank
    state (optimizer settings as the spot trainer builds them). None, reading nothing, if there is
    no checkpoint or ``store`` already holds that step as a one-rank state."""
    step, have = (latest(root) if step is None else step), store.get(root)
    if step is None or (have is not None and (have.step, have.world_size) == (step, 1)):
        return None
    d = Drafter(drafter_config, embed_weight, head_weight)
    opt = torch.optim.AdamW(list(d.parameters()), lr=lr, betas=betas, weight_decay=weight_decay)
    state = TrainState(d, opt, frozen=(embed_weight, head_weight), progress={"world_size": 1, "samples": 0})
    load(root, {"train": state}, step=step, alone=True)
    w = snapshot(d, opt, step, 1, 0, state.progress["samples"])
    store.put(root, w)
    return w


def warmup_state(drafter_dir: str | Path) -> Path | None:
    """The training state (a checkpoint root) of a ``tlt warmup`` drafter directory, when its newest
    checkpoint holds the very weights of that directory (the step its config records); else None."""
    root, config = Path(drafter_dir) / STATE_NAME, Path(drafter_dir) / CONFIG_NAME
    recorded = json.loads(config.read_text()).get("step") if config.is_file() else None
    return root if recorded is not None and latest(root) == recorded else None
