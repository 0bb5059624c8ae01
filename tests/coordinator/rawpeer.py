"""A raw DEALER speaking (or abusing) the protocol by hand, for tests that need exact frames."""

from __future__ import annotations

import time

import zmq

from tlt.coordinator import protocol as P


class RawPeer:
    def __init__(self, endpoint: str, ctx: zmq.Context | None = None):
        self.sock = (ctx or zmq.Context.instance()).socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, msg: P.Message) -> None:
        self.send_frames(P.encode(msg))

    def send_frames(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout_s: float = 2.0, kind: type | None = None) -> P.Message | None:
        """Next message (of type ``kind`` if given, skipping others) within ``timeout_s``, else None."""
        end = time.monotonic() + timeout_s
        while (left := end - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1):
                return None
            msg = P.decode(self.sock.recv_multipart())
            if kind is None or isinstance(msg, kind):
                return msg
        return None

    def register(self, worker_id: str, state: str = "BUSY", seq: int = 1, **kw) -> P.Welcome | None:
        self.send(P.Register(worker_id=worker_id, dp_group=kw.get("dp_group", 0), rank=0,
                             state=P.WorkerState(state), step=kw.get("step", 0), seq=seq))
        return self.recv(kind=P.Welcome)

    def close(self) -> None:
        self.sock.close(linger=0)
