"""The coordinator as a child process of the ``tlt`` trainer, and the trainer's client of it.

Owns the process (started with ``--exit-with-parent``: a crash of either side is survivable by the
other, and a killed trainer leaves no coordinator behind) and the :class:`~tlt.coordinator.DriverClient`
the trainer's hooks call. Built empty when the run trains no drafter: every call is then a no-op.
Owner: the trainer's driver thread (verl runs its hooks there).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import weakref
from pathlib import Path

from tlt.integrations.verl.config import TLTConfig
from tlt.ports import free_port

log = logging.getLogger(__name__)


class CoordinatorProcess:
    def __init__(self) -> None:
        self.address: str | None = None  # tcp://host:port once started
        self.proc: subprocess.Popen | None = None
        self.driver = None  # tlt.coordinator.DriverClient once started

    def start(self, cfg: TLTConfig, out: Path, node_ip: str) -> str:
        """Start the coordinator on a free port of ``node_ip`` (its log and pid in ``out``)."""
        from tlt.coordinator import DriverClient

        self.address = f"tcp://{node_ip}:{free_port()}"
        cc = cfg.coordinator
        with open(out / "tlt_coordinator.log", "ab") as log_file:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tlt.coordinator", "--bind", self.address,
                 "--heartbeat-ms", str(int(cc.heartbeat_s * 1000)), "--liveness", str(cc.liveness),
                 "--idle-threshold", str(cfg.spot.min_idle),
                 "--stop-timeout-s", str(cc.done_timeout_s), "--exit-with-parent"],
                stdout=log_file, stderr=log_file)
        weakref.finalize(self, stop_process, self.proc)  # also when the trainer's set-up fails later
        (out / "tlt_coordinator.pid").write_text(f"{self.proc.pid}\n")
        self.driver = DriverClient(self.address, timeout_s=cc.done_timeout_s)
        return self.address

    def step_begin(self, step: int) -> None:
        """Tell the coordinator the step began (a silent coordinator is logged; the rollout goes on)."""
        if self.driver is not None and not self.driver.step_begin(step, timeout_s=2.0):
            log.warning("tlt: the coordinator did not answer step_begin(%d): rollout goes on "
                        "without drafter adaptation", step)

    def rollout_done(self, step: int):
        """Stop drafter training (bounded wait): the coordinator's RolloutOutcome, None without one."""
        if self.driver is None:
            return None
        outcome = self.driver.rollout_done(step)
        if not outcome.reachable:
            log.warning("tlt: coordinator unreachable at the end of step %d's rollout: "
                        "drafter training could not be stopped through it", step)
        return outcome

    def close(self) -> None:
        if self.driver is not None:
            self.driver.close()
        if self.proc is not None:
            stop_process(self.proc)


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
