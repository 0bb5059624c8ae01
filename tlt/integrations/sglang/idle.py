"""Idle signal from inside an SGLang server: BUSY/IDLE reports to TLT's coordinator.

Owns the transition logic: the scheduler's hooks call :meth:`IdleSignal.update` with its running
request count (running batch + waiting queue) after each batch and whenever it has nothing to
run; a change between "some requests" and "none" goes to the coordinator as BUSY or IDLE, so the
coordinator can promote idle SGLang replicas to spot training outside verl too (once a driver has
told it the step: ``DriverClient.step_begin``; it promotes nobody before). Reports never
block (``coordinator.WorkerClient.report`` only queues). Configured by environment, read once per
scheduler process; only TP rank 0 reports (one worker per server):

* ``TLT_COORDINATOR`` — coordinator address (``tcp://HOST:PORT``); unset = no signal;
* ``TLT_WORKER_ID`` — default ``sglang-<host>-<pid>``; ``TLT_DP_GROUP`` — default 0.

Commands the coordinator sends back (PROMOTE, STOP) are logged here; a spot agent that trains on
the server's GPU attaches with the same worker id (see docs/sglang.md).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

BUSY, IDLE = "BUSY", "IDLE"


class IdleSignal:
    """BUSY <-> IDLE transitions from running-request counts; ``report(state, step)`` on change."""

    def __init__(self, report: Callable[[str, int], None], clock: Callable[[], float] = time.monotonic) -> None:
        self._report, self._clock = report, clock
        self.state: str | None = None
        self.busy_periods = 0  # the "step" reported: how many busy periods began
        self.idle_s = 0.0
        self._since = clock()

    def update(self, running: int) -> None:
        state = BUSY if running > 0 else IDLE
        if state == self.state:
            return
        now = self._clock()
        if self.state == IDLE:
            self.idle_s += now - self._since
        self.state, self._since = state, now
        if state == BUSY:
            self.busy_periods += 1
        self._report(state, self.busy_periods)


class _Null:
    def update(self, running: int) -> None:
        return None


def from_env(environ: Mapping[str, str] = os.environ, *, tp_rank: int = 0) -> IdleSignal | _Null:
    """The signal this process should send (a no-op without ``TLT_COORDINATOR`` or off rank 0)."""
    address = environ.get("TLT_COORDINATOR", "").strip()
    if not address or tp_rank != 0:
        return _Null()
    from tlt.coordinator.worker import WorkerClient, WorkerConfig

    try:
        group = int(environ.get("TLT_DP_GROUP", "0"))
    except ValueError:
        raise ValueError(f"TLT_DP_GROUP={environ['TLT_DP_GROUP']!r}: give an int >= 0") from None
    cfg = WorkerConfig(address=address, dp_group=group,
                       worker_id=environ.get("TLT_WORKER_ID") or f"sglang-{socket.gethostname()}-{os.getpid()}")
    client = WorkerClient(cfg, on_command=lambda cmd: log.info("coordinator command for %s: %s", cfg.worker_id, cmd))
    client.start(state="IDLE")
    log.info("TLT idle signal: %s reports to %s", cfg.worker_id, address)
    return IdleSignal(lambda state, step: client.report(state, step))
