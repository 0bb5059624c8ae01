"""Fixtures for coordinator tests: a coordinator on a random loopback port, worker clients, an event
log to wait on, and helpers to run workers/coordinators as real processes. Every wait is bounded."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tlt.coordinator import Coordinator, CoordinatorConfig, Event, PromotionConfig, WorkerClient, WorkerConfig

HB = 0.05                      # heartbeat interval used by every test (seconds)
REPO = Path(__file__).resolve().parents[2]


class EventLog:
    """Thread-safe list of coordinator events with a bounded wait."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._cv = threading.Condition()

    def __call__(self, e: Event) -> None:
        with self._cv:
            self.events.append(e)
            self._cv.notify_all()

    def of(self, kind: str, worker_id: str | None = None) -> list[Event]:
        with self._cv:
            return [e for e in self.events if e.kind == kind and worker_id in (None, e.worker_id)]

    def wait(self, pred: Callable[[], bool], timeout_s: float = 5.0) -> bool:
        end = time.monotonic() + timeout_s
        with self._cv:
            while not pred():
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def wait_kind(self, kind: str, worker_id: str | None = None, n: int = 1, timeout_s: float = 5.0) -> bool:
        return self.wait(lambda: len([e for e in self.events if e.kind == kind
                                      and worker_id in (None, e.worker_id)]) >= n, timeout_s)


def coordinator_config(bind: str = "tcp://127.0.0.1:0", **promotion) -> CoordinatorConfig:
    promotion.setdefault("idle_threshold", 2)
    promotion.setdefault("stop_timeout_s", 1.0)
    return CoordinatorConfig(bind=bind, heartbeat_interval_s=HB, liveness=3, promotion=PromotionConfig(**promotion))


def worker_config(address: str, worker_id: str, **kw) -> WorkerConfig:
    kw.setdefault("heartbeat_interval_s", HB)
    kw.setdefault("reconnect_initial_s", HB)
    kw.setdefault("reconnect_max_s", 4 * HB)
    return WorkerConfig(address=address, worker_id=worker_id, **kw)


@pytest.fixture
def events() -> EventLog:
    return EventLog()


@pytest.fixture
def make_coordinator(events):
    started: list[Coordinator] = []

    def make(bind: str = "tcp://127.0.0.1:0", **promotion) -> Coordinator:
        c = Coordinator(coordinator_config(bind, **promotion), on_event=events).start()
        started.append(c)
        return c

    yield make
    for c in started:
        c.stop()


@pytest.fixture
def make_worker():
    started: list[WorkerClient] = []

    def make(address: str, worker_id: str, *, connect: bool = True, **kw) -> WorkerClient:
        w = WorkerClient(worker_config(address, worker_id, **kw)).start()
        started.append(w)
        if connect:
            assert w.wait_connected(5), f"{worker_id} did not connect to {address}"
        return w

    yield make
    for w in started:
        w.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A ``python -c`` child run from the repo root; its stdout lines are collected by a thread."""

    def __init__(self, code: str, *args: str):
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.p = subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.lines = EventLog()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:  # ends when the child exits
            self.lines(line.strip())

    def wait_line(self, want: str, timeout_s: float = 10.0) -> bool:
        return self.lines.wait(lambda: want in self.lines.events, timeout_s)

    def reap(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        try:
            self.p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture
def procs():
    started: list[Proc] = []

    def make(code: str, *args: str) -> Proc:
        pr = Proc(code, *args)
        started.append(pr)
        return pr

    yield make
    for pr in started:
        pr.reap()
