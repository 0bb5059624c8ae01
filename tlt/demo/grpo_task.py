"""The embedded GRPO task: arithmetic chains with a long tail of response lengths, and its reward.

Owns the verl-format prompt files (parquet: ``data_source``, chat ``prompt``, ``reward_model`` with
the ground truth) built from :mod:`tlt.demo.corpus`, and the rule-based reward verl calls
(``reward.custom_reward_function.path=<this file>``, ``name=compute_score``): 0 without a
``\\boxed{N}`` answer; otherwise 0.2 + 0.5 x (share of step lines ``a op b = c`` whose arithmetic
is right) + 0.3 if the answer is right. The dense part lets a tiny policy measurably learn within a
few GRPO steps (its final answers are almost never right at first). Nothing here imports verl.
"""

from __future__ import annotations

import re
from pathlib import Path

from tlt.demo.corpus import CorpusConfig, make_corpus

DATA_SOURCE = "tlt/arith"
_BOXED = re.compile(r"\\boxed\{(-?\d+)\}")
_STEP = re.compile(r"^(-?\d+) ([+-]) (\d+) = (-?\d+)$")


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    text = solution_str or ""
    found = _BOXED.findall(text)
    if not found:
        return 0.0
    steps = [line.strip() for line in text.splitlines() if " = " in line]  # a malformed step counts wrong
    right = 0
    for line in steps:
        m = _STEP.match(line)
        right += bool(m) and int(m[1]) + (int(m[3]) if m[2] == "+" else -int(m[3])) == int(m[4])
    line_acc = right / len(steps) if steps else 0.0
    return 0.2 + 0.5 * line_acc + 0.3 * (found[-1] == str(ground_truth).strip())


def write_parquet(out: Path, n: int, seed: int, corpus: CorpusConfig | None = None) -> Path:
    """``n`` problems as a verl RLHFDataset parquet file."""
    import pandas as pd

    cfg = corpus or CorpusConfig(seed=seed)
    rows = []
    for i, p in enumerate(make_corpus(n, CorpusConfig(**{**cfg.__dict__, "seed": seed}))):
        answer = _BOXED.findall(p.response)[-1]
        rows.append({"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": p.prompt}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer},
                     "extra_info": {"index": i, "split": "train"}})
    out.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(out)
    return out
