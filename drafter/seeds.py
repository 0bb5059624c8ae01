"""Every seed the project derives from another: the one place their formulas live.

Owns the derivations, so that two parts that must agree (two arms of a comparison, a retried
request, a resumed run) compute the same seed, and so that no two streams meant to differ collide.
Pure Python (no torch): it sits at the bottom of the import order, so the rollout engine, the
drafter's trainers, the verl integration and the benches all import it. ``tests/drafter/test_seeds.py``
pins their values: changing one changes every run's tokens.

- :func:`derive` ``(base, k)``: the ``k``-th seed of stream ``base`` (``base * 1_000_003 + k``, a prime
  stride): a request's default sampling seed in a batch, a warm-up job's, a buffer draw's, an
  epoch's shuffle.
- :func:`replica_seed` ``(seed, rank)``: a rollout replica's engine seed (``seed * 7919 + rank``).
- :func:`request_seed`: a verl rollout request's sampling seed from its identity (63 bits).
- :func:`fallback_seed`: a verl request that came without a seed, from its request id (bit 63 set:
  never one :func:`request_seed` gives).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

STRIDE = 1_000_003  # between consecutive streams: a prime far above any stream's length
REPLICA_STRIDE = 7919


def derive(base: int, k: int) -> int:
    """The ``k``-th seed of stream ``base``."""
    return int(base) * STRIDE + int(k)


def replica_seed(seed: int, rank: int) -> int:
    """Replica ``rank``'s engine seed in a run seeded ``seed``."""
    return int(seed) * REPLICA_STRIDE + int(rank)


def _hash63(blob: Any) -> int:
    text = json.dumps(blob, sort_keys=True, default=str)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def request_seed(*, data_seed: int, step: int, index: int, sample: int, validate: bool, prompt: Any) -> int:
    """A 63-bit seed from a request's identity (``prompt``: the chat messages, JSON-able): the data
    seed, the RL step, the prompt's dataset index, the sample's index in its group, training vs
    validation, and the prompt."""
    return _hash63([int(data_seed), int(step), int(index), int(sample), bool(validate), prompt])


def fallback_seed(server_seed: int, request_id: str) -> int:
    """The seed of a request sent without one, from its request id. verl's client sends a new uuid
    per call, or the agent loop's own id with ``rollout.full_determinism`` (a tool loop's turns share
    it; their draws differ all the same, keyed by absolute position). Bit 63 set."""
    return _hash63(["fallback", int(server_seed), str(request_id)]) | (1 << 63)
