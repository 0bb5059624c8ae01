"""TLT's hook implementations inside SGLang (what :mod:`tlt.integrations.sglang.hook_table` installs).

Owns the adapters between SGLang's objects and TLT's plain-Python parts: the tuner
classes (:mod:`.adaptive`), the lossless guard (:mod:`.guard`) and the idle signal (:mod:`.idle`).
Signatures follow SGLang's ``HookRegistry``: AFTER ``fn(result, *args)``, AROUND
``fn(original, *args)``. SGLang is imported lazily, inside the hooks, so this module imports
anywhere.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from tlt.integrations.sglang import adaptive, guard, idle

log = logging.getLogger(__name__)

# What the server-args hook learned in this process (the HTTP process checks requests with it).
_server: dict[str, Any] = {"algorithm": None}
_signal: list[Any] = []  # this process's idle signal, created on first use


class Tuner(adaptive.AdaptiveTuner):
    """0.5.23: replaces ``AdaptiveSpeculativeParams`` (same constructor: initial_steps, cfg_path)."""


class EmaTuner(adaptive.EmaCompatTuner):
    """0.5.12: replaces ``AdaptiveSpeculativeParams`` (same constructor: initial_steps, config)."""


def load_adaptive_config(original, cfg_path=None):
    """0.5.23 ``_load_adaptive_config``: TLT's slots when no config file is given; SGLang's
    ``(cfg, {bs: entry})`` shape, so candidate-step buffers are sized for TLT's step counts."""
    if cfg_path is not None:
        return original(cfg_path)
    slots = adaptive.load_slots(None)
    cfg = {str(k): {"candidate_steps": list(v)} for k, v in slots.items()}
    return cfg, {int(k): e for k, e in cfg.items()}


# ---------------------------------------------------------------------------- lossless guard
def _check(*, algorithm, thresholds, user_max, resolved_max, is_adaptive, cfg) -> None:
    _server["algorithm"] = algorithm
    guard.check_server(algorithm=algorithm, thresholds=thresholds,
                       simulate_acc_len=guard.env_simulate_acc_len(os.environ),
                       force_greedy_ngram=guard.env_force_greedy(os.environ) and str(algorithm).upper() == "NGRAM")
    if algorithm and str(algorithm).upper() != "NONE":
        try:
            slots = adaptive.load_slots(cfg if is_adaptive else {"1": {"candidate_steps": [1]}})
        except (OSError, ValueError):
            slots = adaptive.load_slots(None)
        msg = guard.max_running_warning(user_value=user_max, resolved=resolved_max, slots=slots)
        if msg:
            log.warning("TLT: %s", msg)


def server_args_post_init_0512(original, self, *args, **kwargs):
    """0.5.12 ``ServerArgs.__post_init__`` (AROUND): the fields are final afterwards."""
    user_max = self.max_running_requests
    out = original(self, *args, **kwargs)
    _check(algorithm=self.speculative_algorithm,
           thresholds={k: getattr(self, k) for k in guard.THRESHOLD_KEYS if hasattr(self, k)},
           user_max=user_max, resolved_max=self.max_running_requests,
           is_adaptive=getattr(self, "speculative_adaptive", False), cfg=getattr(self, "speculative_adaptive_config", None))
    return out


def server_args_resolved_0523(result, self, *args, **kwargs):
    """0.5.23 ``ServerArgs.resolve_once`` (AFTER): attributes keep the raw input; resolved values
    come from SGLang's resolution record."""
    from sglang.srt.arg_groups.overrides import resolution_result

    def get(field: str) -> Any:
        return resolution_result(self, field)

    _check(algorithm=get("speculative_algorithm"), thresholds={k: get(k) for k in guard.THRESHOLD_KEYS},
           user_max=getattr(self, "max_running_requests", None), resolved_max=get("max_running_requests"),
           is_adaptive=bool(get("speculative_adaptive")), cfg=get("speculative_adaptive_config"))
    return result


def guard_internal_state(original, self, recv_req, *args, **kwargs):
    """``Scheduler.set_internal_state`` (AROUND): a lossy threshold is refused (updated=False)."""
    try:
        guard.check_internal_state(getattr(recv_req, "server_args", None) or {})
    except guard.LossySetting as e:
        log.error("TLT refused /set_internal_state: %s", e)
        from sglang.srt.managers.io_struct import SetInternalStateReqOutput

        fields = getattr(SetInternalStateReqOutput, "__dataclass_fields__", None) or \
            getattr(SetInternalStateReqOutput, "__struct_fields__", ())
        extra = {"server_args": {}} if "server_args" in fields else {}
        return SetInternalStateReqOutput(updated=False, **extra)
    return original(self, recv_req, *args, **kwargs)


def guard_sampling_params(result, self, *args, **kwargs):
    """``SamplingParams.verify`` (AFTER): a ValueError here becomes the request's HTTP 400."""
    algorithm = _server["algorithm"]
    speculative = bool(algorithm) and str(algorithm).upper() != "NONE"
    greedy = getattr(self, "top_k", None) == 1 or getattr(self, "temperature", 1.0) == 0
    guard.check_request(speculative=speculative, min_p=getattr(self, "min_p", 0.0) or 0.0, greedy=greedy,
                        force_greedy_ngram=speculative and str(algorithm).upper() == "NGRAM"
                        and guard.env_force_greedy(os.environ))
    return result


# ---------------------------------------------------------------------------- idle signal
def _running(scheduler) -> int:
    batch = getattr(scheduler, "running_batch", None)
    reqs = getattr(batch, "reqs", None) or ()
    return len(reqs) + len(getattr(scheduler, "waiting_queue", None) or ())


def _idle_signal(scheduler):
    if not _signal:
        _signal.append(idle.from_env(os.environ, tp_rank=int(getattr(scheduler, "tp_rank", 0) or 0)))
    return _signal[0]


def idle_after_batch(result, self, *args, **kwargs):
    """``Scheduler.process_batch_result`` (AFTER): requests are running."""
    _idle_signal(self).update(_running(self))
    return result


def idle_after_on_idle(result, self, *args, **kwargs):
    """``Scheduler.on_idle`` (AFTER): no batch to run this iteration."""
    _idle_signal(self).update(_running(self))
    return result
