"""The verl ``tlt.*`` config: dataclasses, shipped YAML and Hydra composition agree.

Proves that ``configs/tlt/default.yaml`` documents exactly the :class:`TLTConfig` defaults (same
keys, same values); that unknown keys, wrong types and out-of-range values fail with a one-line
ValueError naming the full dotted key and the value; that ``from_verl`` treats an absent ``tlt``
section as "disabled"; that ``tlt_grpo`` / ``tlt_grpo_cpu`` compose through Hydra on top of verl's
``ppo_trainer`` defaults with ``tlt.*`` overrides that need no "+"; and that ``check_verl_config``
rejects a non-tlt rollout backend only while TLT is enabled.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import yaml
from omegaconf import OmegaConf

import tlt.configs
from tlt.rollout.strategy import Arm
from tlt.integrations.verl.config import RENAMED, TLTConfig, from_verl

CONFIG_DIR = os.path.dirname(os.path.abspath(tlt.configs.__file__))
DEFAULT_YAML = os.path.join(CONFIG_DIR, "tlt", "default.yaml")
HAS_VERL = importlib.util.find_spec("verl") is not None
needs_verl = pytest.mark.skipif(not HAS_VERL, reason="verl is not installed: no ppo_trainer defaults")


def _load_default() -> dict:
    with open(DEFAULT_YAML) as f:
        return yaml.safe_load(f)


def _field_keys(cls: type, prefix: str = "") -> set[str]:
    keys = set()
    for f in dataclasses.fields(cls):
        keys.add(prefix + f.name)
        default = getattr(cls(), f.name)
        if dataclasses.is_dataclass(default):
            keys |= _field_keys(type(default), f"{prefix}{f.name}.")
    return keys


def _yaml_keys(data: dict, prefix: str = "") -> set[str]:
    keys = set()
    for k, v in data.items():
        keys.add(prefix + k)
        if isinstance(v, dict):
            keys |= _yaml_keys(v, f"{prefix}{k}.")
    return keys


def _with(dotted: str, value) -> dict:
    """{"a": {"b": value}} for "a.b" (the mapping under ``tlt``)."""
    out: dict = {}
    node = out
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return out


# ------------------------------------------------------------------ 1. YAML == dataclass defaults
def test_default_yaml_equals_dataclass_defaults():
    data = _load_default()
    assert TLTConfig.from_mapping(data) == TLTConfig()
    assert TLTConfig.from_mapping(data).to_dict() == TLTConfig().to_dict()


def test_default_yaml_keys_match_dataclass_fields():
    yaml_keys, field_keys = _yaml_keys(_load_default()), _field_keys(TLTConfig)
    renamed = {old.removeprefix("tlt.") for old in RENAMED}  # kept as null for one release
    assert yaml_keys - field_keys == renamed, "keys in default.yaml that TLTConfig does not have"
    assert field_keys - yaml_keys == set(), "TLTConfig fields not documented in default.yaml"


# ------------------------------------------------------------------ 2. unknown keys
@pytest.mark.parametrize("dotted, allowed", [
    ("foo", ["buffer", "drafter", "enable", "replay_poll_s", "spot"]),
    ("spot.lrr", ["base_port", "lr", "token_budget", "ttt_steps"]),
    ("coordinator.heartbeat", ["heartbeat_s", "liveness"]),
])
def test_unknown_key_names_full_key_and_allowed(dotted, allowed):
    with pytest.raises(ValueError) as ei:
        TLTConfig.from_mapping(_with(dotted, 1))
    msg = str(ei.value)
    assert f"tlt.{dotted}" in msg
    for key in allowed:
        assert key in msg
    assert "\n" not in msg


# ------------------------------------------------------------------ 3. wrong types, out of range
@pytest.mark.parametrize("dotted, value", [
    ("spot.lr", -1),
    ("spot.lr", "fast"),
    ("spot.lr", True),
    ("enable", "yes"),
    ("speculation.elastic_threshold", -1),
    ("speculation.elastic_threshold", 1.5),
    ("speculation.arm", "4,1"),
    ("speculation.arm", "4,1,9"),          # a depth-4 chain has 4 candidate nodes
    ("buffer.dtype", "int8"),
    ("drafter.method", "medusa"),
    ("replay_poll_s", 0),
    ("spot.base_port", 80),
    ("spot.preempt_s", 0),
    ("spot.nice", 20),
    ("spot.warmup_steps", -1),
    ("coordinator.heartbeat_s", 120),
    ("engine.max_batch", 0),
    ("engine.block_size", 0),
    ("engine.kv_blocks", 8),               # without a block_size
    ("engine.eviction", "oldest"),
    ("spot", 3),
    ("tail.batching.prompt_factor", 0.5),
    ("tail.batching.response_factor", 17),
    ("tail.batching.long_round_at", -1),
    ("tail.consolidate.train_value", float("nan")),
    ("tail.consolidate.move_s", float("nan")),
])
def test_bad_value_names_key_and_value(dotted, value):
    with pytest.raises(ValueError) as ei:
        TLTConfig.from_mapping(_with(dotted, value))
    msg = str(ei.value)
    assert f"tlt.{dotted}=" in msg
    assert repr(value) in msg
    assert "\n" not in msg


def test_every_buffer_dtype_the_config_accepts_the_buffer_stores():
    """One list: a dtype the driver's check lets through must not fail later in every replica's actor
    (float16 once did: the config allowed it, the DataBuffer did not)."""
    from tlt.drafter.buffer import BufferConfig

    with pytest.raises(ValueError, match="tlt.buffer.dtype='float16'"):
        TLTConfig.from_mapping({"buffer": {"dtype": "float16"}})
    for dtype in ("float32", "bfloat16"):
        cfg = TLTConfig.from_mapping({"buffer": {"dtype": dtype}})
        BufferConfig(dtype=cfg.buffer.dtype, max_bytes=cfg.buffer.max_mb << 20)  # the replica's construction


def test_valid_values_parse():
    cfg = TLTConfig.from_mapping({"speculation": {"arm": "4,1,4"}, "spot": {"lr": 1, "base_port": 20000}})
    assert cfg.speculation.parsed_arm() == Arm(4, 1, 4)
    assert cfg.spot.lr == 1.0 and isinstance(cfg.spot.lr, float)
    assert cfg.spot.base_port == 20000
    assert TLTConfig().speculation.parsed_arm() is None


def test_spot_warmup_reaches_the_trainers_lr_schedule():
    from tlt.integrations.verl.spot_wiring import spot_config

    spot = spot_config(TLTConfig.from_mapping({"spot": {"lr": 0.01, "warmup_steps": 4}}), seed=0)
    assert [spot.lr_at(s) for s in range(5)] == pytest.approx([0.0025, 0.005, 0.0075, 0.01, 0.01])


# ------------------------------------------------------------------ 4. from_verl
def test_from_verl_without_tlt_section_disables():
    cfg = OmegaConf.create({"trainer": {"device": "cpu"}})
    assert from_verl(cfg).enable is False


def test_from_verl_validates_tlt_section():
    cfg = OmegaConf.create({"tlt": {"spot": {"lr": "${lr}"}, "engine": {"threads": 2}}, "lr": 0.01})
    tlt = from_verl(cfg)
    assert tlt.enable is True and tlt.spot.lr == 0.01 and tlt.engine.threads == 2
    with pytest.raises(ValueError, match=r"tlt\.buffer\.dtype='int8'"):
        from_verl(OmegaConf.create({"tlt": {"buffer": {"dtype": "int8"}}}))
    with pytest.raises(ValueError, match=r"tlt\.spot\.lrr"):
        from_verl(OmegaConf.create({"tlt": {"spot": {"lrr": 1}}}))


# ------------------------------------------------------------------ 5. Hydra composition
def _compose(name: str, overrides: list[str]):
    import hydra

    with hydra.initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return hydra.compose(config_name=name, overrides=overrides)


@needs_verl
@pytest.mark.parametrize("name", ["tlt_grpo", "tlt_grpo_cpu"])
def test_hydra_composes_with_verl_defaults(name):
    cfg = _compose(name, ["tlt.spot.lr=0.001", "tlt.speculation.arm='4,1,4'"])
    assert cfg.trainer.v1.trainer_mode == "tlt"
    assert cfg.actor_rollout_ref.rollout.name == "tlt"
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.tlt.spot.lr == 0.001
    assert "train_batch_size" in cfg.data            # merged from pkg://verl.trainer.config
    assert "ppo_mini_batch_size" in cfg.actor_rollout_ref.actor
    if name == "tlt_grpo_cpu":
        assert cfg.trainer.device == "cpu"
        assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.VERL_PLATFORM == "cpu"
    else:
        assert cfg.trainer.device != "cpu"
    tlt = from_verl(cfg)
    assert isinstance(tlt, TLTConfig) and tlt.enable
    assert tlt.spot.lr == 0.001 and tlt.speculation.parsed_arm() == Arm(4, 1, 4)
    assert dataclasses.replace(tlt, spot=TLTConfig().spot, speculation=TLTConfig().speculation) == TLTConfig()


@needs_verl
def test_hydra_composes_through_config_module():
    import hydra

    with hydra.initialize_config_module(config_module="tlt.configs", version_base=None):
        cfg = hydra.compose(config_name="tlt_grpo", overrides=["tlt.enable=false"])
    assert "train_batch_size" in cfg.data
    assert from_verl(cfg).enable is False


@needs_verl
def test_hydra_rejects_unknown_tlt_key():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="tlt.nope"):
        _compose("tlt_grpo", ["tlt.nope=1"])


def test_a_renamed_key_still_works_with_a_warning_naming_the_new_one():
    with pytest.warns(DeprecationWarning, match="tlt.speculation.ngram is renamed tlt.speculation.suffix"):
        assert TLTConfig.from_mapping({"speculation": {"ngram": False}}).speculation.suffix is False
    assert TLTConfig.from_mapping({"speculation": {"ngram": None}}) == TLTConfig()  # null: as if absent
    with pytest.warns(DeprecationWarning):  # beside the new key at its default (Hydra fills defaults in)
        assert TLTConfig.from_mapping({"speculation": {"ngram": False, "suffix": True}}).speculation.suffix is False
    with pytest.raises(ValueError, match="give tlt.speculation.suffix only"):
        TLTConfig.from_mapping({"speculation": {"ngram": True, "suffix": False}})


@needs_verl
def test_hydra_still_takes_a_renamed_key():
    with pytest.warns(DeprecationWarning, match="renamed tlt.speculation.suffix"):
        assert from_verl(_compose("tlt_grpo", ["tlt.speculation.ngram=false"])).speculation.suffix is False


# ------------------------------------------------------------------ 6. check_verl_config
def _verl_like(rollout: str, enable: bool):
    return OmegaConf.create({
        "tlt": {"enable": enable},
        "actor_rollout_ref": {"rollout": {"name": rollout, "checkpoint_engine": {"backend": "naive"}},
                              "actor": {"ulysses_sequence_parallel_size": 1}},
    })


def test_check_verl_config_rejects_foreign_rollout():
    from tlt.integrations.verl.verl_checks import check_verl_config

    cfg = _verl_like("vllm", enable=True)
    with pytest.raises(ValueError) as ei:
        check_verl_config(cfg, from_verl(cfg))
    msg = str(ei.value)
    assert "actor_rollout_ref.rollout.name" in msg and "'vllm'" in msg and "\n" not in msg
    check_verl_config(_verl_like("tlt", enable=True), from_verl(_verl_like("tlt", enable=True)))
    off = _verl_like("vllm", enable=False)
    check_verl_config(off, from_verl(off))  # TLT disabled: verl's own rollout is fine


@needs_verl
def test_shipped_config_passes_check_verl_config():
    from tlt.integrations.verl.verl_checks import check_verl_config

    cfg = _compose("tlt_grpo", [])
    check_verl_config(cfg, from_verl(cfg))


@needs_verl
@pytest.mark.parametrize("override, key", [
    ("data.gen_batch_size=16", "data.gen_batch_size=16"),
    ("tlt.tail.batching.long_round_at=3", "tlt.tail.batching.long_round_at=3"),
    ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.enable=true"),
    ("trainer.v1.sampler.sync_refill_failed_groups=true", "sync_refill_failed_groups=true"),
    ("actor_rollout_ref.rollout.agent.default_agent_loop=single_turn_agent", "default_agent_loop=tlt_agent"),
])
def test_tail_batching_refuses_what_it_cannot_work_with(override, key):
    from tlt.integrations.verl.verl_checks import check_verl_config

    cfg = _compose("tlt_grpo", ["tlt.tail.batching.enable=true", "data.train_batch_size=8", override])
    with pytest.raises(ValueError) as ei:
        check_verl_config(cfg, from_verl(cfg))
    assert key in str(ei.value) and "\n" not in str(ei.value)
    ok = _compose("tlt_grpo", ["tlt.tail.batching.enable=true", "data.train_batch_size=8"])
    check_verl_config(ok, from_verl(ok))


def test_engine_keys_map_verls_rollout_settings():
    """max_num_seqs caps the replica's batch; with a paged cache, gpu_memory_utilization sizes the pool
    on a GPU (kv_blocks when given), and on CPU the pool keeps max_batch rows' worth."""
    static = TLTConfig.from_mapping({"engine": {"max_batch": 64}}).engine
    assert static.engine_keys(max_num_seqs=1024, gpu_memory_utilization=0.5, cuda=True) == {"max_batch": 64}
    assert static.engine_keys(max_num_seqs=16, gpu_memory_utilization=None, cuda=False) == {"max_batch": 16}
    paged = TLTConfig.from_mapping({"engine": {"block_size": 16, "eviction": "most-tokens"}}).engine
    assert paged.engine_keys(max_num_seqs=None, gpu_memory_utilization=0.4, cuda=True) == {
        "max_batch": 64, "block_size": 16, "eviction": "most-tokens", "kv_fraction": 0.4}
    assert "kv_fraction" not in paged.engine_keys(max_num_seqs=None, gpu_memory_utilization=0.4, cuda=False)
    sized = TLTConfig.from_mapping({"engine": {"block_size": 16, "kv_blocks": 4096}}).engine
    assert sized.engine_keys(max_num_seqs=None, gpu_memory_utilization=0.4, cuda=True)["kv_blocks"] == 4096
    from tlt.rollout.engine import EngineConfig

    EngineConfig(max_len=512, **paged.engine_keys(max_num_seqs=8, gpu_memory_utilization=0.4, cuda=True))


@needs_verl
@pytest.mark.parametrize("overrides, key", [
    (["actor_rollout_ref.rollout.max_num_seqs=0"], "actor_rollout_ref.rollout.max_num_seqs=0"),
    (["tlt.engine.block_size=16", "actor_rollout_ref.rollout.gpu_memory_utilization=1.5"],
     "actor_rollout_ref.rollout.gpu_memory_utilization=1.5"),
    (["tlt.engine.block_size=16", "tlt.engine.kv_blocks=2"], "tlt.engine.kv_blocks=2"),
    # spot training with nothing captured would never run
    (["tlt.buffer.capture=off"], "tlt.buffer.capture=rollout"),
    # a drafter trained for replicas that serve none: every push refused
    (["tlt.speculation.enable=false"], "set tlt.drafter.train=false"),
    # replica r rendezvous at base_port + 256 r + 0..255: the last one must stay a port
    (["tlt.spot.base_port=60000", "trainer.n_gpus_per_node=22"], "use at most 59904"),
])
def test_memory_settings_the_engine_cannot_honour_are_refused_before_ray(overrides, key):
    cfg = _compose("tlt_grpo", overrides)
    assert key in _refusal(cfg)
    from tlt.integrations.verl.verl_checks import check_verl_config

    ok = _compose("tlt_grpo", ["tlt.engine.block_size=16", "tlt.engine.kv_blocks=100000"])
    check_verl_config(ok, from_verl(ok))


# ------------------------------------------------------------------ 7. SGLang replicas in a tlt run
def _sglang_run(monkeypatch, version: str | None, **tlt):
    from tlt.integrations.sglang import launch

    monkeypatch.setattr(launch, "installed_version", lambda: version)
    cfg = _verl_like("sglang", enable=True)
    cfg.tlt = OmegaConf.merge(cfg.tlt, tlt)
    cfg.trainer = {"n_gpus_per_node": 2, "nnodes": 1}
    cfg.actor_rollout_ref.rollout.tensor_model_parallel_size = 1
    return cfg


def _refusal(cfg) -> str:
    from tlt.integrations.verl.verl_checks import check_verl_config

    with pytest.raises(ValueError) as ei:
        check_verl_config(cfg, from_verl(cfg))
    assert "\n" not in str(ei.value)
    return str(ei.value)


def test_sglang_rollout_is_accepted_with_the_capture_it_needs(monkeypatch):
    from tlt.integrations.verl.verl_checks import check_verl_config

    ok = _sglang_run(monkeypatch, "0.5.23", buffer={"capture": "old_log_prob"})
    check_verl_config(ok, from_verl(ok))
    msg = _refusal(_sglang_run(monkeypatch, "0.5.23"))  # the default capture=rollout
    assert "tlt.buffer.capture=rollout" in msg and "old_log_prob" in msg
    assert "pip install" in _refusal(_sglang_run(monkeypatch, None, buffer={"capture": "old_log_prob"}))
    for untested in ("0.4.9", "0.5.15", "0.5.24", "0.6.0"):  # its hooks and request formats were never checked
        assert "TLT supports 0.5.12 and 0.5.23" in _refusal(_sglang_run(monkeypatch, untested)), untested
    two = _sglang_run(monkeypatch, "0.5.23", buffer={"capture": "old_log_prob"}, sglang={"attach": "h:1"})
    assert "names 1 servers for 2 replicas" in _refusal(two)


def test_sglang_0512_without_a_warmup_drafter_is_refused_or_runs_ngram(monkeypatch):
    from tlt.integrations.sglang import launch
    from tlt.integrations.verl.verl_checks import check_verl_config

    msg = _refusal(_sglang_run(monkeypatch, "0.5.12", buffer={"capture": "old_log_prob"}))
    assert "tlt warmup" in msg and "0.5.23" in msg and "tlt.sglang.algorithm=ngram" in msg
    for keys in ({"sglang": {"algorithm": "ngram"}}, {"drafter": {"init_path": "/w"}, "buffer": {"capture": "old_log_prob"}}):
        cfg = _sglang_run(monkeypatch, "0.5.12", **keys)
        check_verl_config(cfg, from_verl(cfg))
    warm = from_verl(_sglang_run(monkeypatch, "0.5.12", drafter={"init_path": "/w", "method": "eagle3"}))
    args = launch.server_args(warm, version="0.5.12", drafter_path="/x", max_running_requests=64)
    assert args["speculative_algorithm"] == "EAGLE3" and args["custom_weight_loader"] == [launch.DRAFT_LOADER]
    assert args["speculative_adaptive"] is True and args["max_running_requests"] == 64
    fresh = from_verl(_sglang_run(monkeypatch, "0.5.23", sglang={"adaptive_config": "/slots.json"}))
    assert launch.plan(fresh, "0.5.23") == "eagle-fresh"
    args = launch.server_args(fresh, version="0.5.23", drafter_path="/x", max_running_requests=64)
    assert "custom_weight_loader" not in args and args["speculative_adaptive_config"] == "/slots.json"
    ngram = from_verl(_sglang_run(monkeypatch, "0.5.12", sglang={"algorithm": "ngram"}))
    assert launch.server_args(ngram, version="0.5.12", drafter_path=None, max_running_requests=8)[
        "speculative_algorithm"] == "NGRAM"
