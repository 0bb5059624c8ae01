"""Wire format: round trips, and every kind of bad input ends in ProtocolError (never another error)."""

from __future__ import annotations

import random

import msgpack
import pytest

from tlt.coordinator import protocol as P
from tlt.coordinator.protocol import ProtocolError, WorkerState

SAMPLES = [
    P.Register(worker_id="w0", dp_group=1, rank=2, state=WorkerState.IDLE, step=3, seq=4, address="tcp://h:1"),
    P.Heartbeat(),
    P.State(state=WorkerState.BUSY, step=1, seq=2),
    P.State(state=WorkerState.TRAINING, step=1, seq=3, session=7),
    P.Stopped(session=7, step=1, seq=4, state=WorkerState.BUSY, ok=False),
    P.Disconnect(reason="bye"),
    P.Welcome(coordinator_id="c", heartbeat_ms=50),
    P.Promote(session=7, step=1, dp_group=0, role=P.Role.MEMBER, leader="w0", leader_address="tcp://h:2",
              members=("w0", "w1"), seq=2),
    P.Session(session=7, epoch=3, members=("w0", "w1", "w2")),
    P.Stop(session=7, step=1, reason="rollout_done", deadline_ms=1000),
    P.StepBegin(step=2, req=1),
    P.RolloutDone(step=2, req=2, deadline_ms=500),
    P.Ack(req=1),
    P.Outcome(req=2, step=2, stopped=("w0",), timed_out=(), lost=("w1",), elapsed_ms=3.5),
]


def test_every_command_has_a_sample():
    assert {type(m).COMMAND for m in SAMPLES} == set(P.Command)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    frames = P.encode(msg)
    assert len(frames) == 1 and frames[0][:6] == P.HEADER + bytes([msg.COMMAND])
    assert P.decode(frames) == msg


def _frame(cmd: int, body: bytes, header: bytes = P.HEADER) -> list[bytes]:
    return [header + bytes([cmd]) + body]


def _frames(cmd: P.Command, body: dict) -> list[bytes]:
    return _frame(cmd, msgpack.packb(body))


GOOD_REGISTER = dict(worker_id="w", dp_group=0, rank=0, state="IDLE", step=0, seq=1)


@pytest.mark.parametrize("frames,kind", [
    (_frame(P.Command.HEARTBEAT, b"\x80", P.MAGIC + bytes([P.VERSION + 1])), "version"),
    (_frame(P.Command.HEARTBEAT, b"\x80", b"XXXX\x01"), "malformed"),             # bad magic
    ([P.HEADER], "malformed"),                                                     # no command byte
    (_frame(P.Command.HEARTBEAT, b"\x80") + [b"extra"], "malformed"),              # extra frame
    (_frame(0xEE, b"\x80"), "malformed"),                                          # unknown command
    (_frame(P.Command.REGISTER, msgpack.packb(GOOD_REGISTER)[:-3]), "malformed"),  # truncated
    (_frame(P.Command.REGISTER, b"\xc1\xc1\xc1"), "malformed"),                    # not msgpack
    (_frame(P.Command.REGISTER, msgpack.packb([1, 2])), "malformed"),             # not a map
    (_frame(P.Command.REGISTER, msgpack.packb({1: 2})), "malformed"),             # non-string key
    (_frame(P.Command.HEARTBEAT, b"\x80"), None),                                  # (valid, for contrast)
    (_frame(P.Command.HEARTBEAT, b"\x80" + b"\x00" * (P.MAX_BODY_BYTES + 1)), "oversized"),
    ([b"hello"], "malformed"),
    ([b""], "malformed"),
    ([], "malformed"),
])
def test_bad_frames(frames, kind):
    if kind is None:
        assert P.decode(frames) == P.Heartbeat()
        return
    with pytest.raises(ProtocolError) as e:
        P.decode(frames)
    assert e.value.kind == kind


@pytest.mark.parametrize("change", [
    {"worker_id": ""},                    # empty id
    {"worker_id": "x" * (P.MAX_STR + 1)},  # too long
    {"dp_group": True},                   # bool is not an int
    {"dp_group": "0"},
    {"rank": -1},
    {"step": 2**60},                      # beyond 2**53
    {"state": "TRAINING"},                # never registers as TRAINING
    {"state": "LOST"},
    {"state": "SLEEPY"},
    {"seq": 1.0},
    {"extra": 1},                         # unknown field
    {"seq": None},
])
def test_bad_register_fields(change):
    body = {**GOOD_REGISTER, **change}
    with pytest.raises(ProtocolError) as e:
        P.decode(_frames(P.Command.REGISTER, body))
    assert e.value.kind == "malformed"


def test_missing_field_and_field_rules():
    body = dict(GOOD_REGISTER)
    del body["seq"]
    with pytest.raises(ProtocolError):
        P.decode(_frames(P.Command.REGISTER, body))
    with pytest.raises(ProtocolError):  # TRAINING needs a session, BUSY must not have one
        P.State(state=WorkerState.TRAINING, step=0, seq=1)
    with pytest.raises(ProtocolError):
        P.State(state=WorkerState.BUSY, step=0, seq=1, session=3)
    with pytest.raises(ProtocolError):
        P.decode(_frames(P.Command.OUTCOME, dict(req=1, step=1, stopped=[], timed_out=[], lost=[],
                                                 elapsed_ms=float("nan"))))
    with pytest.raises(ProtocolError):
        P.decode(_frames(P.Command.SESSION, dict(session=1, members=["a", 3])))


def test_the_largest_member_list_fits_and_more_is_refused():
    """A coordinator takes at most MAX_LIST workers, each id MAX_STR characters of up to 4 bytes: a
    message listing all of them goes through; bodies past the limit are refused both ways."""
    ids = tuple(f"{i:04d}" + "\U0001d11e" * (P.MAX_STR - 4) for i in range(P.MAX_LIST))
    biggest = P.Promote(session=1, step=1, dp_group=0, role=P.Role.MEMBER, leader=ids[0],
                        leader_address="\U0001d11e" * P.MAX_STR, members=ids, seq=P.MAX_INT)
    frames = P.encode(biggest)
    assert len(frames[0]) > 4_000_000 and len(frames[0]) <= P.MAX_WIRE_BYTES_FROM_COORDINATOR
    assert P.decode(frames) == biggest
    triple = P.Outcome(req=1, step=1, stopped=ids, timed_out=ids, lost=ids, elapsed_ms=1.0)
    with pytest.raises(ProtocolError) as e:
        P.encode(triple)
    assert e.value.kind == "oversized"
    with pytest.raises(ProtocolError) as e:  # a message without lists keeps the small limit
        P.decode(_frame(P.Command.REGISTER, b"\x80" + b"\x00" * (P.MAX_BODY_BYTES + 1)))
    assert e.value.kind == "oversized"


def test_fuzz_only_protocol_errors():
    """Random bytes and random mutations of valid messages: decode returns or raises ProtocolError."""
    rng = random.Random(0)
    valid = [P.encode(m) for m in SAMPLES]
    for i in range(3000):
        frames = [bytes(f) for f in rng.choice(valid)]
        if i % 3 == 0:
            frames = [rng.randbytes(rng.randint(0, 40)) for _ in range(rng.randint(0, 4))]
        else:
            j = rng.randrange(len(frames))
            b = bytearray(frames[j])
            for _ in range(rng.randint(1, 4)):
                op = rng.randrange(3)
                if op == 0 and b:
                    b[rng.randrange(len(b))] = rng.randrange(256)
                elif op == 1 and b:
                    del b[rng.randrange(len(b)):]
                else:
                    b.insert(rng.randint(0, len(b)), rng.randrange(256))
            frames[j] = bytes(b)
        try:
            P.decode(frames)
        except ProtocolError:
            pass
