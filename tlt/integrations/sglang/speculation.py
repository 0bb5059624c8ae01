"""Which speculation an SGLang rollout replica runs in the next RL step: n-gram, then EAGLE.

Owns the step-boundary decision of TLT's n-gram fallback. Before the first trained drafter exists
a replica runs SGLang's NGRAM speculation (model-free: it drafts from a trie of the running
requests' tokens, so the GRPO siblings of a prompt draft from each other, plus the previous step's
responses given as external corpus); from the step after the first drafter arrives it runs EAGLE
with TLT's adaptive policy. SGLang picks the algorithm at server start, so the switch is a replica
restart, and it happens only here, between RL steps (:func:`next_server_args` returns the new
arguments, or None when the running server already fits), never mid-rollout. Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

NGRAM_DEFAULTS = {"speculative_num_draft_tokens": 8}  # SGLang's n-gram drafts per verify
# The adaptive policy's starting step count (one of TLT's candidate steps). SGLang 0.5.12 refuses a
# topk without the step count, and a chain verifies steps + 1 tokens.
EAGLE_START_STEPS = 3


def server_args(drafter_path: str | None, *, max_running_requests: int,
                ngram: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """SGLang server arguments (ServerArgs field names) for a replica, given the newest drafter."""
    if isinstance(max_running_requests, bool) or not isinstance(max_running_requests, int) \
            or max_running_requests < 1:
        raise ValueError(f"max_running_requests={max_running_requests!r}: give the rollout batch (an int >= 1); "
                         "speculative SGLang otherwise caps it at 48")
    if drafter_path:
        return {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": str(drafter_path),
                "speculative_eagle_topk": 1, "speculative_num_steps": EAGLE_START_STEPS,
                "speculative_num_draft_tokens": EAGLE_START_STEPS + 1, "speculative_adaptive": True,
                "max_running_requests": max_running_requests}
    return {"speculative_algorithm": "NGRAM", **NGRAM_DEFAULTS, **dict(ngram or {}),
            "max_running_requests": max_running_requests}


def next_server_args(current: Mapping[str, Any], drafter_path: str | None, *,
                     max_running_requests: int) -> dict[str, Any] | None:
    """At an RL step boundary: the arguments to restart the replica with, or None to keep it.

    A replica restarts once, when the first drafter arrives (NGRAM -> EAGLE). Later drafters are
    hot-pushed into the running EAGLE server (draft-only weight update), so the drafter path a
    server was started with may be older than the newest drafter without a restart."""
    wanted = server_args(drafter_path, max_running_requests=max_running_requests)
    if current.get("speculative_algorithm") == wanted["speculative_algorithm"]:
        return None
    return wanted
