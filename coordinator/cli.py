"""Standalone coordinator: the command-line options, ``python -m tlt.coordinator`` and ``tlt coordinator``."""

from __future__ import annotations

import argparse
import logging
import os

import zmq

from tlt.coordinator.broker import Coordinator, CoordinatorConfig
from tlt.coordinator.promotion import PromotionConfig

log = logging.getLogger("tlt.coordinator")


DESCRIPTION = ("Run the TLT worker coordinator (ZeroMQ ROUTER): tracks rollout workers BUSY/IDLE/"
               "TRAINING, promotes idle workers to drafter training, and stops training when the driver "
               "reports rollout done. Stop with Ctrl-C or SIGTERM.")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The standalone options (shared by ``python -m tlt.coordinator`` and ``tlt coordinator``)."""
    d, dp = CoordinatorConfig(), PromotionConfig()
    p.add_argument("--bind", default=d.bind, help=f"endpoint to bind (default {d.bind}; "
                   "tcp://0.0.0.0:PORT for all interfaces, port 0 = any free port)")
    p.add_argument("--heartbeat-ms", type=int, default=int(d.heartbeat_interval_s * 1000),
                   help="heartbeat interval in ms (workers must use the same)")
    p.add_argument("--liveness", type=int, default=d.liveness, help="missed heartbeats before LOST")
    p.add_argument("--idle-threshold", type=int, default=dp.idle_threshold,
                   help="free workers (idle + training) needed before idle workers are promoted")
    p.add_argument("--stop-timeout-s", type=float, default=dp.stop_timeout_s,
                   help="seconds a training worker has to ack STOP before it is marked LOST")
    p.add_argument("--max-workers", type=int, default=dp.max_workers, help="workers it takes at most")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="stop when the process that started this one exits (even if it was killed)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="level of the coordinator's own log")
    return p


def serve_args(a: argparse.Namespace) -> None:
    """Serve until SIGINT/SIGTERM with the options of ``add_arguments``. Bad options or an address
    that cannot be bound raise ValueError (with the reason)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("tlt.coordinator").setLevel(a.log_level)
    cfg = CoordinatorConfig(bind=a.bind, heartbeat_interval_s=a.heartbeat_ms / 1000, liveness=a.liveness,
                            promotion=PromotionConfig(idle_threshold=a.idle_threshold,
                                                      stop_timeout_s=a.stop_timeout_s, max_workers=a.max_workers))
    parent = os.getppid()

    def parent_gone() -> bool:  # reparented: the process that started this one exited
        if os.getppid() == parent:
            return False
        log.warning("parent process %d exited: stopping", parent)
        return True

    try:
        Coordinator(cfg).serve_forever(parent_gone if a.exit_with_parent else None)
    except zmq.ZMQError as e:
        raise ValueError(f"cannot serve on {cfg.bind}: {e}") from None


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (``python -m tlt.coordinator``); returns the exit code."""
    p = add_arguments(argparse.ArgumentParser(prog="python -m tlt.coordinator", description=DESCRIPTION))
    a = p.parse_args(argv)
    try:
        serve_args(a)
    except ValueError as e:
        log.error("%s", e)
        return 2
    return 0
