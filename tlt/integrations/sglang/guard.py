"""The lossless guard: settings that would make SGLang's speculative acceptance lossy are refused.

Owns the rules, as plain functions over plain values (SGLang is not imported here; the hooks in
:mod:`tlt.integrations.sglang.hook_impls` read SGLang's objects and call these). Speculative
decoding is lossless only when a draft token is accepted exactly as often as the target would
have sampled it. SGLang offers knobs that break this:

* ``--speculative-accept-threshold-single`` / ``-acc`` below 1.0 (also settable at run time via
  ``/set_internal_state``) accept draft tokens the target would not have sampled;
* ``SGLANG_SIMULATE_ACC_LEN`` > 0 fakes acceptance for benchmarking (outputs are not the model's);
* ``SGLANG_NGRAM_FORCE_GREEDY_VERIFY`` verifies n-gram drafts greedily, which is lossy for any
  request that samples (temperature > 0);
* ``min_p`` is ignored by SGLang's speculative verify (it applies temperature, top-k and top-p
  only), so a min_p request would sample from another distribution than it asked for.

Each refusal is one :class:`LossySetting` (a ``ValueError``) naming the setting, its value and the
fix. One warning, not a refusal: speculative mode caps ``max_running_requests`` at 48 when it is
not given, which throttles the high-concurrency start of a rollout below TLT's elastic threshold.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

SPEC_DEFAULT_MAX_RUNNING = 48  # SGLang sets this when speculation is on and the user gave none
THRESHOLD_KEYS = ("speculative_accept_threshold_single", "speculative_accept_threshold_acc")


class LossySetting(ValueError):
    pass


def _on(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def check_server(*, algorithm: str | None, thresholds: Mapping[str, float], simulate_acc_len: float,
                 force_greedy_ngram: bool) -> None:
    """Refuse lossy server-wide settings (no-op without a speculative algorithm)."""
    if not algorithm or str(algorithm).upper() == "NONE":
        return
    for key in THRESHOLD_KEYS:
        if key in thresholds:
            check_threshold(key, thresholds[key])
    if simulate_acc_len is not None and float(simulate_acc_len) > 0:
        raise LossySetting(f"SGLANG_SIMULATE_ACC_LEN={simulate_acc_len} fakes acceptance (outputs are not the "
                           "model's); TLT refuses it: unset it (or set it <= 0)")
    if force_greedy_ngram:
        log.warning("SGLANG_NGRAM_FORCE_GREEDY_VERIFY is on: TLT will refuse every request that samples "
                    "(temperature > 0) while it is set")


def check_threshold(key: str, value: Any) -> None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise LossySetting(f"{key}={value!r} is not a number; TLT allows only 1.0 (lossless acceptance)") from None
    if not (math.isfinite(v) and v >= 1.0):
        raise LossySetting(f"{key}={value} accepts draft tokens the target would not sample (lossy); TLT allows "
                           "only 1.0: drop the flag or set it to 1.0")


def check_internal_state(update: Mapping[str, Any]) -> None:
    """Refuse a ``/set_internal_state`` update that lowers an accept threshold."""
    for key in THRESHOLD_KEYS:
        if key in update:
            check_threshold(key, update[key])


def check_request(*, speculative: bool, min_p: float, greedy: bool, force_greedy_ngram: bool) -> None:
    """Refuse one request's sampling parameters that speculative verify would not honour."""
    if not speculative:
        return
    if min_p and float(min_p) > 0:
        raise LossySetting(f"min_p={min_p} with speculative decoding: SGLang's speculative verify ignores "
                           "min_p, so this request would not sample what it asks; use min_p=0 (or top_p / "
                           "top_k) on a speculative server")
    if force_greedy_ngram and not greedy:
        raise LossySetting("a sampling request (temperature > 0) while SGLANG_NGRAM_FORCE_GREEDY_VERIFY is on: "
                           "greedy verify of a sampled request is lossy; unset the variable or send "
                           "temperature=0")


def max_running_warning(*, user_value: int | None, resolved: int | None,
                        slots: Mapping[int, tuple[int, ...]]) -> str | None:
    """The warning when speculative mode's default cap undercuts TLT's elastic threshold.

    The elastic threshold is the smallest slot whose only step count is 0 (speculation off from
    there up); with no such slot speculation may run at any batch size, so any default cap binds.
    """
    if user_value is not None or resolved is None or resolved > SPEC_DEFAULT_MAX_RUNNING:
        return None
    off_from = min((k for k, steps in slots.items() if set(steps) == {0}), default=None)
    if off_from is not None and resolved >= off_from:
        return None
    where = f"its elastic threshold ({off_from} running)" if off_from else "the batch sizes its slots speculate at"
    return (f"speculative mode capped max_running_requests at {resolved} (SGLang's default when none is given), "
            f"below {where}: the rollout's many-request phase runs at most {resolved} at a time. TLT switches "
            "speculation off per batch size itself (steps=0), so pass --max-running-requests <your rollout batch>")


def env_simulate_acc_len(environ: Mapping[str, str]) -> float:
    try:
        return float(environ.get("SGLANG_SIMULATE_ACC_LEN", "-1"))
    except ValueError:
        raise LossySetting(f"SGLANG_SIMULATE_ACC_LEN={environ['SGLANG_SIMULATE_ACC_LEN']!r} is not a number; "
                           "unset it") from None


def env_force_greedy(environ: Mapping[str, str]) -> bool:
    return _on(environ.get("SGLANG_NGRAM_FORCE_GREEDY_VERIFY", "0"))
