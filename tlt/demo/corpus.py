"""Synthetic step-by-step arithmetic corpus with a long tail of answer lengths and two styles.

Owns the generator of (prompt, response) pairs the embedded default target is trained on and the
demo rolls out. Each problem is a chain of additions/subtractions whose length is lognormal, so a
batch of rollouts finishes at very different times, like real reasoning RL. A response has the
structure of a reasoning trace: predictable connective text, quantities copied from the prompt or
from the line before, and computed ones. Each step line comes in one of two styles, drawn
independently per line:

- ``plain`` (most lines): ``37 + 12 = 49``;
- ``careful`` (``CorpusConfig.careful_share`` of the lines): the running total in words, ``Adding
  12 to 37 gives 49.``

The demo's reward prefers careful lines (:mod:`tlt.demo.grpo_task`), so GRPO moves the policy from
the common style to the rare one, as RL from a base model changes its style; a drafter warmed up
on the policy's typical outputs (its greedy rollouts: plain lines only) then falls behind. The
style is chosen at every line, not once per response, so the choice RL must learn recurs at every
step of a response: a once-per-response choice is one token among a hundred uncertain ones (the
small target's digits), too little signal to move a small policy before the noise wrecks it.
"""

from __future__ import annotations

import dataclasses
import math
import random

STYLES = ("plain", "careful")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CorpusConfig:
    seed: int = 0
    median_steps: float = 6.0
    sigma: float = 0.8  # lognormal spread of the number of steps
    max_steps: int = 60
    max_operand: int = 99
    careful_share: float = 0.0  # share of step lines in the careful style

    def __post_init__(self) -> None:
        if self.median_steps < 1 or self.sigma < 0 or self.max_steps < 1 or self.max_operand < 2:
            raise ValueError(f"invalid corpus config {self}: need median_steps>=1, sigma>=0, "
                             "max_steps>=1, max_operand>=2")
        if not 0 <= self.careful_share <= 1:
            raise ValueError(f"careful_share={self.careful_share}: use a share in [0, 1]")


@dataclasses.dataclass(frozen=True)
class Problem:
    prompt: str
    response: str
    careful_lines: int = 0  # step lines in the careful style


def _line(style: str, total: int, op: str, x: int, new: int) -> str:
    if style == "plain":
        return f"{total} {op} {x} = {new}"
    if op == "+":
        return f"Adding {x} to {total} gives {new}."
    return f"Subtracting {x} from {total} gives {new}."


def make_problem(rng: random.Random, cfg: CorpusConfig) -> Problem:
    steps = int(round(rng.lognormvariate(math.log(cfg.median_steps), cfg.sigma)))
    steps = max(1, min(cfg.max_steps, steps))
    total = rng.randint(1, cfg.max_operand)
    expr = [str(total)]
    lines = ["Let's work it out step by step."]
    careful = 0
    for _ in range(steps):
        op = rng.choice("+-")
        x = rng.randint(1, cfg.max_operand)
        new = total + x if op == "+" else total - x
        expr.append(f"{op} {x}")
        style = "careful" if rng.random() < cfg.careful_share else "plain"
        careful += style == "careful"
        lines.append(_line(style, total, op, x, new))
        total = new
    lines.append(f"The answer is \\boxed{{{total}}}.")
    return Problem(f"Compute {' '.join(expr)}.", "\n".join(lines), careful)


def make_corpus(n: int, cfg: CorpusConfig = CorpusConfig()) -> list[Problem]:
    rng = random.Random(cfg.seed)
    return [make_problem(rng, cfg) for _ in range(n)]
