"""Wire protocol of the worker coordinator: every constant, command and payload schema in one place.

A message is one ZeroMQ frame (the ROUTER side sees the peer identity frame in front of it)::

    HEADER + COMMAND + BODY
    HEADER  = b"TLTC" + bytes([VERSION])   4-byte magic + protocol version (mismatch: ProtocolError)
    COMMAND = bytes([Command])             one byte
    BODY    = msgpack map                  field name -> value; <= MAX_BODY_BYTES (MAX_LIST_BODY_BYTES
                                           for the coordinator's messages that list worker ids)

One frame, not one per part: pyzmq pays per frame, and a 4-frame ROUTER send measured ~2x the time
of a 2-frame one (identity + message) on the coordinator's hot path.

Each command has one frozen payload dataclass below. Construction validates types and ranges, so a
decoded message is either fully typed and in range or a ``ProtocolError`` was raised: receivers
catch it, log it and drop the peer; nothing on the wire can crash a loop.

Who sends what:

    worker -> coordinator   REGISTER, HEARTBEAT, STATE, STOPPED, DISCONNECT
    coordinator -> worker   WELCOME, HEARTBEAT, PROMOTE, SESSION, STOP, DISCONNECT
    driver -> coordinator   STEP_BEGIN, ROLLOUT_DONE
    coordinator -> driver   ACK (to STEP_BEGIN), OUTCOME (to ROLLOUT_DONE)

Ordering: every STATE / STOPPED / REGISTER carries ``seq``, strictly increasing per worker. A
PROMOTE echoes the ``seq`` of the report it was decided on; the worker accepts it only if it sent
nothing since (so a promotion that raced with a newer report is discarded, never half-applied).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Union

import msgpack

MAGIC = b"TLTC"
VERSION = 2                         # 2: SESSION carries an epoch and goes to every member
HEADER = MAGIC + bytes([VERSION])
PREFIX_BYTES = len(HEADER) + 1      # header + command byte
MAX_STR = 256                       # any string field (worker ids, addresses, reasons)
MAX_LIST = 4096                     # any list field; also the most workers a coordinator takes
MAX_INT = 2**53                     # ints stay exact in every language's JSON/msgpack
MAX_BODY_BYTES = 64 * 1024          # our limit; larger bodies are a ProtocolError ("oversized")
# A message that lists worker ids (PROMOTE, SESSION, OUTCOME; sent by the coordinator only) may
# carry MAX_LIST of them (its lists are disjoint sets of registered workers) at MAX_STR characters of
# up to 4 UTF-8 bytes each, beside its other fields.
MAX_LIST_BODY_BYTES = MAX_LIST * (4 * MAX_STR + 5) + MAX_BODY_BYTES
MAX_WIRE_BYTES = 4 * MAX_BODY_BYTES  # libzmq's ZMQ_MAXMSGSIZE at the coordinator: peers above it are cut
MAX_WIRE_BYTES_FROM_COORDINATOR = MAX_LIST_BODY_BYTES + 64  # the same at workers and drivers


class Command(enum.IntEnum):
    REGISTER = 1
    HEARTBEAT = 2
    STATE = 3
    STOPPED = 4
    DISCONNECT = 5
    WELCOME = 16
    PROMOTE = 17
    SESSION = 18
    STOP = 19
    STEP_BEGIN = 32
    ROLLOUT_DONE = 33
    ACK = 34
    OUTCOME = 35


class WorkerState(str, enum.Enum):
    """BUSY: serving rollout (or the GPU belongs to the RL step). IDLE: rollout requests done, GPU
    free. TRAINING: in a drafter training session. LOST: coordinator-side only (missed heartbeats,
    no STOP ack in time, or dropped); never sent by a worker."""

    BUSY = "BUSY"
    IDLE = "IDLE"
    TRAINING = "TRAINING"
    LOST = "LOST"


class Role(str, enum.Enum):
    LEADER = "leader"
    MEMBER = "member"


class ProtocolError(Exception):
    """Bad input from a peer. ``kind``: malformed | oversized | version | out_of_order | refused |
    unregistered (a worker command from a peer that has not registered: normal right after a
    coordinator restart; the DISCONNECT it gets makes a real worker re-register)."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


# ---- field validation (by annotation string; payload classes use `from __future__ annotations`)

def _v_str(v: Any) -> str:
    if not isinstance(v, str) or len(v) > MAX_STR:
        raise ValueError(f"expected a string of at most {MAX_STR} chars, got {type(v).__name__}")
    return v


def _v_int(v: Any) -> int:
    if type(v) is not int or not -MAX_INT <= v <= MAX_INT:
        raise ValueError(f"expected an int within +-2**53, got {type(v).__name__}")
    return v


def _v_float(v: Any) -> float:
    if type(v) not in (int, float) or not math.isfinite(v):
        raise ValueError(f"expected a finite number, got {type(v).__name__}")
    return float(v)


def _v_bool(v: Any) -> bool:
    if type(v) is not bool:
        raise ValueError(f"expected a bool, got {type(v).__name__}")
    return v


_STATE_OF = {**{s.value: s for s in WorkerState}, **{s: s for s in WorkerState}}
_ROLE_OF = {**{r.value: r for r in Role}, **{r: r for r in Role}}


def _v_state(v: Any) -> WorkerState:
    s = _STATE_OF.get(v) if isinstance(v, str) else None
    if s is None:
        raise ValueError(f"expected one of {[s.value for s in WorkerState]}")
    return s


def _v_role(v: Any) -> Role:
    r = _ROLE_OF.get(v) if isinstance(v, str) else None
    if r is None:
        raise ValueError(f"expected one of {[r.value for r in Role]}")
    return r


def _v_strs(v: Any) -> tuple[str, ...]:
    if not isinstance(v, (list, tuple)) or len(v) > MAX_LIST:
        raise ValueError(f"expected a list of at most {MAX_LIST} strings")
    return tuple(_v_str(x) for x in v)


_VALIDATORS = {"str": _v_str, "int": _v_int, "float": _v_float, "bool": _v_bool,
               "WorkerState": _v_state, "Role": _v_role, "tuple[str, ...]": _v_strs}


_SPECS: dict[type, tuple[tuple[str, Any], ...]] = {}  # payload class -> ((field, validator), ...)


def _spec(cls: type) -> tuple[tuple[str, Any], ...]:
    spec = _SPECS.get(cls)
    if spec is None:
        spec = _SPECS[cls] = tuple((f.name, _VALIDATORS[f.type]) for f in dataclasses.fields(cls))
    return spec


class _Payload:
    """Base of every payload: type-checks and normalises fields, then runs ``_check``."""

    COMMAND: ClassVar[Command]

    def __post_init__(self) -> None:
        for name, validate in _spec(type(self)):
            try:
                object.__setattr__(self, name, validate(getattr(self, name)))
            except ValueError as e:
                raise ProtocolError("malformed", f"{self.COMMAND.name}.{name}: {e}") from None
        self._check()

    def _check(self) -> None:
        pass

    def _require(self, ok: bool, what: str) -> None:
        if not ok:
            raise ProtocolError("malformed", f"{self.COMMAND.name}: {what}")

    def to_wire(self) -> dict[str, Any]:
        return {name: _plain(getattr(self, name)) for name, _ in _spec(type(self))}


def _plain(v: Any) -> Any:
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, tuple):
        return list(v)
    return v


_REPORTABLE = (WorkerState.BUSY, WorkerState.IDLE)


# ---- worker -> coordinator

@dataclass(frozen=True, kw_only=True)
class Register(_Payload):
    COMMAND: ClassVar[Command] = Command.REGISTER
    worker_id: str
    dp_group: int
    rank: int
    state: WorkerState   # BUSY or IDLE: a (re)registering worker is never TRAINING
    step: int
    seq: int
    address: str = ""    # rendezvous address of the trainer if this worker leads a session

    def _check(self) -> None:
        self._require(bool(self.worker_id), "worker_id must be non-empty")
        self._require(self.dp_group >= 0 and self.rank >= 0, "dp_group and rank must be >= 0")
        self._require(self.state in _REPORTABLE, "state must be BUSY or IDLE")
        self._require(self.step >= 0 and self.seq >= 0, "step and seq must be >= 0")


@dataclass(frozen=True, kw_only=True)
class Heartbeat(_Payload):
    COMMAND: ClassVar[Command] = Command.HEARTBEAT


@dataclass(frozen=True, kw_only=True)
class State(_Payload):
    """A transition report. TRAINING (with ``session``) accepts a PROMOTE; BUSY/IDLE otherwise."""

    COMMAND: ClassVar[Command] = Command.STATE
    state: WorkerState
    step: int
    seq: int
    session: int = -1

    def _check(self) -> None:
        self._require(self.state is not WorkerState.LOST, "LOST is never reported by a worker")
        self._require(self.step >= 0 and self.seq >= 0, "step and seq must be >= 0")
        self._require((self.state is WorkerState.TRAINING) == (self.session >= 0),
                      "session is set exactly when state is TRAINING")


@dataclass(frozen=True, kw_only=True)
class Stopped(_Payload):
    """Training of ``session`` stopped (checkpoint written if ``ok``); the worker is now ``state``."""

    COMMAND: ClassVar[Command] = Command.STOPPED
    session: int
    step: int
    seq: int
    state: WorkerState
    ok: bool = True

    def _check(self) -> None:
        self._require(self.session >= 0 and self.step >= 0 and self.seq >= 0,
                      "session, step and seq must be >= 0")
        self._require(self.state in _REPORTABLE, "state after stopping must be BUSY or IDLE")


@dataclass(frozen=True, kw_only=True)
class Disconnect(_Payload):
    COMMAND: ClassVar[Command] = Command.DISCONNECT
    reason: str = ""


# ---- coordinator -> worker

@dataclass(frozen=True, kw_only=True)
class Welcome(_Payload):
    COMMAND: ClassVar[Command] = Command.WELCOME
    coordinator_id: str
    heartbeat_ms: int


@dataclass(frozen=True, kw_only=True)
class Promote(_Payload):
    """You are ``role`` of training session ``session`` for data-parallel group ``dp_group``."""

    COMMAND: ClassVar[Command] = Command.PROMOTE
    session: int
    step: int
    dp_group: int
    role: Role
    leader: str
    leader_address: str
    members: tuple[str, ...]  # leader first, then members in join order (this worker included)
    seq: int                  # echo of the report this decision was based on


@dataclass(frozen=True, kw_only=True)
class Session(_Payload):
    """The membership of ``session`` from now on (sent to every member when it forms or changes).

    ``epoch`` is unique across all sessions of one coordinator and grows with every change, so a
    trainer forms one process group per epoch (its rendezvous port can be derived from it) and
    re-forms when a newer epoch arrives (a member joined or was lost)."""

    COMMAND: ClassVar[Command] = Command.SESSION
    session: int
    epoch: int
    members: tuple[str, ...]  # leader first, then members in join order


@dataclass(frozen=True, kw_only=True)
class Stop(_Payload):
    """Stop training ``session``, checkpoint, and answer STOPPED within ``deadline_ms``."""

    COMMAND: ClassVar[Command] = Command.STOP
    session: int
    step: int
    reason: str
    deadline_ms: int


# ---- driver <-> coordinator

@dataclass(frozen=True, kw_only=True)
class StepBegin(_Payload):
    COMMAND: ClassVar[Command] = Command.STEP_BEGIN
    step: int
    req: int


@dataclass(frozen=True, kw_only=True)
class RolloutDone(_Payload):
    """Rollout of ``step`` finished: stop all training; reply OUTCOME within ``deadline_ms``."""

    COMMAND: ClassVar[Command] = Command.ROLLOUT_DONE
    step: int
    req: int
    deadline_ms: int

    def _check(self) -> None:
        self._require(self.deadline_ms > 0, "deadline_ms must be > 0")


@dataclass(frozen=True, kw_only=True)
class Ack(_Payload):
    COMMAND: ClassVar[Command] = Command.ACK
    req: int


@dataclass(frozen=True, kw_only=True)
class Outcome(_Payload):
    """Answer to ROLLOUT_DONE: who acked STOP, who missed the deadline, who was lost meanwhile."""

    COMMAND: ClassVar[Command] = Command.OUTCOME
    req: int
    step: int
    stopped: tuple[str, ...]
    timed_out: tuple[str, ...]
    lost: tuple[str, ...]
    elapsed_ms: float


Message = Union[Register, Heartbeat, State, Stopped, Disconnect, Welcome, Promote, Session, Stop,
                StepBegin, RolloutDone, Ack, Outcome]
PAYLOADS: dict[Command, type] = {c.COMMAND: c for c in (
    Register, Heartbeat, State, Stopped, Disconnect, Welcome, Promote, Session, Stop,
    StepBegin, RolloutDone, Ack, Outcome)}
assert set(PAYLOADS) == set(Command), "every command needs a payload class"
_FIELDS = {cmd: frozenset(f.name for f in dataclasses.fields(cls)) for cmd, cls in PAYLOADS.items()}
_REQUIRED = {cmd: frozenset(f.name for f in dataclasses.fields(cls)
                            if f.default is dataclasses.MISSING) for cmd, cls in PAYLOADS.items()}


_PREFIXES = {cmd: HEADER + bytes([cmd]) for cmd in Command}
_BODY_LIMIT = {cmd: MAX_LIST_BODY_BYTES if any(f.type == "tuple[str, ...]" for f in dataclasses.fields(cls))
               else MAX_BODY_BYTES for cmd, cls in PAYLOADS.items()}


def encode(msg: Message) -> list[bytes]:
    """Message -> [frame]. Raises ProtocolError if the body exceeds the limit."""
    body = msgpack.packb(msg.to_wire(), use_bin_type=True)
    limit = _BODY_LIMIT[msg.COMMAND]
    if len(body) > limit:
        raise ProtocolError("oversized", f"{msg.COMMAND.name} body is {len(body)} bytes > {limit}")
    return [_PREFIXES[msg.COMMAND] + body]


def decode(frames: list[bytes]) -> Message:
    """[frame] -> typed message, or ProtocolError. Never raises anything else."""
    if len(frames) != 1:
        raise ProtocolError("malformed", f"expected 1 frame, got {len(frames)}")
    frame = frames[0]
    if len(frame) < PREFIX_BYTES or frame[: len(MAGIC)] != MAGIC:
        raise ProtocolError("malformed", f"bad header {bytes(frame[:16])!r}")
    if frame[len(MAGIC)] != VERSION:
        raise ProtocolError("version", f"peer speaks protocol version {frame[len(MAGIC)]}, this side {VERSION}")
    if frame[len(HEADER)] not in PAYLOADS:
        raise ProtocolError("malformed", f"unknown command {frame[len(HEADER)]}")
    cmd = Command(frame[len(HEADER)])
    body = frame[PREFIX_BYTES:]
    if len(body) > _BODY_LIMIT[cmd]:
        raise ProtocolError("oversized", f"{cmd.name} body is {len(body)} bytes > {_BODY_LIMIT[cmd]}")
    try:
        fields = msgpack.unpackb(body, raw=False, use_list=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types (ExtraData, FormatError, ValueError, ...)
        raise ProtocolError("malformed", f"{cmd.name} body is not msgpack: {type(e).__name__}") from None
    if not isinstance(fields, dict):
        raise ProtocolError("malformed", f"{cmd.name} body is not a map")
    names = set(fields)
    if not names <= _FIELDS[cmd] or not _REQUIRED[cmd] <= names:
        raise ProtocolError("malformed", f"{cmd.name} fields {sorted(map(str, names))} != "
                            f"schema {sorted(_FIELDS[cmd])}")
    return PAYLOADS[cmd](**fields)
