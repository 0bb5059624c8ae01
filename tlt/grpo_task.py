"""The embedded GRPO task: arithmetic chains with a long tail of response lengths, and its reward.

Owns the verl-format prompt files (parquet: ``data_source``, chat ``prompt``, ``reward_model`` with
the ground truth) built from :mod:`tlt.corpus`, and the rule-based reward verl calls
(``reward.custom_reward_function.path=<this file>``, ``name=compute_score``): 1 for the right
``\\boxed{N}`` answer, 0.1 for a well-formed wrong one, 0 otherwise. Nothing here imports verl.
"""

from __future__ import annotations

import re
from pathlib import Path

from tlt.corpus import CorpusConfig, make_corpus

DATA_SOURCE = "tlt/arith"
_BOXED = re.compile(r"\\boxed\{(-?\d+)\}")


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    found = _BOXED.findall(solution_str or "")
    if not found:
        return 0.0
    return 1.0 if found[-1] == str(ground_truth).strip() else 0.1


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
