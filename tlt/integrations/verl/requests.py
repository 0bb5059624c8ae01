"""What one verl rollout request asks of a replica: its sampling settings and its seed.

Owns the translation of verl's ``sampling_params`` into the engine's
:class:`~tlt.rollout.generate.SamplingParams` (keys the engine honours, keys whose neutral value is the
only lossless one, anything else refused rather than dropped), the check that no two requests of
a batch share an identity, and the batch's canonical order (by identity, not arrival). verl 0.9.1 sends no seed and no stable request identity (``request_id`` is
a uuid4), so the seed (:func:`tlt.drafter.seeds.request_seed`) is derived from what identifies a
request in an RL run: the data seed, the global step,
the prompt's dataset index, the sample's index in its GRPO group, training vs validation, and the
prompt itself. Two arms of a comparison (or a rerun) then sample the same tokens for the same
request, with speculation on or off, and siblings never share a seed.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from tlt.rollout.generate import SamplingParams

log = logging.getLogger(__name__)

# Keys verl sends that the engine honours, and keys whose neutral value is the only one the engine
# can serve losslessly (anything else is refused, not silently dropped).
SERVED = {"temperature", "top_p", "top_k", "logprobs", "max_tokens", "max_new_tokens", "stop_token_ids", "seed"}
NEUTRAL = {"repetition_penalty": (1, 1.0, None), "min_p": (0, 0.0, None), "presence_penalty": (0, 0.0, None),
           "frequency_penalty": (0, 0.0, None), "ignore_eos": (False, None), "stop": (None, (), []),
           "n": (1, None)}


def plain(x: Any) -> Any:
    """A JSON-able copy of verl's raw prompt (lists of message dicts, possibly numpy arrays)."""
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    return x


def as_list(x: Any) -> list:
    """A batch column (tensor, numpy array or NonTensorStack) as a Python list."""
    if hasattr(x, "tolist"):
        return x.tolist()
    return [getattr(v, "data", v) for v in x]


def canonical_order(keys: list[str], uid_index: dict[str, int]) -> list[int]:
    """Positions of verl's trajectory keys (``{uid}_{sample}_{output}``) sorted by (prompt index,
    sample index, output index): an order that does not depend on arrival. uid_index: prompt uid ->
    dataset index (unknown uids sort first, by uid)."""
    def rank(k: str):
        uid, sample, out = k.rsplit("_", 2)
        return uid_index.get(uid, -1), int(sample), int(out), uid
    return sorted(range(len(keys)), key=lambda j: rank(keys[j]))


def duplicate_requests(indices: list[int], prompts: list[Any]) -> list[tuple[int, str]]:
    """(dataset index, prompt) pairs that occur more than once: their siblings would share seeds."""
    seen: dict[tuple[int, str], int] = {}
    for i, p in zip(indices, prompts):
        key = (int(i), json.dumps(plain(p), sort_keys=True, default=str))
        seen[key] = seen.get(key, 0) + 1
    return [k for k, n in seen.items() if n > 1]


def engine_params(sp: dict[str, Any], *, prompt_len: int, max_len: int, response_length: int,
                    eos_ids: tuple[int, ...]) -> tuple[SamplingParams, int | None]:
    """(engine sampling params, seed or None) of one request; ValueError on what cannot be served."""
    for key, value in sp.items():
        if key in NEUTRAL and value not in NEUTRAL[key]:
            raise ValueError(f"sampling parameter {key}={value!r} is not served by the tlt rollout "
                             "(it would change the distribution speculation verifies against)")
        if key not in SERVED and key not in NEUTRAL:
            log.warning("ignoring unknown sampling parameter %s=%r", key, value)
    room = max_len - 1 - prompt_len
    if room < 1:
        raise ValueError(f"prompt of {prompt_len} tokens leaves no room to generate within "
                         f"prompt_length + response_length = {max_len - 1}")
    seed = sp.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"sampling parameter seed={seed!r}: use an integer")
    max_new = sp.get("max_new_tokens") or sp.get("max_tokens") or response_length
    temperature = sp.get("temperature")
    stops = tuple(eos_ids) + tuple(sp.get("stop_token_ids") or ())
    params = SamplingParams(temperature=1.0 if temperature is None else float(temperature),
                            top_p=float(sp.get("top_p") or 1.0), top_k=max(0, int(sp.get("top_k") or 0)),
                            max_new_tokens=min(int(max_new), room), stop_ids=stops)
    return params, seed
