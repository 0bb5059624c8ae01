"""What the cluster simulator runs: cluster scales, response lengths and step-cost curves.

Owns the inputs of ``tlt bench cluster``, each with where it comes from:

- :data:`SCALES`: the replicas, prompts per step, responses per prompt and maximum length at 8,
  64 and 256 replicas. The source of each figure is stated beside it; what no paper states is
  marked as assumed.
- :func:`lognormal_lengths`: the one long-tail length sampler the simulator and the benches draw
  from; :func:`reasoning_lengths`: a long-tailed response-length profile for reasoning RL (lognormal,
  clipped at the maximum length). Its shape is an assumption, chosen to match the long tail the
  seed papers describe; :func:`recorded_lengths` reads a ``tlt demo`` run's real lengths instead.
- :func:`speeds_from_record`: plain and speculative step-cost curves and the accept length by
  batch, from a ``tlt bench rollout`` or ``tlt bench step-cost`` record (``by_batch``:
  ``ar_step_ms``, ``sd_step_ms``, ``mean_accept_length``).
"""

from __future__ import annotations

import bisect
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from tlt.coordinator.consolidation import StepCurve
from tlt.sim.rollout import Speed


@dataclass(frozen=True)
class Scale:
    replicas: int
    prompts: int  # per RL step
    responses: int  # per prompt (GRPO group)
    max_len: int
    source: str


SCALES = {
    8: Scale(8, 64, 8, 8192, "8 GPUs as in RLHFSpec's ablation (8 x L40S, Llama-3.1-8B, one instance per GPU); "
                             "64 prompts x 8 responses and 8K tokens assumed"),
    64: Scale(64, 512, 16, 20480, "512 prompts x 16 responses, 20,480-token responses: DAPO's published recipe; "
                                  "64 single-GPU replicas assumed"),
    256: Scale(256, 1024, 16, 32768, "32K-token responses as in RollPacker and TLT's long-tail setups, on twice "
                                     "RollPacker's 128 H800s; 1024 prompts x 16 responses assumed"),
}


def lognormal_lengths(n: int, rng: random.Random, median: float, sigma: float, *, lo: int = 1,
                      hi: int) -> list[int]:
    """``n`` lengths drawn lognormal with median ``median`` and shape ``sigma`` (one draw of ``rng``
    each, in order), clipped to ``[lo, hi]``."""
    mu = math.log(median)
    return [int(min(hi, max(lo, rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def reasoning_lengths(n: int, max_len: int, *, seed: int = 0, median_share: float = 0.12,
                      sigma: float = 0.9) -> list[int]:
    """``n`` lengths, lognormal with median ``median_share * max_len`` and shape ``sigma``, clipped
    at ``max_len`` (about 2% hit the cap with the defaults): most responses are short, a few run to
    the limit, as in reasoning RL (an assumed shape, not fitted to a paper's data)."""
    return lognormal_lengths(n, random.Random(seed), median_share * max_len, sigma, hi=max_len)


def arm_lines(run: Path, arm: str, name: str) -> list[dict]:
    """One JSON-lines file of a ``tlt demo`` run's arm (``tlt_steps.jsonl``, ``tlt_responses.jsonl``)."""
    path = Path(run) / f"arm-{arm}" / name
    if not path.is_file():
        raise ValueError(f"{path} does not exist: give a `tlt demo` output directory (arm {arm})")
    return [json.loads(x) for x in path.read_text().splitlines()]


def recorded_lengths(run: Path, arm: str = "A") -> dict[int, list[int]]:
    """A ``tlt demo`` run's response lengths by RL step."""
    out: dict[int, list[int]] = {}
    for rec in arm_lines(run, arm, "tlt_responses.jsonl"):
        out.setdefault(int(rec["step"]), []).append(int(rec["length"]))
    return out


@dataclass(frozen=True)
class AcceptModel:
    """Accept length by batch, interpolated between measured batches (flat outside them)."""

    points: tuple[tuple[int, float], ...]

    def __call__(self, n: int) -> float:
        bs = [b for b, _ in self.points]
        if n <= bs[0]:
            return self.points[0][1]
        if n >= bs[-1]:
            return self.points[-1][1]
        i = bisect.bisect_left(bs, n)
        (b0, a0), (b1, a1) = self.points[i - 1], self.points[i]
        return a0 + (a1 - a0) * (n - b0) / (b1 - b0)


def speeds_from_record(path: Path, accept: AcceptModel | None = None) -> tuple[Speed, Speed]:
    """(plain, speculative) speeds from a bench record's ``by_batch``; ``accept`` replaces the
    record's accept lengths (a step-cost record's untrained drafter accepts nothing)."""
    rec = json.loads(Path(path).read_text())
    by = {int(b): v for b, v in rec["by_batch"].items()}
    plain = StepCurve(tuple((b, v["ar_step_ms"] / 1000) for b, v in by.items()))
    spec = StepCurve(tuple((b, v["sd_step_ms"] / 1000) for b, v in by.items()))
    if accept is None:
        accept = AcceptModel(tuple(sorted((b, float(v["mean_accept_length"])) for b, v in by.items())))
    return Speed(plain), Speed(plain, spec, accept)
