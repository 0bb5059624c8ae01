"""Synthetic step-by-step arithmetic corpus with a long tail of answer lengths.

Owns the generator of (prompt, response) pairs the embedded default target is trained on and the
demo rolls out: each problem is a chain of additions/subtractions whose length is lognormal, so a
batch of rollouts finishes at very different times, like real reasoning RL.
"""

from __future__ import annotations

import dataclasses
import math
import random


@dataclasses.dataclass(frozen=True, kw_only=True)
class CorpusConfig:
    seed: int = 0
    median_steps: float = 6.0
    sigma: float = 0.8  # lognormal spread of the number of steps
    max_steps: int = 60
    max_operand: int = 99

    def __post_init__(self) -> None:
        if self.median_steps < 1 or self.sigma < 0 or self.max_steps < 1 or self.max_operand < 2:
            raise ValueError(f"invalid corpus config {self}: need median_steps>=1, sigma>=0, "
                             "max_steps>=1, max_operand>=2")


@dataclasses.dataclass(frozen=True)
class Problem:
    prompt: str
    response: str


def make_problem(rng: random.Random, cfg: CorpusConfig) -> Problem:
    steps = int(round(rng.lognormvariate(math.log(cfg.median_steps), cfg.sigma)))
    steps = max(1, min(cfg.max_steps, steps))
    total = rng.randint(1, cfg.max_operand)
    expr = [str(total)]
    lines = ["Let's work it out step by step."]
    for _ in range(steps):
        op = rng.choice("+-")
        x = rng.randint(1, cfg.max_operand)
        new = total + x if op == "+" else total - x
        expr.append(f"{op} {x}")
        lines.append(f"{total} {op} {x} = {new}")
        total = new
    lines.append(f"The answer is \\boxed{{{total}}}.")
    return Problem(f"Compute {' '.join(expr)}.", "\n".join(lines))


def make_corpus(n: int, cfg: CorpusConfig = CorpusConfig()) -> list[Problem]:
    rng = random.Random(cfg.seed)
    return [make_problem(rng, cfg) for _ in range(n)]
