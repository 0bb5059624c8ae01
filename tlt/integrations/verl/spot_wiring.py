"""How a replica trains its drafter in its idle windows: the DataBuffer feed and the spot agent.

Owns :class:`BufferFeed` (the engine's feature sink: each finished request becomes a DataBuffer
sample of the RL step being rolled out), :func:`session_weights` (the frozen tensors a session
trains against: its own copies) and :func:`start_spot_agent` (the coordinator worker whose
PROMOTE starts an FSDP2 spot session in this process). The replica decides when it is idle or
busy; the agent and trainer decide the rest (:mod:`tlt.spot_agent`, :mod:`tlt.drafter.spot`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from tlt.drafter.seeds import derive
from tlt.drafter.buffer import DataBuffer
from tlt.drafter.eagle import DrafterConfig
from tlt.drafter.packing import FeatureSample
from tlt.drafter.resume_state import WarmStore
from tlt.drafter.spot import SpotConfig, SpotTrainer
from tlt.drafter.ttt import TTTConfig
from tlt.rollout.target import TargetModel
from tlt.integrations.verl.config import PORT_SPAN, TLTConfig



class BufferFeed:
    """The engine's feature sink: each finished request becomes a DataBuffer sample of this step."""

    def __init__(self, buffer: DataBuffer, aux_layers: tuple[int, ...], step: Callable[[], int]) -> None:
        self.buffer, self.aux_layers, self._step = buffer, tuple(aux_layers), step  # step(): the RL step

    def add(self, tokens, prompt_len, hidden, aux) -> None:
        mask = torch.zeros(len(tokens), dtype=torch.bool)
        mask[prompt_len:] = True
        self.buffer.add(FeatureSample(torch.tensor(tokens), mask, _last_row_zero(hidden),
                                      None if aux is None else _last_row_zero(aux)), self._step())


def _last_row_zero(x: torch.Tensor) -> torch.Tensor:
    """[T - 1, D] -> [T, D]: a feature row for the last token, which no forward was fed. Training
    never reads it (:mod:`tlt.drafter.ttt`: the last position's prediction has no label), so it is
    zeros, and the sample has a whole sequence's shape."""
    return torch.cat([x, x.new_zeros(1, x.shape[1])])


def add_captured(buffer: DataBuffer, step: int, samples: list[tuple]) -> int:
    """Features the actor workers captured (``tlt.buffer.capture=old_log_prob``) into ``buffer``, as
    step ``step``'s: each sample is (ids [n], loss mask [n], hidden [n, H], aux [n, A*H] or None).
    Returns the samples the buffer holds. The one feed of both backends' ``add_samples``."""
    for k, sample in enumerate(samples):
        if len(sample) != 4:
            raise ValueError(f"captured sample {k}: (ids, mask, hidden, aux) expected, got {len(sample)} fields")
        buffer.add(FeatureSample(*sample), step)
    return len(buffer)


def session_weights(model: TargetModel, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen embedding and LM head a spot session trains against: its own copies (on
    ``device``, where the session trains; default: where the model's are), so a policy push (which
    copies the new policy into the target in place) never writes tensors a session reads, whether
    or not the session has stopped yet. Cost per session start: one copy of the embedding and the
    head (at 7B, vocab 152k x 3584 in bf16: about 2.2 GB)."""
    device = device or model.embed_weight.device
    return (model.embed_weight.detach().to(device, copy=True), model.lm_head.weight.detach().to(device, copy=True))


def spot_config(cfg: TLTConfig, seed: int) -> SpotConfig:
    s = cfg.spot
    return SpotConfig(lr=s.lr, warmup_steps=s.warmup_steps, token_budget=s.token_budget, interval=s.interval,
                      local_data=True,
                      preempt_s=s.preempt_s, ttt=TTTConfig(steps=s.ttt_steps), seed=seed)


def busy_timeout_s(spot: SpotConfig) -> float:
    """How long a replica's ``busy()`` waits for its session to stop: its slowest stop, a collective
    blocked on a dead peer (the group's ``timeout_s``), the final checkpoint's collective as long
    again, then the save. The replica never serves while a session runs."""
    return 2 * spot.timeout_s + 60


def agent_config(cfg: TLTConfig, spot: SpotConfig):
    """The spot agent's settings."""
    from tlt.spot_agent import AgentConfig

    return AgentConfig(port_span=PORT_SPAN, nice=cfg.spot.nice, busy_timeout_s=busy_timeout_s(spot))


def start_spot_agent(*, cfg: TLTConfig, rank: int, seed: int, model: TargetModel, drafter_cfg: DrafterConfig,
                     buffer: DataBuffer, spot_root: str, coordinator: str, node_ip: str, base_port: int,
                     on_record: Callable, spot_rate: Callable[[], float | None], warm_store: WarmStore,
                     device: torch.device | None = None):
    """This replica's spot agent, connected to the coordinator and idle until told otherwise;
    sessions train on ``device`` (default: the model's) and resume from ``warm_store`` (the replica's)."""
    from tlt.coordinator import WorkerConfig
    from tlt.spot_agent import SpotAgent

    spot = spot_config(cfg, seed)

    def make_trainer(s):  # the last session's measured throughput sizes the first chunks
        embed, head = session_weights(model, device)
        return SpotTrainer(spec=s, config=spot, drafter_config=drafter_cfg, embed_weight=embed, head_weight=head,
                           checkpoint_root=spot_root, init_from=cfg.drafter.init_path, tokens_per_s=spot_rate(),
                           warm_store=warm_store)

    def batches(f):
        calls = itertools.count()
        return lambda budget: buffer.sample_batch(budget, seed=derive(f.epoch, next(calls)))

    cc = cfg.coordinator
    worker = WorkerConfig(address=coordinator, worker_id=f"replica-{rank}",
                          trainer_address=f"tcp://{node_ip}:{base_port + PORT_SPAN * rank}",
                          heartbeat_interval_s=cc.heartbeat_s, liveness=cc.liveness,
                          reconnect_initial_s=cc.heartbeat_s, reconnect_max_s=8 * cc.heartbeat_s)
    agent = SpotAgent(worker, make_trainer=make_trainer, batches=batches, on_record=on_record,
                      config=agent_config(cfg, spot))
    return agent.start(0)
