"""The ``verl.plugins`` entry point: registers TLT with verl in every process that imports verl.

Owns registration, in this order: the ``tlt_agent`` agent loop (request seeds; on import), the
``tlt_varlen_sdpa`` attention function (packed rows without flash-attn), the CPU platform and its
shims (only when ``VERL_PLATFORM=cpu``), the ``tlt`` rollout backend (replica + worker-side
adapter) and the ``tlt`` trainer mode. Everything it adds is under TLT's own names,
and the one verl function it wraps (``validate_config``, to check ``tlt.*`` before Ray starts)
passes through unless ``trainer.v1.trainer_mode=tlt``: with TLT off, verl behaves as stock
(``tests/tlt/test_verl_stock.py``). TLT's adapter for verl's ``sglang`` rollout (target-only
policy pushes) is installed by the tlt trainer's worker class, in the workers of a run with TLT
on (:mod:`tlt.integrations.verl.worker`), never at import.
verl only DEBUG-logs a plugin that fails to load, so a failure here prints its traceback to
stderr and is remembered (:mod:`tlt.integrations.verl.verl_checks`): the ``tlt`` trainer refuses
to start with it. Imports go one way: this module imports the trainer, never the reverse.
"""

from __future__ import annotations

import sys
import traceback

from tlt.integrations.verl.verl_checks import registration_failed


def register() -> None:
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from tlt.integrations.verl import agent_loop, cpu_platform, replica, varlen_attention  # noqa: F401

    varlen_attention.register()
    cpu_platform.install()
    RolloutReplicaRegistry.register("tlt", replica.load_replica)
    base._ROLLOUT_REGISTRY[("tlt", "async")] = "tlt.integrations.verl.replica.TLTRolloutAdapter"
    # after the CPU platform: verl's trainer modules ask the platform for the device at import. The
    # import registers trainer_mode=tlt; a script that imported the trainer first (which imported
    # verl, which runs this) gets a half-loaded module here, registered once it finishes loading
    from tlt.integrations.verl import trainer  # noqa: F401
    _validate_in_driver()


def _validate_in_driver() -> None:
    """Check ``tlt.*`` where verl's entry point validates its own config: in the driver, before
    Ray starts (``verl.trainer.main_ppo`` imports ``validate_config`` after ``import verl`` ran
    this plugin, so it picks up the wrapper). A bad value ends the run with one line."""
    import verl.utils.config as vc

    original = vc.validate_config
    if getattr(original, "_tlt", False):
        return

    def validate_config(config, *args, **kwargs):
        from omegaconf import OmegaConf

        from tlt.integrations.verl.config import from_verl
        from tlt.integrations.verl.verl_checks import check_verl_config

        if OmegaConf.select(config, "trainer.v1.trainer_mode", default=None) == "tlt":
            try:
                check_verl_config(config, from_verl(config))
            except ValueError as e:
                sys.stderr.write(f"error: {e}\n")  # the driver's user-facing line (before logging is set up)
                raise SystemExit(2) from None
        return original(config, *args, **kwargs)

    validate_config._tlt = True
    vc.validate_config = validate_config


try:
    register()
except Exception:  # noqa: BLE001 - reported loudly, then refused by the trainer
    _tb = traceback.format_exc()
    registration_failed(_tb)
    sys.stderr.write(f"tlt: registering the verl plugin failed:\n{_tb}\n")  # verl only DEBUG-logs it
