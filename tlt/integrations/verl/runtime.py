"""What the trainer hands to the replicas it launches, in the trainer's (TaskRunner) process.

Owns one small record: the validated TLT config, the coordinator's address, the shared
spot-checkpoint directory, the run directory, the rendezvous base port, the seed and (SGLang) the drafter the servers start with. verl
constructs the replica objects itself (``LLMServerManager``) with its own arguments only, so the
trainer publishes this before it builds them and :class:`TLTReplica` reads it when launching
servers.
"""

from __future__ import annotations

import dataclasses

from tlt.integrations.verl.config import TLTConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class Runtime:
    tlt: TLTConfig
    coordinator_address: str | None
    spot_root: str
    run_dir: str = ""  # trainer.default_local_dir: replicas write tlt_replica_<rank>.pid there
    spot_base_port: int = 0
    seed: int = 0
    start_drafter: str | None = None  # SGLang replicas: the SGLang-format drafter servers start with


_current: Runtime | None = None


def publish(rt: Runtime) -> None:
    global _current
    _current = rt


def current() -> Runtime:
    if _current is None:  # the replica was built by another trainer mode: TLT disabled
        return Runtime(tlt=TLTConfig(enable=False), coordinator_address=None, spot_root="")
    return _current
