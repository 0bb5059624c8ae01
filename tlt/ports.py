"""Free loopback ports for the coordinator endpoint and the spot trainers' rendezvous spans."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port(span: int = 1) -> int:
    """A loopback port ``p`` such that ``p .. p+span-1`` were free a moment ago. Spans (rendezvous
    base ports) are picked below the kernel's ephemeral range, where no outgoing connection or
    port-0 listener (gloo, ZeroMQ, probes) can take one of them later."""
    if span == 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        p = rng.randrange(10_000, max(10_001, low - span))
        if all(_free(q) for q in range(p, p + span)):
            return p
    raise RuntimeError(f"no {span} consecutive free loopback ports below {low}")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux default


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False
