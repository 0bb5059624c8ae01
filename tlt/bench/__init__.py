"""``tlt bench ...``: benchmarks that time alternatives side by side in one run.

Each benchmark module exposes ``run(args) -> dict``: a JSON-able record with a ``summary`` list of
printable lines. Variants are interleaved (A B A B ...) and compared by median, because a shared
machine drifts; ratios are always measured within one run.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Callable

# name -> module under tlt.bench (imported lazily: some need optional packages)
BENCHES = {"packing": "packing", "rollout": "rollout", "tuner": "tuner", "graphs": "graphs",
           "coordinator": "coordinator", "checkpoint": "checkpoint", "preempt": "preempt",
           "sglang-policy": "sglang_policy", "headroom": "headroom",
           "step-cost": "step_cost", "drafters": "drafters", "resume": "resume", "lifecycle": "lifecycle"}


def get(name: str) -> Callable[[argparse.Namespace], dict]:
    return importlib.import_module(f"tlt.bench.{BENCHES[name]}").run
