"""``tlt bench resume``: how long a spot session takes to resume a drafter's training state.

A session starts inside a rollout idle window, so its resume is time the drafter does not train.
Two real ranks (spawned processes, gloo on 127.0.0.1, FSDP2 ``Shard(0)`` as the spot trainer
shards) time, interleaved per round, for each warm state the trainer can hold:

* ``cut``: :func:`tlt.drafter.resume_state.restore`, the trainer's code: every rank cuts its piece
  from the host copy by parameter name, no communication;
* ``dcp``: the same state loaded with DCP's ``set_model_state_dict`` /
  ``set_optimizer_state_dict`` (a full state dict for the one-rank state, DTensors on the new mesh
  for a rank's own shards), the alternative the resume code was measured against.

Warm states: ``one-rank`` (a prefetched checkpoint, or a 1-rank session's end: full tensors,
cut into 2 shards) and ``own shards`` (the same 2-rank membership as the previous session). Both
variants must load the same weights and Adam moments (checked: a mismatch fails the bench).
Drafter: an EAGLE head for a Llama-3-8B-shaped target with the width scaled by 1/4 (1/16 with
``--quick``); the wall time is the slower rank's, medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor, distribute_tensor

from tlt.drafter.eagle import Drafter, DrafterConfig
from tlt.drafter.model_config import ModelConfig
from tlt.ports import free_port

VARIANTS = ("cut", "dcp")
STATES = ("one-rank", "own shards")


def _drafter_config(scale: int) -> DrafterConfig:
    h = 4096 // scale
    target = ModelConfig(model_type="llama", vocab_size=128256 // scale, hidden_size=h,
                         intermediate_size=14336 // scale, num_hidden_layers=32,
                         num_attention_heads=max(1, 32 // scale), num_key_value_heads=max(1, 8 // scale),
                         head_dim=128)
    return DrafterConfig.for_target(target, "eagle")


def _sharded(cfg: DrafterConfig, embed: torch.Tensor, head: torch.Tensor):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    d = Drafter(cfg, embed, head)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for name in ("fc", "norm", "lm_head"):
        if hasattr(d, name):
            fully_shard(getattr(d, name), mesh=mesh)
    for layer in d.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(d, mesh=mesh)
    return d, torch.optim.AdamW(list(d.parameters()), lr=1e-3)


def _adam_step(d: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    """One AdamW step on seeded random gradients: the state has moments worth restoring."""
    g = torch.Generator().manual_seed(seed)
    for p in d.parameters():
        grad = torch.randn(p.shape, generator=g)  # a DTensor's full shape: the same on every rank
        p.grad = (distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
                  if isinstance(p, DTensor) else grad)
    opt.step()


def _dcp_restore(w, d: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    named = dict(d.named_parameters())

    def own(n: str, t: torch.Tensor) -> torch.Tensor:
        p = named[n]
        if w.world_size == 1 or not t.dim():
            return t
        return DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())

    options = StateDictOptions(full_state_dict=w.world_size == 1)
    set_model_state_dict(d, {n: own(n, t) for n, t in w.params.items()}, options=options)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(named)} for g in opt.param_groups]
    state = {n: {k: own(n, v) for k, v in st.items()} for n, st in w.optim.items()}
    set_optimizer_state_dict(d, opt, {"state": state, "param_groups": groups}, options=options)


def _locals(d: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for p in d.parameters():
        out.append(p.to_local() if isinstance(p, DTensor) else p)
        for _, v in sorted(opt.state[p].items()):
            out.append(v.to_local() if isinstance(v, DTensor) else v)
    return [t.detach().clone() for t in out]


def _rank(rank: int, port: int, scale: int, rounds: int, out: str) -> None:
    from tlt.drafter import resume_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cfg = _drafter_config(scale)
    g = torch.Generator().manual_seed(1)
    embed = torch.randn(cfg.target_vocab_size, cfg.layer.hidden_size, generator=g)
    head = torch.randn(cfg.target_vocab_size, cfg.layer.hidden_size, generator=g)
    torch.manual_seed(0)
    one = Drafter(cfg, embed, head)
    one_opt = torch.optim.AdamW(list(one.parameters()), lr=1e-3)
    _adam_step(one, one_opt, 5)
    shard, shard_opt = _sharded(cfg, embed, head)
    _adam_step(shard, shard_opt, 6)
    warm = {"one-rank": resume_state.snapshot(one, one_opt, 1, 1, 0, 0),
            "own shards": resume_state.snapshot(shard, shard_opt, 1, 2, rank, 0)}
    times: dict[str, list[float]] = {f"{s}/{v}": [] for s in STATES for v in VARIANTS}
    for r in range(rounds + 1):  # round 0: untimed warm-up, and the equality check
        for s in STATES:
            loaded = {}
            for v in VARIANTS:
                d, opt = _sharded(cfg, embed, head)  # fresh, as the trainer's _build makes them
                dist.barrier()
                t0 = time.perf_counter()
                if v == "cut":
                    resume_state.restore(warm[s], d, opt, 2, rank)
                else:
                    _dcp_restore(warm[s], d, opt)
                dist.barrier()
                if r:
                    times[f"{s}/{v}"].append(time.perf_counter() - t0)
                else:
                    loaded[v] = _locals(d, opt)
            if not r and not all(torch.equal(a, b) for a, b in zip(loaded["cut"], loaded["dcp"])):
                raise RuntimeError(f"{s}: the cut and DCP restores loaded different state")
    if rank == 0:
        params = sum(p.numel() for p in one.parameters())
        Path(out).write_text(json.dumps({"times": times, "params": params}))
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict:
    scale, rounds = (16, 3) if args.quick else (4, args.repeats or 10)
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/rank0.json"
        ctx = multiprocessing.get_context("spawn")
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, port, scale, rounds, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"a bench rank failed: exit codes {[p.exitcode for p in procs]}")
        raw = json.loads(Path(out).read_text())
    med = {k: statistics.median(v) for k, v in raw["times"].items()}
    result = {"bench": "resume", "quick": bool(args.quick), "width_scale": f"1/{scale}", "ranks": 2,
              "drafter_params": raw["params"], "rounds": rounds, "median_s": med, "times_s": raw["times"],
              "dcp_over_cut": {s: med[f"{s}/dcp"] / med[f"{s}/cut"] for s in STATES}}
    result["summary"] = [
        f"resume bench: EAGLE drafter of an 8B-shaped target at width 1/{scale} "
        f"({raw['params'] / 1e6:.1f}M params + AdamW), 2 ranks gloo, median of {rounds} rounds"] + [
        f"{s:>10}: cut {med[f'{s}/cut'] * 1e3:.1f} ms, DCP {med[f'{s}/dcp'] * 1e3:.1f} ms "
        f"({result['dcp_over_cut'][s]:.1f}x)" for s in STATES]
    return result
