"""Warm state of a spot trainer: one rank's training state kept in process memory between sessions.

Owns the snapshot taken when a session ends (this rank's local shards of the drafter's weights and
of its optimizer state, plain tensors detached from the ended process group, kept in host memory so
an accelerator's memory goes back to rollout) and its restoration into the next session's freshly
sharded drafter. ``drafter.spot`` decides when a snapshot may be
used (every rank agrees nothing changed); this module only copies.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.tensor import DTensor


@dataclasses.dataclass
class Warm:
    """One rank's training state as its last session in this process ended."""

    step: int
    world_size: int
    rank: int
    params: list[torch.Tensor]  # local shards on the host, in parameter order
    optim: list[dict[str, tuple[bool, torch.device, torch.Tensor]]]  # name -> (is DTensor, its device, local)
    samples: int


WARM: dict[str, Warm] = {}  # checkpoint root -> this process's last session state


def snapshot(d: nn.Module, opt: torch.optim.Optimizer, step: int, world_size: int, rank: int,
             samples: int) -> Warm:
    def host(t):
        return (t.to_local() if isinstance(t, DTensor) else t).detach().to("cpu", copy=True)

    params = list(d.parameters())
    optim = [{k: (isinstance(v, DTensor), v.device, host(v)) for k, v in opt.state.get(p, {}).items()
              if isinstance(v, torch.Tensor)} for p in params]
    return Warm(step, world_size, rank, [host(p) for p in params], optim, samples)


def _locals(d: nn.Module) -> list[torch.Tensor]:
    return [p.to_local() if isinstance(p, DTensor) else p for p in d.parameters()]


def fits(w: Warm, d: nn.Module) -> bool:
    """The warm shards have this model's local shapes (same world size, rank and config)."""
    mine = _locals(d)
    return len(mine) == len(w.params) and all(a.shape == b.shape for a, b in zip(mine, w.params))


def restore(w: Warm, d: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Copy the warm shards into ``d`` and set ``opt``'s state from them (``d`` freshly sharded)."""
    params, locals_ = list(d.parameters()), _locals(d)
    with torch.no_grad():
        for dst, src in zip(locals_, w.params):
            dst.copy_(src)
    for p, state in zip(params, w.optim):
        opt.state[p] = {k: DTensor.from_local(v.to(dev, copy=True), p.device_mesh, p.placements) if dt
                        else v.to(dev, copy=True) for k, (dt, dev, v) in state.items()}
