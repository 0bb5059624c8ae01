"""verl rollout backend ``tlt``: the replica (driver side) and the weight adapter (worker side).

Owns the two classes verl's registries resolve for ``actor_rollout_ref.rollout.name=tlt``:

- :class:`TLTReplica` (``RolloutReplicaRegistry``): launches one :class:`TLTServer` Ray actor per
  replica on the node of its workers, hands it the TLT config and the coordinator's address
  (published by the trainer in :mod:`tlt.integrations.verl.runtime`), and exposes it as verl's
  token-in/token-out server handle.
- :class:`TLTRolloutAdapter` (``_ROLLOUT_REGISTRY[("tlt", "async")]``): lives in each actor
  worker; ``update_weights`` receives the actor's full weights after every update. Every rank
  drains the generator (it may run collectives); the replica's first rank sends the tensors to
  its server. Policy weights only: the server copies them into the target, never the drafter.
"""

from __future__ import annotations

import logging
import os

import ray

from tlt.integrations.verl import runtime
from tlt.integrations.verl.server import TLTServer, replica_of_this_rank, server_name
from tlt.integrations.verl.consolidator import server_address

log = logging.getLogger(__name__)


def _replica_class():
    from verl.workers.rollout.base import BaseRollout
    from verl.workers.rollout.replica import RolloutReplica

    class TLTReplica(RolloutReplica):
        def rollout_worker_use_gpu(self) -> bool:
            return False

        async def launch_servers(self):
            rt = runtime.current()
            node_id = await self.workers[0].__ray_call__.remote(
                lambda self: ray.get_runtime_context().get_node_id()) if self.workers else None
            # A killed replica restarts (it refuses requests until the next policy push); calls that
            # reach it while it restarts (verl's sleep/wake-up, weight pushes) are retried by Ray.
            opts = {"name": server_name(self.replica_rank), "max_concurrency": self.max_concurrency,
                    "num_cpus": 0, "max_restarts": -1, "max_task_retries": -1}
            if node_id is not None:
                opts["scheduling_strategy"] = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    node_id=node_id, soft=False)
            env = {k: v for k, v in os.environ.items() if k.startswith(("VERL_", "TLT_"))}
            opts["runtime_env"] = {"env_vars": env}
            server = ray.remote(TLTServer).options(**opts).remote(
                model_path=_model_path(self.model_config), replica_rank=self.replica_rank,
                tlt=rt.tlt.to_dict(), prompt_length=self.config.prompt_length,
                response_length=self.config.response_length, coordinator=rt.coordinator_address,
                spot_root=rt.spot_root, run_dir=rt.run_dir, spot_base_port=rt.spot_base_port, seed=rt.seed,
                max_num_seqs=self.config.get("max_num_seqs"),
                gpu_memory_utilization=self.config.get("gpu_memory_utilization"))
            await server.pid.remote()  # constructed: model loaded, agent connected
            self.servers = [server]
            self._server_handle = server
            self._server_address = server_address(self.replica_rank)  # what the router calls it

    class TLTRolloutAdapter(BaseRollout):
        def __init__(self, config, model_config, device_mesh, *args, **kwargs):
            super().__init__(config, model_config, device_mesh)
            self.replica_rank, self.is_leader = replica_of_this_rank(self.config)
            self._server = None
            self.sleep_level = 2

        def server(self):
            if self._server is None:
                self._server = ray.get_actor(server_name(self.replica_rank))
            return self._server

        async def resume(self, tags: list[str]):
            return None

        async def release(self):
            return None

        async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs):
            if wire_format != "named_tensors":
                raise ValueError(f"the tlt rollout takes full named tensors, not wire_format={wire_format!r}: "
                                 "keep actor_rollout_ref.rollout.checkpoint_engine.backend=naive")
            state = {}
            for name, t in weights:  # every rank drains: the generator may all-gather shards
                if self.is_leader:
                    state[name] = t.detach().to("cpu", copy=True) if t.device.type != "cpu" else t.detach().clone()
            if self.is_leader:
                n = await self.server().update_weights.remote(state, kwargs.get("global_steps"))
                log.debug("replica %d: %d policy tensors updated", self.replica_rank, n)

    return TLTReplica, TLTRolloutAdapter


def _model_path(mc) -> str:
    path = getattr(mc, "local_path", None) or mc.get("path")
    if not path or not os.path.isdir(path):
        raise ValueError(f"actor_rollout_ref.model.path={path!r}: the tlt rollout loads a local HF model "
                         "directory (config.json + safetensors)")
    return path


_CLASSES = None


def classes():
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _replica_class()
    return _CLASSES


def load_replica():
    return classes()[0]


def __getattr__(name: str):  # verl resolves the adapter by import path (module attribute)
    if name == "TLTRolloutAdapter":
        return classes()[1]
    if name == "TLTReplica":
        return classes()[0]
    raise AttributeError(name)

