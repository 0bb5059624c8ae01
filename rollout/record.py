"""The per-rollout record: what the engine did, step by step, as JSON.

Owns turning a :class:`RolloutResult` (and the tuner's statistics) into a JSON-able dict: the
accept-length histogram, per-arm step counts and goodput, the SD on/off timeline and the
running-batch size over time. ``tlt report`` plots it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from tlt.rollout.engine import RolloutResult


def rollout_record(result: RolloutResult, *, tuner_stats: dict | None = None,
                   meta: dict[str, Any] | None = None) -> dict[str, Any]:
    t, timeline = 0.0, []
    arms: dict[str, dict[str, float]] = {}
    for s in result.steps:
        t += s.seconds
        timeline.append({"t": round(t, 6), "batch": s.batch, "sd": s.sd, "arm": s.arm,
                         "accepted": s.accepted, "committed": s.committed})
        a = arms.setdefault(s.arm, {"steps": 0, "seconds": 0.0, "committed": 0, "accepted": 0})
        a["steps"] += 1
        a["seconds"] += s.seconds
        a["committed"] += s.committed
        a["accepted"] += s.accepted
    for a in arms.values():
        a["goodput_tok_s"] = a["committed"] / a["seconds"] if a["seconds"] else 0.0
    hist = Counter(result.accept_lengths)
    sd_lengths = result.accept_lengths
    return {
        "requests": len(result.outputs),
        "tokens": result.tokens,
        "seconds": result.seconds,
        "tokens_per_s": result.tokens / result.seconds if result.seconds else 0.0,
        "steps": len(result.steps),
        "sd_steps": sum(s.sd for s in result.steps),
        "mean_accept_length": sum(sd_lengths) / len(sd_lengths) if sd_lengths else None,
        "accept_length_hist": {str(k): hist[k] for k in sorted(hist)},
        "arms": arms,
        "tuner": tuner_stats,
        "timeline": timeline,
        "output_lengths": [len(o) for o in result.outputs],
        **(meta or {}),
    }
