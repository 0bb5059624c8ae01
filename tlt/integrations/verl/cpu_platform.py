"""verl 0.9.1 on a machine without an accelerator: a CPU platform and four small shims.

Owns what makes stock verl's GRPO loop run on CPU through public registries only (no verl edit),
each a blocker measured on a 2-core machine:

- a ``cpu`` platform for verl's ``PlatformRegistry`` (gloo, device ``cpu``; Ray's fake ``GPU``
  slots, ``ray_kwargs.ray_init.num_gpus=N``, place the ranks);
- ``initialize_global_process_group_ray`` builds ``cpu:gloo,cpu:gloo`` from the platform: passed
  ``gloo`` instead;
- verl's FSDP engines are registered for ``cuda``/``npu`` only: registered for ``cpu`` too;
- verl gives forward-only engines ``CPUOffloadPolicy(pin_memory=True)`` (the reference model),
  and pinning needs an accelerator: on CPU the policy is built with ``pin_memory=False``.

Nothing here runs unless the process selected the CPU platform (``VERL_PLATFORM=cpu``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os

import torch

log = logging.getLogger(__name__)


def cpu_selected() -> bool:
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu"


class _CPUDeviceModule:
    """``torch.cpu`` plus the ``torch.cuda`` calls verl makes unconditionally (memory stats, cache)."""

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def memory_allocated(*args, **kwargs) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(*args, **kwargs) -> None:
        return None

    @staticmethod
    def mem_get_info(*args, **kwargs) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return vm.available, vm.total

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def get_device_name(*args, **kwargs) -> str:
        return "cpu"

    @staticmethod
    def get_rng_state(*args, **kwargs) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, *args, **kwargs) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def set_device(*args, **kwargs) -> None:
        return None

    ipc_collect = set_per_process_memory_fraction = set_device

    @staticmethod
    def synchronize(*args, **kwargs) -> None:
        return None


def register_platform() -> None:
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = _CPUDeviceModule()

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return cpu_selected()  # never auto-detected: only VERL_PLATFORM=cpu selects it

        def current_device(self):  # verl moves batches with .to(get_device_id())
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            return None

        def synchronize(self, device_index=None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"  # what Ray sets for its (fake) GPU slots

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self):
            return None


def patch_process_group() -> None:
    import verl.utils.distributed as vdist

    original = vdist.initialize_global_process_group_ray
    if getattr(original, "_tlt_cpu", False):
        return

    @functools.wraps(original)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    initialize_global_process_group_ray._tlt_cpu = True
    vdist.initialize_global_process_group_ray = initialize_global_process_group_ray
    # Modules that imported the name before this ran keep the original: patch them too.
    import verl.workers.engine_workers as ew

    if getattr(ew, "initialize_global_process_group_ray", None) is original:
        ew.initialize_global_process_group_ray = initialize_global_process_group_ray


def register_engines() -> None:
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl as ti

    for model_type, cls in (("language_model", ti.FSDPEngineWithLMHead),
                            ("value_model", ti.FSDPEngineWithValueHead)):
        EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device="cpu")(cls)

    original = ti.CPUOffloadPolicy
    if getattr(original, "_tlt_cpu", False):
        return

    def cpu_offload_policy(*args, pin_memory: bool = True, **kwargs):
        return original(*args, pin_memory=False, **kwargs)  # pinning needs an accelerator

    cpu_offload_policy._tlt_cpu = True
    ti.CPUOffloadPolicy = cpu_offload_policy


def install() -> None:
    """Register the CPU platform; apply the shims when this process runs on it."""
    register_platform()
    if cpu_selected():
        patch_process_group()
        register_engines()
        log.debug("tlt: verl CPU platform shims installed")
