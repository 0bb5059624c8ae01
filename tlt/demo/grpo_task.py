"""The embedded GRPO task: arithmetic chains with a long tail of response lengths, and its reward.

Owns the verl-format prompt files (parquet: ``data_source``, chat ``prompt``, ``reward_model`` with
the ground truth, ``extra_info.index``) built from :mod:`tlt.demo.corpus`, and the rule-based
reward verl calls (``reward.custom_reward_function.path=<this file>``, ``name=compute_score``):
0 without a ``\\boxed{N}`` answer; otherwise ``0.1 + 0.9 x careful``, where ``careful`` is the
share of its step lines written in the careful style. The policy starts out choosing that style
rarely (as rarely as its training data does) and GRPO makes it common within a few steps: the
policy really moves. The reward judges style only: a tiny policy's shaky arithmetic would
drown the signal, and rewarding right answers taught it to shorten its responses (fewer steps,
fewer mistakes), which erases the long tail. :func:`line_accuracy` reports the arithmetic.
Nothing here imports verl.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from tlt.demo.corpus import CorpusConfig, make_corpus

DATA_SOURCE = "tlt/arith"
_BOXED = re.compile(r"\\boxed\{(-?\d+)\}")
_PLAIN = re.compile(r"^(-?\d+) ([+-]) (\d+) = (-?\d+)$")
_CAREFUL = re.compile(r"^(Adding|Subtracting) (\d+) (to|from) (-?\d+) gives (-?\d+)\.$")


def _step(line: str) -> tuple[str, bool] | None:
    """(style, arithmetic right) of a step line; None if the line is not a step."""
    if m := _PLAIN.match(line):
        return "plain", int(m[1]) + (int(m[3]) if m[2] == "+" else -int(m[3])) == int(m[4])
    if m := _CAREFUL.match(line):
        sign = 1 if m[1] == "Adding" else -1
        return "careful", int(m[4]) + sign * int(m[2]) == int(m[5]) and (m[3] == "to") == (sign == 1)
    if " = " in line or " gives " in line:  # a malformed step counts wrong, in the plain style
        return "plain", False
    return None


def _steps(text: str | None) -> list[tuple[str, bool]]:
    """(style, arithmetic right) of each step line of a response."""
    return [s for s in map(_step, (x.strip() for x in (text or "").splitlines())) if s is not None]


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    text = solution_str or ""
    if not _BOXED.findall(text):
        return 0.0
    careful, steps = careful_lines(text)
    return 0.1 + 0.9 * (careful / steps if steps else 0.0)


def careful_lines(solution_str: str) -> tuple[int, int]:
    """(careful step lines, all step lines) of a response: how far the policy has moved."""
    steps = _steps(solution_str)
    return sum(style == "careful" for style, _ in steps), len(steps)


def line_accuracy(solution_str: str) -> float | None:
    """Share of a response's step lines whose arithmetic is right (None without step lines)."""
    steps = _steps(solution_str)
    return sum(ok for _, ok in steps) / len(steps) if steps else None


def write_parquet(out: Path, n: int, seed: int, corpus: CorpusConfig | None = None) -> Path:
    """``n`` problems as a verl RLHFDataset parquet file (``corpus``: the problems' shape)."""
    import pandas as pd

    cfg = dataclasses.replace(corpus or CorpusConfig(), seed=seed)
    rows = []
    for i, p in enumerate(make_corpus(n, cfg)):
        answer = _BOXED.findall(p.response)[-1]
        rows.append({"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": p.prompt}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer},
                     "extra_info": {"index": i, "split": "train"}})
    out.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(out)
    return out
