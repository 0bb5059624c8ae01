"""Installing tlt changes no verl run that has TLT off: with the plugin loaded, every registry entry
verl had stays as it was (TLT only adds its own names), and the one wrapped function passes
through for other trainer modes. Compared against ``import verl`` with plugins disabled
(``VERL_USE_EXTERNAL_PLUGINS=none``), each in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'tlt-rollout[verl]')")

_DUMP = r"""
import json, verl
from verl.workers.rollout import base
from verl.workers.rollout.replica import RolloutReplicaRegistry
from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
from verl.trainer.ppo.v1 import trainer_base
import verl.utils.config as vc
replicas, trainers = RolloutReplicaRegistry._registry, trainer_base.TRAINER_REGISTRY
print(json.dumps({"rollout": {"/".join(k): str(v) for k, v in base._ROLLOUT_REGISTRY.items()},
                  "replica": sorted(map(str, replicas)), "trainer": sorted(map(str, trainers)),
                  "agent_loop": {k: str(v) for k, v in _agent_loop_registry.items()},
                  "validate_wrapped": getattr(vc.validate_config, "_tlt", False)}))
"""


def _dump(plugins: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    env["VERL_USE_EXTERNAL_PLUGINS"] = plugins
    p = subprocess.run([sys.executable, "-c", _DUMP], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_tlt_adds_its_own_names_and_changes_nothing_of_verls():
    stock, with_tlt = _dump("none"), _dump("auto")
    for name in ("rollout", "agent_loop"):
        for key, value in stock[name].items():
            assert with_tlt[name].get(key) == value, (name, key)  # verl's sglang adapter included
        assert set(with_tlt[name]) - set(stock[name]) <= {"tlt/async", "tlt_agent"}, with_tlt[name]
    assert set(stock["replica"]) <= set(with_tlt["replica"]) and set(with_tlt["replica"]) - set(stock["replica"]) <= {"tlt"}
    assert set(with_tlt["trainer"]) - set(stock["trainer"]) <= {"tlt"}
    assert not stock["validate_wrapped"] and with_tlt["validate_wrapped"]


def test_the_wrapped_validate_config_checks_tlt_runs_only():
    from omegaconf import OmegaConf

    import verl.utils.config as vc

    assert getattr(vc.validate_config, "_tlt", False)  # loaded by the plugin at import verl
    bad = {"tlt": {"spot": {"lr": -1}}}
    try:  # another trainer mode: a bad tlt.* value is none of TLT's business
        vc.validate_config(OmegaConf.create({"trainer": {"v1": {"trainer_mode": "sync"}}, **bad}))
    except SystemExit:
        pytest.fail("TLT checked a run that does not use the tlt trainer")
    except Exception:  # noqa: BLE001 - verl's own validation of this tiny config
        pass
    with pytest.raises(SystemExit) as e:
        vc.validate_config(OmegaConf.create({"trainer": {"v1": {"trainer_mode": "tlt"}}, **bad}))
    assert e.value.code == 2


def test_the_tlt_trainer_with_tlt_off_is_verls_sync_trainer(monkeypatch, tmp_path):
    """``trainer.v1.trainer_mode=tlt`` with ``tlt.enable=false``: every method TLT overrides hands
    verl's sync trainer its call and its result, and TLT starts nothing (no coordinator, no Ray,
    no file). verl's own methods are recorders here; the quick demo runs the same class for real
    with TLT on (tests/integrations/test_verl_loop.py)."""
    import ray
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1 import trainer_base
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    calls: list = []
    hooks = {"prepare_step": (), "on_sample_end": (), "on_step_end": (), "_init_resource_pool_mgr": (),
             "_build_replay_buffer": (), "_next_train_batch": (4,), "_balance_batch": ("batch", {}),
             "_compute_old_log_prob": ("batch", {}), "step": ({}, {}), "_compute_metrics": ("batch", {}, {}, 1, 0),
             "fit": ("agent_loop_manager",)}
    for name in hooks:
        monkeypatch.setattr(PPOTrainerSync, name, lambda self, *a, _n=name, **k: calls.append((_n, a)) or f"verl:{_n}")
    monkeypatch.setattr(PPOTrainerSync, "__init__", lambda self, config: calls.append(("__init__", ())))
    monkeypatch.chdir(tmp_path)
    config = OmegaConf.create({"tlt": {"enable": False}, "trainer": {"default_local_dir": str(tmp_path / "run")},
                               "actor_rollout_ref": {"rollout": {"name": "tlt"}}})
    trainer = trainer_base.TRAINER_REGISTRY["tlt"](config)
    for name, args in hooks.items():
        assert getattr(trainer, name)(*args) == f"verl:{name}", name
    assert calls == [("__init__", ())] + [(n, a) for n, a in hooks.items()]
    assert trainer._coordinator.proc is None and trainer._coordinator.driver is None and not ray.is_initialized()
    # every component exists from construction, TLT on or off
    assert trainer._consolidator is None and trainer._rounds is None and trainer._step_extra == {}
    assert trainer._window.stats == [] and trainer._resume.folder is None and not trainer._records.failures
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_holds_the_draft_history_of_its_own_step(monkeypatch, tmp_path):
    """verl's ``fit`` runs step, its checkpoint, ``on_step_end`` (TLT's resume state), then
    ``_compute_metrics``: the step's responses join the draft history in ``step``, so the TLT state
    saved with ``global_step_N`` holds steps 1..N (a resume drafts from step N's responses too).
    The tlt trainer's own hooks run; verl's below them, Ray and the replicas are stood in."""
    import ray
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from tlt.integrations.verl import resume, runtime
    from tlt.integrations.verl.config import TLTConfig
    from tlt.integrations.verl.drafter_push import DrafterPusher
    from tlt.integrations.verl.history_log import read_history
    from tlt.integrations.verl.run_records import RunRecords
    from tlt.integrations.verl.step_metrics import RolloutWindow
    from tlt.integrations.verl.trainer import TLTTrainer
    from tlt.push_guard import GuardConfig

    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: refs)
    for name in ("on_step_end", "_compute_metrics", "_save_checkpoint"):
        monkeypatch.setattr(PPOTrainerSync, name, lambda self, *a, **k: None)
    monkeypatch.setattr(PPOTrainer, "step", lambda self, metrics, timing_raw: "batch")

    class Replica:  # a Ray actor handle's shape: replica.method.remote(...) -> the result
        def __init__(self):
            self.tuner_state = types.SimpleNamespace(remote=lambda: None)
            self.add_history = types.SimpleNamespace(remote=lambda step, pairs: len(pairs))

    t = object.__new__(TLTTrainer)  # the hooks without verl's constructor (workers, datasets)
    t.tlt, t.timing_raw, t._uid_index, t._step_extra, t._rounds = TLTConfig(), {}, {}, {}, None
    t.config = types.SimpleNamespace(trainer=types.SimpleNamespace(default_local_dir=str(tmp_path)))
    replicas = [Replica(), Replica()]
    t._servers = lambda: replicas
    t._records = RunRecords(tmp_path / "tlt_steps.jsonl")
    t._pusher, t._resume, t._window = DrafterPusher(t._servers, GuardConfig()), resume.ResumePoint(), RolloutWindow()
    t._coordinator = types.SimpleNamespace(driver=None)
    t._step_responses = lambda batch: ([f"u{t.global_steps}_0_0"], [[1, 2]], [[10 + t.global_steps]])
    runtime.publish(runtime.Runtime(tlt=t.tlt, coordinator_address=None, spot_root=str(tmp_path / "spot"),
                                    run_dir=str(tmp_path)))
    for step in (1, 2, 3):  # fit()'s order, a checkpoint every step
        t.global_steps = step
        t.step({}, {})
        t._save_checkpoint()
        t.on_step_end()
        t._compute_metrics("batch", {}, {}, step, 0)
    for step in (1, 2, 3):
        assert list(read_history(tmp_path / f"global_step_{step}" / "tlt" / "history.jsonl")) == list(range(1, step + 1))
