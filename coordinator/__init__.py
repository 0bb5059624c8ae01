"""Worker coordinator (ZeroMQ): tracks rollout workers BUSY -> IDLE -> TRAINING, promotes idle ones
to drafter training, and preempts training when rollout finishes. Imports no torch and nothing
else of ours (see DESIGN.md section 2).

    protocol   wire format: versioned header, commands, msgpack payloads, size limits
    states     the worker state machine (allowed transitions)
    policy     promotion / session / stop rules as pure logic
    broker     Coordinator: the ROUTER poll loop (an embeddable thread)
    cli        standalone options and entry point (``python -m coordinator``, ``tlt coordinator``)
    worker     WorkerClient: DEALER link with heartbeats and capped-backoff reconnect
    driver     DriverClient: ``step_begin`` / ``rollout_done`` for the RL step controller
"""

from coordinator.broker import Coordinator, CoordinatorConfig
from coordinator.cli import main
from coordinator.driver import DriverClient, RolloutOutcome
from coordinator.policy import Event, PolicyConfig
from coordinator.protocol import ProtocolError, WorkerState
from coordinator.worker import WorkerClient, WorkerConfig

__all__ = ["Coordinator", "CoordinatorConfig", "DriverClient", "Event", "PolicyConfig",
           "ProtocolError", "RolloutOutcome", "WorkerClient", "WorkerConfig", "WorkerState", "main"]
