"""``tlt bench ...``: benchmarks that time alternatives side by side in one run.

Each benchmark module exposes ``run(args) -> dict``: a JSON-able record with a ``summary`` list of
printable lines. Variants are interleaved (A B A B ...) and compared by median, because a shared
machine drifts; ratios are always measured within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

# name -> module under tlt.bench (imported lazily: some need optional packages)
BENCHES = {"packing": "packing", "rollout": "rollout", "graphs": "graphs",
           "coordinator": "coordinator", "checkpoint": "checkpoint", "preempt": "preempt",
           "sglang-tuner": "sglang_tuner",
           "step-cost": "step_cost", "resume": "resume", "lifecycle": "lifecycle",
           "consolidation": "consolidation", "demo": "demo_runs", "cluster": "cluster",
           "tail-batching": "tail_batching", "attention": "attention",
           "memory": "memory"}
# old name -> new name: still run, with a warning naming the new one, until the next release
RENAMED = {"sglang-policy": "sglang-tuner", "tail": "cluster"}
# research experiments, not benchmarks of what TLT ships: they live in a checkout's examples/research/
MOVED = {"headroom": "headroom.py", "drafters": "drafters.py", "tuner": "tuner_surface.py"}


def get(name: str) -> Callable[[argparse.Namespace], dict]:
    if name in MOVED:
        raise ValueError(f"`tlt bench {name}` is a research experiment now: run `python examples/research/"
                         f"{MOVED[name]} --help` from a checkout of the repository")
    if name in RENAMED:
        logging.getLogger(__name__).warning("`tlt bench %s` is renamed `tlt bench %s`; the old name runs until "
                                            "the next release", name, RENAMED[name])
        name = RENAMED[name]
    return importlib.import_module(f"tlt.bench.{BENCHES[name]}").run


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` (0: left as they are) for the block, then restored
    (a bench may run inside a longer process: the tests)."""
    import torch

    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pyplot(path: Path) -> Any | None:
    """matplotlib's pyplot on the Agg backend, or None (with a warning naming ``path``, the plot not
    written) where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logging.getLogger(__name__).warning("matplotlib is not installed: no %s (pip install 'tlt-rollout[demo]')",
                                            path)
        return None
    return plt
