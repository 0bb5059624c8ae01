"""Which SGLang functions TLT hooks, per SGLang version, and proof that every hook landed.

Owns the hook table (:data:`TABLE`: version -> hooks), installing it through SGLang's own
``HookRegistry`` and checking the result. SGLang only logs a hook whose target does not resolve,
so :func:`install` applies the registry itself and then looks at every target: a hook is *applied*
when what SGLang's code will call there is TLT's (the class itself for a class replacement, else a
registry wrapper holding TLT's hook, possibly under other wrappers). Anything else is *missing*,
and :func:`install` raises :class:`HooksMissing`.

Versions: the table has an entry per supported SGLang release (0.5.12, 0.5.23); another version
uses the entry of the newest supported release not above it, with a warning (and ``tlt doctor
sglang`` shows which hooks landed there).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import logging
import pkgutil
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

SUPPORTED = ("0.5.12", "0.5.23")


@dataclasses.dataclass(frozen=True)
class Hook:
    target: str  # dotted path SGLang's HookRegistry resolves
    kind: str  # "replace" | "before" | "after" | "around"
    impl: str  # "module:attr" of TLT's hook (imported only when installed)
    why: str


_H = "tlt.integrations.sglang.hook_impls"
_ADAPTIVE = "sglang.srt.speculative.adaptive_spec_params"
_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_RB = "tlt.integrations.sglang.readback"
_READBACK = "push guard's hard check: names tlt.draft/<name> read the draft model's weights"


def _common() -> tuple[Hook, ...]:
    return (
        Hook(f"{_SCHED}.set_internal_state", "around", f"{_H}:guard_internal_state",
             "lossless guard: /set_internal_state may not lower an accept threshold"),
        Hook("sglang.srt.sampling.sampling_params.SamplingParams.verify", "after", f"{_H}:guard_sampling_params",
             "lossless guard per request: min_p, sampling under forced greedy n-gram verify"),
        Hook(f"{_SCHED}.process_batch_result", "after", f"{_H}:idle_after_batch",
             "idle signal: BUSY while requests run (TLT_COORDINATOR)"),
        Hook(f"{_SCHED}.on_idle", "after", f"{_H}:idle_after_on_idle",
             "idle signal: IDLE when no request is left (TLT_COORDINATOR)"),
    )


def _table_0512() -> tuple[Hook, ...]:
    return (
        Hook(f"{_ADAPTIVE}.AdaptiveSpeculativeParams", "replace", f"{_H}:EmaTuner",
             "BEG-MAB picks the EAGLE step count per batch-size slot (0.5.12: decided after each verify, "
             "steps >= 1)"),
        Hook("sglang.srt.server_args.ServerArgs.__post_init__", "around", f"{_H}:server_args_post_init_0512",
             "lossless guard on the server arguments; max-running-requests warning"),
        Hook("sglang.srt.managers.scheduler_update_weights_mixin.SchedulerUpdateWeightsMixin.get_weights_by_name",
             "around", f"{_RB}:around_get_weights_by_name", _READBACK),
    ) + _common()


def _table_0523() -> tuple[Hook, ...]:
    return (
        Hook(f"{_ADAPTIVE}.AdaptiveSpeculativeParams", "replace", f"{_H}:Tuner",
             "BEG-MAB picks the EAGLE step count per batch-size slot; steps=0 is the elastic switch"),
        Hook(f"{_ADAPTIVE}._load_adaptive_config", "around", f"{_H}:load_adaptive_config",
             "TLT's slots when no --speculative-adaptive-config is given (bucketed graph capture)"),
        Hook("sglang.srt.server_args.ServerArgs.resolve_once", "after", f"{_H}:server_args_resolved_0523",
             "lossless guard on the resolved server arguments; max-running-requests warning"),
        Hook("sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
             ".get_weights_by_name", "around", f"{_RB}:around_get_weights_by_name", _READBACK),
    ) + _common()


TABLE: dict[str, Callable[[], tuple[Hook, ...]]] = {"0.5.12": _table_0512, "0.5.23": _table_0523}


class HooksMissing(RuntimeError):
    pass


def version_key(v: str) -> tuple[int, ...]:
    """``"0.5.23+cu129"`` -> ``(0, 5, 23)``: release numbers compare as numbers."""
    return tuple(int(x) for x in v.split("+")[0].split(".")[:3] if x.isdigit())


def sglang_version() -> str:
    import sglang

    return getattr(sglang, "__version__", None) or importlib.metadata.version("sglang")


def table_for(version: str) -> tuple[str, tuple[Hook, ...]]:
    """(supported version whose table applies, its hooks)."""
    older = [v for v in SUPPORTED if version_key(v) <= version_key(version)]
    chosen = older[-1] if older else SUPPORTED[0]
    if chosen != version:
        log.warning("TLT: SGLang %s is not a tested version (%s); using the hooks of %s",
                    version, ", ".join(SUPPORTED), chosen)
    return chosen, TABLE[chosen]()


def _impl(h: Hook) -> Any:
    mod, attr = h.impl.split(":")
    return getattr(importlib.import_module(mod), attr)


def register(hooks: tuple[Hook, ...]) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for h in hooks:
        impl = _impl(h)
        if any(fn is impl for _, fn, _ in getattr(HookRegistry, "_hooks", {}).get(h.target, ())):
            continue  # already registered in this process (the plugin ran before the doctor)
        HookRegistry.register(h.target, impl, HookType[h.kind.upper()])


def landed(h: Hook) -> bool:
    """True when what SGLang will call at ``h.target`` is TLT's hook."""
    try:
        owner_path, attr = h.target.rsplit(".", 1)
        owner = pkgutil.resolve_name(owner_path)
        current = owner.__dict__.get(attr, getattr(owner, attr, None)) if isinstance(owner, type) \
            else getattr(owner, attr, None)
    except Exception:  # noqa: BLE001 - an unresolvable target is exactly a missing hook
        return False
    current = getattr(current, "__func__", current)  # classmethod / staticmethod
    impl = _impl(h)
    if h.kind == "replace" and isinstance(impl, type):
        return current is impl
    for _ in range(16):  # HookRegistry's wrappers close over the hook and chain via __wrapped__
        if current is None:
            return False
        if current is impl or any(_cell(c) is impl for c in (getattr(current, "__closure__", None) or ())):
            return True
        current = getattr(current, "__wrapped__", None)
    return False


def _cell(c: Any) -> Any:
    try:
        return c.cell_contents
    except ValueError:  # an empty cell
        return None


def status(hooks: tuple[Hook, ...]) -> tuple[list[str], list[str]]:
    applied = [h.target for h in hooks if landed(h)]
    return applied, [h.target for h in hooks if h.target not in applied]


def apply() -> tuple[str, str, tuple[Hook, ...], list[str], list[str]]:
    """Register this SGLang's hook table and apply it, as every SGLang process does at start.
    Returns (SGLang version, table version, hooks, applied targets, missing targets)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    version = sglang_version()
    table_version, hooks = table_for(version)
    register(hooks)
    HookRegistry.apply_hooks()  # idempotent; SGLang applies again after every plugin ran
    return (version, table_version, hooks, *status(hooks))


def install() -> None:
    """:func:`apply`, then raise :class:`HooksMissing` if any hook did not land."""
    version, table_version, _, applied, missing = apply()
    if missing:
        raise HooksMissing(f"TLT's SGLang plugin: {len(missing)} hook(s) did not land on SGLang {version} "
                           f"(table {table_version}): {', '.join(missing)}. This SGLang is not supported "
                           f"as installed; run `tlt doctor sglang` for details")
    log.info("TLT hooks applied on SGLang %s: %d", version, len(applied))
