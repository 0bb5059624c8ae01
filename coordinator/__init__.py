"""Worker coordinator (ZeroMQ): tracks rollout workers BUSY -> IDLE -> TRAINING, promotes idle ones
to drafter training, and preempts training when rollout finishes. Imports no torch and nothing
else of ours (tests/tlt/test_integration_layout.py enforces it).

    protocol   wire format: versioned header, commands, msgpack payloads, size limits
    states     the worker state machine (allowed transitions)
    policy     promotion / session / stop rules as pure logic
    broker     Coordinator: the ROUTER poll loop (an embeddable thread)
    cli        standalone options and entry point (``python -m tlt.coordinator``, ``tlt coordinator``)
    worker     WorkerClient: DEALER link with heartbeats and capped-backoff reconnect
    driver     DriverClient: ``step_begin`` / ``rollout_done`` for the RL step controller
"""

from tlt.coordinator.broker import Coordinator, CoordinatorConfig
from tlt.coordinator.cli import main
from tlt.coordinator.driver import DriverClient, RolloutOutcome
from tlt.coordinator.policy import Event, PolicyConfig
from tlt.coordinator.protocol import ProtocolError, WorkerState
from tlt.coordinator.worker import WorkerClient, WorkerConfig

__all__ = ["Coordinator", "CoordinatorConfig", "DriverClient", "Event", "PolicyConfig",
           "ProtocolError", "RolloutOutcome", "WorkerClient", "WorkerConfig", "WorkerState", "main"]
