"""What a replica keeps whichever engine serves it: its DataBuffer, its RL step's statistics, its spot
agent and the drafter versions it served.

Owns :class:`ReplicaCore`, which both backends' Ray actors compose (:class:`.server.TLTServer`, the
project's engine; :class:`.sglang_server.TLTSGLangServer`, SGLang), and :class:`DrafterVersions`.
Each backend keeps only its serving part: how requests reach its engine, how a drafter reaches it
and when it is idle.

State, owner and guard:

- ``buffer``: thread-safe (its own lock). Written by the engine's feature sink or the actor
  workers' ``add_samples``, read by spot sessions.
- ``stats``: thread-safe (its own lock). Written by the serving part and the spot agent's records,
  read by the driver's ``step_stats``.
- ``step``: written by the driver's ``begin_step`` between rollouts only; read by the feature sink.
- ``drafters``: changed only where the backend swaps its drafter (the project's engine: under its
  serving lock; SGLang: in its event loop).
- ``agent``: set once, when the backend starts it.
"""

from __future__ import annotations

from typing import Any

from tlt.drafter.buffer import BufferConfig, DataBuffer
from tlt.drafter.eagle import DrafterConfig
from tlt.drafter.resume_state import WarmStore
from tlt.integrations.verl.config import TLTConfig
from tlt.integrations.verl.spot_wiring import add_captured, start_spot_agent
from tlt.integrations.verl.step_stats import StepStats


class DrafterVersions:
    """The drafter a replica serves, by version, and the one it served before the last push (the
    push guard may ask for it back, once)."""

    def __init__(self, served: Any = None, version: int = 0) -> None:
        self.served, self.version = served, version
        self.previous: tuple[Any, int] | None = None  # (served, version) before the last push

    def push(self, served: Any, version: int) -> None:
        """Serve ``served`` as ``version``. The same version again (the driver's re-push to a replica
        that lost it) keeps ``previous``: a rollback then restores what every replica served before."""
        if version != self.version or self.previous is None:
            self.previous = (self.served, self.version)
        self.served, self.version = served, version

    def rollback(self, version: int) -> bool:
        """Serve the previous drafter again, as ``version``. False (nothing changed) when there is
        none: no push yet, or a rollback since the last push."""
        if self.previous is None:
            return False
        (self.served, _), self.previous = self.previous, None
        self.version = version
        return True


class ReplicaCore:
    def __init__(self, cfg: TLTConfig, *, rank: int, seed: int, spot_root: str) -> None:
        self.cfg, self.rank, self.seed, self.spot_root = cfg, rank, seed, spot_root
        self.buffer = DataBuffer(BufferConfig(dtype=cfg.buffer.dtype, max_bytes=cfg.buffer.max_mb << 20))
        self.stats = StepStats()
        self.step = 0  # the RL step being rolled out
        self.agent = None  # tlt.spot_agent.SpotAgent, once started
        self.drafters = DrafterVersions()

    def start_agent(self, *, model, drafter_cfg: DrafterConfig, coordinator: str, base_port: int,
                    warm_store: WarmStore, device=None) -> None:
        """Connect this replica's spot agent to the coordinator (idle until told otherwise)."""
        import ray

        self.agent = start_spot_agent(
            cfg=self.cfg, rank=self.rank, seed=self.seed, model=model, drafter_cfg=drafter_cfg, buffer=self.buffer,
            spot_root=self.spot_root, coordinator=coordinator, node_ip=ray.util.get_node_ip_address(),
            base_port=base_port, on_record=self.stats.session, spot_rate=lambda: self.stats.spot_rate,
            warm_store=warm_store, device=device)

    def begin_step(self, step: int) -> None:
        """RL step ``step``'s rollout is about to start: its statistics start over."""
        self.step = step
        self.stats.reset()

    def step_stats(self, **backend: Any) -> dict[str, Any]:
        """The step's statistics, the drafter version served and the buffer's figures; ``backend``:
        the serving part's own fields."""
        return {**self.stats.snapshot(), "drafter_version": self.drafters.version, "buffer": self.buffer.stats(),
                "replica": self.rank, **backend}

    def add_samples(self, step: int, samples: list[tuple]) -> int:
        """Features captured by this replica's actor worker (``tlt.buffer.capture=old_log_prob``)."""
        return add_captured(self.buffer, step, samples)

    def shutdown(self) -> None:
        if self.agent is not None:
            self.agent.close()
