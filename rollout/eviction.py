"""Which running requests leave the paged cache when it cannot grow every row for the next step.

Owns the victim rule, a pure decision over flat records (no engine, no clock): :func:`choose_victims`
picks requests by :data:`RULES` until their blocks cover the shortfall, and never the last running
request, so every step makes progress. An evicted request goes back to the engine's queue with its
state and is prefilled again over its prompt and tokens so far when blocks free up; with coupled
sampling it then draws exactly the tokens it would have drawn (eviction by recompute is lossless).
"""

from __future__ import annotations

import dataclasses

RULES = ("youngest", "fewest-tokens", "most-tokens")


@dataclasses.dataclass(frozen=True)
class Candidate:
    rid: int
    blocks: int  # blocks it holds (what evicting it frees)
    tokens: int  # prompt + tokens so far (what a re-prefill recomputes)
    admitted: int  # admission order: larger = more recent


def choose_victims(running: list[Candidate], shortfall: int, rule: str) -> list[int]:
    """Request ids to evict, in order, freeing at least ``shortfall`` blocks if that can be done
    without evicting every running request (else as many as may go: all but one).
    - youngest: the most recently admitted first (vLLM's recompute order: the least work lost);
    - fewest-tokens: the cheapest re-prefill first;
    - most-tokens: the most blocks freed per eviction first (SGLang retracts the longest outputs)."""
    if rule not in RULES:
        raise ValueError(f"eviction rule {rule!r}: use one of {RULES}")
    if shortfall <= 0 or len(running) < 2:
        return []
    key = {"youngest": lambda c: -c.admitted, "fewest-tokens": lambda c: (c.tokens, -c.admitted),
           "most-tokens": lambda c: (-c.tokens, -c.admitted)}[rule]
    out, freed = [], 0
    for c in sorted(running, key=key)[: len(running) - 1]:
        if freed >= shortfall:
            break
        out.append(c.rid)
        freed += c.blocks
    return out
