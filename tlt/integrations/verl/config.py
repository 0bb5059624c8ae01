"""The ``tlt.*`` section of a verl GRPO config: frozen dataclasses, validated before workers spawn.

Owns every key TLT reads from the verl YAML (defaults in ``configs/tlt/default.yaml``, documented
in docs/verl.md), the conversion from the YAML mapping, and the one-line errors: an unknown key,
a wrong type or a value out of range names the full key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import types
import typing
import warnings
from collections.abc import Mapping
from typing import Any, Literal

from tlt.rollout.history import HistoryConfig
from tlt.rollout.strategy import Arm

log = logging.getLogger(__name__)


def _bad(key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"tlt config: {key}={value!r} is not allowed; {allowed}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterSection:
    method: str = "eagle"          # eagle | eagle3
    init_path: str | None = None   # a `tlt warmup` drafter dir; None: n-gram until spot training
    train: bool = True             # spot-train on idle replicas (false: the drafter stays frozen)
    # push guard (tlt.push_guard): a pushed drafter whose live EAGLE accept gain is under this
    # fraction of its held-out gain is rolled back (0: soft check off; the digest check always runs)
    guard_fraction: float = 0.25
    guard_min_verifies: int = 32   # EAGLE verifies the soft check needs for a verdict

    def check(self, p: str) -> None:
        if self.method not in ("eagle", "eagle3"):
            raise _bad(f"{p}.method", self.method, "use eagle or eagle3")
        if not 0.0 <= self.guard_fraction <= 1.0:
            raise _bad(f"{p}.guard_fraction", self.guard_fraction, "use a float in [0, 1] (0: soft check off)")
        if self.guard_min_verifies < 1:
            raise _bad(f"{p}.guard_min_verifies", self.guard_min_verifies, "use an int >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculationSection:
    enable: bool = True
    elastic_threshold: int | None = None  # cap: speculate only at <= this many requests; None: learned
    arm: str | None = None         # fixed strategy "DEPTH,TOPK,TOKENS_TO_VERIFY" ("0,0,0" = off); None: BEG-MAB
    # the model-free suffix drafter (prompt, GRPO group, earlier steps' responses) as arms beside EAGLE
    suffix: bool = True
    history_visits: int = 2        # a prompt's responses from its last this many rollouts draft for it (0: none)
    history_global_tokens: int = 8192  # a pool of recent responses across prompts (0: none)
    max_draft_tokens: int = 64

    def history_config(self) -> HistoryConfig | None:
        """The suffix drafter's history bounds (None: no history)."""
        if not self.history_visits and not self.history_global_tokens:
            return None
        return HistoryConfig(visits=self.history_visits, global_tokens=self.history_global_tokens)

    def check(self, p: str) -> None:
        if self.elastic_threshold is not None and self.elastic_threshold < 0:
            raise _bad(f"{p}.elastic_threshold", self.elastic_threshold, "use null (learned) or an int >= 0")
        if self.max_draft_tokens < 1:
            raise _bad(f"{p}.max_draft_tokens", self.max_draft_tokens, "use an int >= 1")
        if self.history_visits < 0 or self.history_global_tokens < 0:
            raise _bad(f"{p}.history_visits / history_global_tokens", (self.history_visits, self.history_global_tokens),
                       "use ints >= 0 (0: off)")
        if self.arm is not None:
            self.parsed_arm(p)

    def parsed_arm(self, p: str = "tlt.speculation") -> Arm | None:
        if self.arm is None:
            return None
        try:
            depth, topk, ttv = (int(x) for x in str(self.arm).split(","))
            arm = Arm(depth, topk, ttv)
        except ValueError as e:
            raise _bad(f"{p}.arm", self.arm, f"use DEPTH,TOPK,TOKENS_TO_VERIFY, e.g. 4,1,4 ({e})") from None
        if arm.tokens_to_verify > self.max_draft_tokens:
            raise _bad(f"{p}.arm", self.arm, f"tokens to verify must be <= max_draft_tokens="
                       f"{self.max_draft_tokens}")
        return arm


PORT_SPAN = 256  # rendezvous ports per replica above tlt.spot.base_port


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpotSection:
    lr: float = 3e-4
    warmup_steps: int = 0          # the first spot optimizer steps ramp the lr up linearly (0: none)
    token_budget: int = 2048       # tokens per replica per micro-step
    interval: int = 10             # optimizer steps between async selective checkpoints
    min_idle: int = 1              # idle replicas needed before a training session starts
    base_port: int = 0             # rendezvous ports base + 256 * replica ...; 0 = a free span found at start
    checkpoint_dir: str | None = None  # default: <trainer.default_local_dir>/tlt_spot
    ttt_steps: int = 3             # training-time-test unroll steps
    preempt_s: float = 0.025       # micro-steps run in chunks of about this long: stop latency
    nice: int = 0                  # a session thread's nice value (19: training yields a shared CPU to rollout)

    def check(self, p: str) -> None:
        if not 0 < self.lr <= 1:
            raise _bad(f"{p}.lr", self.lr, "use a float in (0, 1]")
        if self.warmup_steps < 0:
            raise _bad(f"{p}.warmup_steps", self.warmup_steps, "use an int >= 0 (0: the full lr from the first step)")
        if not 0 <= self.nice <= 19:
            raise _bad(f"{p}.nice", self.nice, "use a nice value in 0..19 (0: the replica process's own)")
        if not 0.001 <= self.preempt_s <= 10:
            raise _bad(f"{p}.preempt_s", self.preempt_s, "use seconds in [0.001, 10]")
        for name in ("token_budget", "interval", "min_idle", "ttt_steps"):
            if getattr(self, name) < 1:
                raise _bad(f"{p}.{name}", getattr(self, name), "use an int >= 1")
        if self.base_port and not 1024 <= self.base_port <= 60000:
            raise _bad(f"{p}.base_port", self.base_port, "use 0 (automatic) or a port in 1024..60000")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BufferSection:
    max_mb: int = 1024             # host memory for hidden states, per replica
    dtype: str = "float32"         # float32 | bfloat16 (the DataBuffer's storage dtypes)
    # where the drafter's training features come from: the rollout's own forwards (the policy
    # being rolled out), verl's old-log-prob forward (one step later), or nowhere
    capture: Literal["rollout", "old_log_prob", "off"] = "rollout"

    def check(self, p: str) -> None:
        if self.max_mb < 1:
            raise _bad(f"{p}.max_mb", self.max_mb, "use an int >= 1 (MiB)")
        from tlt.drafter.buffer import DTYPES  # the buffer's own list: the two checks cannot drift

        if self.dtype not in DTYPES:
            raise _bad(f"{p}.dtype", self.dtype, "use " + " or ".join(DTYPES))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordinatorSection:
    enable: bool = True
    heartbeat_s: float = 0.5
    liveness: int = 6              # missed heartbeats before a peer is lost
    done_timeout_s: float = 10.0   # rollout end: wait this long for trainers to stop

    def check(self, p: str) -> None:
        if not 0.01 <= self.heartbeat_s <= 60:
            raise _bad(f"{p}.heartbeat_s", self.heartbeat_s, "use 0.01..60 seconds")
        if self.liveness < 2:
            raise _bad(f"{p}.liveness", self.liveness, "use an int >= 2")
        if not self.done_timeout_s > 0:
            raise _bad(f"{p}.done_timeout_s", self.done_timeout_s, "use seconds > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSection:
    max_batch: int = 64            # requests one replica decodes together (at most rollout.max_num_seqs)
    batch_window_ms: float = 20.0  # wait this long for more requests before starting a batch
    threads: int = 0               # torch threads per replica process; 0 = torch's default
    # the KV cache: null = one row of prompt_length + response_length per request (static); N = a
    # paged cache of N-position blocks (docs/rollout.md, "Memory"), sized by kv_blocks or, on a GPU,
    # by rollout.gpu_memory_utilization, evicting requests by ``eviction`` when it runs out
    block_size: int | None = None
    kv_blocks: int | None = None   # null: on a GPU, gpu_memory_utilization; on CPU, max_batch rows' worth
    eviction: Literal["youngest", "fewest-tokens", "most-tokens"] = "youngest"

    def check(self, p: str) -> None:
        if self.max_batch < 1:
            raise _bad(f"{p}.max_batch", self.max_batch, "use an int >= 1")
        if not 0 <= self.batch_window_ms <= 10_000:
            raise _bad(f"{p}.batch_window_ms", self.batch_window_ms, "use 0..10000 ms")
        if self.threads < 0:
            raise _bad(f"{p}.threads", self.threads, "use an int >= 0")
        if self.block_size is not None and self.block_size < 1:
            raise _bad(f"{p}.block_size", self.block_size, "use null (a row per request) or positions per block >= 1")
        if self.kv_blocks is not None and (self.block_size is None or self.kv_blocks < 1):
            raise _bad(f"{p}.kv_blocks", self.kv_blocks, f"set {p}.block_size too, and use an int >= 1")

    def batch(self, max_num_seqs: int | None) -> int:
        """The most requests a replica's engine decodes at once: ``max_batch``, capped by verl's
        ``rollout.max_num_seqs``."""
        return min(self.max_batch, max_num_seqs or self.max_batch)

    def engine_keys(self, *, max_num_seqs: int | None, gpu_memory_utilization: float | None,
                    cuda: bool) -> dict[str, Any]:
        """The replica engine's ``EngineConfig`` keys these settings and verl's rollout settings of the
        same meaning give: ``max_batch`` capped by ``max_num_seqs``; a paged pool of ``kv_blocks``, or
        on a GPU ``gpu_memory_utilization`` of its memory (less the weights) as ``kv_fraction``."""
        keys: dict[str, Any] = {"max_batch": self.batch(max_num_seqs)}
        if self.block_size is not None:
            keys |= {"block_size": self.block_size, "eviction": self.eviction}
            if self.kv_blocks is not None:
                keys["kv_blocks"] = self.kv_blocks
            elif cuda and gpu_memory_utilization is not None:
                keys["kv_fraction"] = gpu_memory_utilization
        return keys


@dataclasses.dataclass(frozen=True, kw_only=True)
class SGLangSection:
    """Only read with ``actor_rollout_ref.rollout.name=sglang`` (docs/sglang.md)."""

    # eagle: servers start with EAGLE and the warm-up (or, on 0.5.23, a fresh) drafter; ngram:
    # SGLang's NGRAM for the whole run (no drafter training)
    algorithm: Literal["eagle", "ngram"] = "eagle"
    adaptive_config: str | None = None  # --speculative-adaptive-config FILE; None: TLT's slots
    # "HOST:PORT,HOST:PORT": one already-running SGLang server per replica (launched with TLT's
    # arguments: docs/sglang.md) instead of one launched by each replica's server actor
    attach: str | None = None
    readback_elements: int = 64    # hard check: draft-weight elements read back per canary tensor

    def check(self, p: str) -> None:
        if self.attach is not None:
            self.attached(p)
        if self.readback_elements < 1:
            raise _bad(f"{p}.readback_elements", self.readback_elements, "use an int >= 1")

    def attached(self, p: str = "tlt.sglang") -> list[tuple[str, int]]:
        out = []
        for part in (self.attach or "").split(","):
            host, _, port = part.strip().rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise _bad(f"{p}.attach", self.attach, "use HOST:PORT[,HOST:PORT...] (one per replica)")
            out.append((host, int(port)))
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConsolidateSection:
    """``tlt.tail.consolidate``: requests move between replicas in the rollout's tail
    (:mod:`tlt.coordinator.consolidation`; the project's engine only)."""

    # off | reallocate (RLHFSpec: balance) | consolidate (RLHFuse: the tail onto few replicas) |
    # auto (the cost model picks per decision)
    mode: Literal["off", "reallocate", "consolidate", "auto"] = "off"
    interval_s: float = 0.1        # seconds between decisions during a rollout
    knee: float = 0.9              # reallocation's theta: smallest batch reaching this share of peak throughput
    remaining_share: float = 0.2   # mode consolidate: once at most this share of the step's requests run
    train_value: float = 0.5       # rollout seconds one replica-second freed for spot training is worth
    move_s: float | None = None    # a move's cost in seconds; null: measured by the replicas

    def check(self, p: str) -> None:
        if not 0.005 <= self.interval_s <= 60:
            raise _bad(f"{p}.interval_s", self.interval_s, "use 0.005..60 seconds")
        if not 0 < self.knee <= 1:
            raise _bad(f"{p}.knee", self.knee, "use a float in (0, 1]")
        if not 0 <= self.remaining_share <= 1:
            raise _bad(f"{p}.remaining_share", self.remaining_share, "use a float in [0, 1]")
        if not 0 <= self.train_value < math.inf:  # (NaN too)
            raise _bad(f"{p}.train_value", self.train_value, "use a float >= 0 (0: freeing replicas is worth nothing)")
        if self.move_s is not None and not 0 <= self.move_s < math.inf:
            raise _bad(f"{p}.move_s", self.move_s, "use null (measured) or seconds >= 0")

    def rules(self, max_batch: int):
        """The consolidation rules' settings (its ``move_s`` is set per decision)."""
        from tlt.coordinator.consolidation import ConsolidationConfig

        return ConsolidationConfig(mode=self.mode, knee=self.knee, remaining_share=self.remaining_share,
                                   max_batch=max_batch, train_value=self.train_value, move_s=self.move_s or 0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchingSection:
    """``tlt.tail.batching``: RollPacker's tail batching (:mod:`tlt.integrations.verl.tail_batching`).
    A short round launches ``prompt_factor`` x the step's prompts with ``response_factor`` x
    ``rollout.n`` responses each, trains the first prompts to finish ``rollout.n`` responses and
    drops the rest into a queue; a long round runs queued prompts to the end."""

    enable: bool = False
    prompt_factor: float = 1.25    # prompts a short round launches, per prompt a step trains
    response_factor: float = 1.25  # responses a short round launches per prompt, per response trained
    long_round_at: int = 0         # queued prompts that start a long round; 0: one step's prompts

    def check(self, p: str) -> None:
        if not 1 <= self.prompt_factor <= 16:
            raise _bad(f"{p}.prompt_factor", self.prompt_factor, "use a number in [1, 16]")
        if not 1 <= self.response_factor <= 16:
            raise _bad(f"{p}.response_factor", self.response_factor, "use a number in [1, 16]")
        if self.long_round_at < 0:
            raise _bad(f"{p}.long_round_at", self.long_round_at,
                       "use 0 (one step's prompts) or a count >= data.train_batch_size")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TailSection:
    consolidate: ConsolidateSection = ConsolidateSection()
    batching: BatchingSection = BatchingSection()

    def check(self, p: str) -> None:
        self.consolidate.check(f"{p}.consolidate")
        self.batching.check(f"{p}.batching")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TLTConfig:
    enable: bool = True            # false: none of TLT's hooks run (plain sync trainer)
    drafter: DrafterSection = DrafterSection()
    speculation: SpeculationSection = SpeculationSection()
    spot: SpotSection = SpotSection()
    buffer: BufferSection = BufferSection()
    coordinator: CoordinatorSection = CoordinatorSection()
    engine: EngineSection = EngineSection()
    sglang: SGLangSection = SGLangSection()
    tail: TailSection = TailSection()
    record_path: str | None = None  # JSON lines, one per RL step; default <default_local_dir>/tlt_steps.jsonl
    route_groups: bool = True      # a GRPO group's samples go to one replica (all siblings visible to drafts)
    replay_poll_s: float = 0.05    # verl's replay buffer polls every 2.0 s (hard-coded): lowered

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if dataclasses.is_dataclass(section):
                section.check(f"tlt.{f.name}")
        if not 0.001 <= self.replay_poll_s <= 10:
            raise _bad("tlt.replay_poll_s", self.replay_poll_s, "use 0.001..10 seconds")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> TLTConfig:
        """Build from the YAML ``tlt`` mapping (plain dict or OmegaConf container)."""
        return _build(cls, {} if data is None else data, "tlt")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Keys renamed, old -> new: the old one is read, with a warning naming the new one, until the next
# release (configs/tlt/default.yaml keeps it as null, so Hydra still takes an override of it).
RENAMED = {"tlt.speculation.ngram": "suffix"}
_WARNED: set[str] = set()


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(data, Mapping):
        raise _bad(prefix, data, "use a mapping of keys")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    data = _renamed(data, prefix, fields)
    for key, value in data.items():
        if key not in fields:
            raise ValueError(f"tlt config: {prefix}.{key} is not a TLT key; {prefix} has "
                             f"{', '.join(sorted(fields))}")
        kwargs[key] = _coerce(hints[key], value, f"{prefix}.{key}")
    return cls(**kwargs)


def _renamed(data: Mapping[str, Any], prefix: str, fields: dict) -> Mapping[str, Any]:
    """``data`` with each renamed key under its new name (a null old key: absent). The old key wins
    over the new one at its default (Hydra fills defaults in), and a different value is refused."""
    out = dict(data)
    for old, new in RENAMED.items():
        section, _, key = old.rpartition(".")
        if section != prefix or key not in out:
            continue
        value = out.pop(key)
        if value is None:
            continue
        if out.get(new, value) not in (value, fields[new].default):
            raise ValueError(f"tlt config: {old}={value!r} and {prefix}.{new}={out[new]!r}: {old} is the old name "
                             f"of {prefix}.{new}; give {prefix}.{new} only")
        message = f"tlt config: {old} is renamed {prefix}.{new}; the old name stops working in the next release"
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        if old not in _WARNED:  # the log line once per process (the config is read in several places)
            _WARNED.add(old)
            log.warning(message)
        out[new] = value
    return out


def _coerce(tp: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return _build(tp, value if value is not None else {}, key)
    args = typing.get_args(tp)
    if typing.get_origin(tp) is Literal:
        if value is False and "off" in args:  # YAML 1.1 reads a bare `off` as false
            return "off"
        if value in args:
            return value
        raise _bad(key, value, "use " + ", ".join(map(str, args)))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        tp = next(a for a in args if a is not type(None))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _bad(key, value, "use true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _bad(key, value, "use an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _bad(key, value, "use a number")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise _bad(key, value, "use a string")
    raise AssertionError(f"unhandled config type {tp} for {key}")  # internal: a field type above


def from_verl(config: Any) -> TLTConfig:
    """The ``tlt`` section of a verl DictConfig (absent -> TLT disabled)."""
    from omegaconf import OmegaConf

    section = OmegaConf.select(config, "tlt", default=None)
    if section is None:
        return TLTConfig(enable=False)
    data = OmegaConf.to_container(section, resolve=True) if OmegaConf.is_config(section) else section
    return TLTConfig.from_mapping(data)
