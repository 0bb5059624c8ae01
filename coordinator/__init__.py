"""Worker coordinator (ZeroMQ): tracks rollout workers BUSY -> IDLE -> TRAINING, promotes idle ones
to drafter training, and preempts training when rollout finishes. Imports no torch and nothing
else of ours (tests/tlt/test_integration_layout.py enforces it).

    protocol   wire format: versioned header, commands, msgpack payloads, size limits
    states     the worker state machine (allowed transitions)
    promotion  promotion / session / stop rules as pure logic
    broker     Coordinator: the ROUTER poll loop (an embeddable thread)
    cli        standalone options and entry point (``python -m tlt.coordinator``, ``tlt coordinator``)
    worker     WorkerClient: DEALER link with heartbeats and capped-backoff reconnect
    driver     DriverClient: ``step_begin`` / ``rollout_done`` for the RL step controller
"""

import importlib as _importlib

# name -> the submodule that defines it. Imported on first use (PEP 562), so that the pure parts
# (``tlt.coordinator.consolidation``, ``promotion``, ``states``) load without ZeroMQ: the rollout benches and the
# cluster simulator read them on machines that have no pyzmq.
_EXPORTS = {"Coordinator": "broker", "CoordinatorConfig": "broker", "main": "cli", "DriverClient": "driver",
            "RolloutOutcome": "driver", "Event": "promotion", "PromotionConfig": "promotion",
            "ProtocolError": "protocol", "WorkerState": "protocol", "WorkerClient": "worker", "WorkerConfig": "worker"}
__all__ = sorted(_EXPORTS)
_RENAMED = {"PolicyConfig": "PromotionConfig"}  # old name -> new: read until the next release


def __getattr__(name: str):
    if name in _RENAMED:
        import warnings
        warnings.warn(f"tlt.coordinator.{name} is renamed {_RENAMED[name]}; the old name is read until "
                      "the next release", DeprecationWarning, stacklevel=2)
        name = _RENAMED[name]
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(_importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
