"""The embedded GRPO task: its reward rule and the verl parquet files."""

from __future__ import annotations

import pytest

from tlt.demo.corpus import CorpusConfig, make_corpus
from tlt.demo.grpo_task import DATA_SOURCE, compute_score, write_parquet


def test_reward_rewards_format_lines_and_answer():
    p = make_corpus(1, CorpusConfig(seed=3))[0]
    answer = p.response.rsplit("{", 1)[1].split("}")[0]
    assert compute_score(DATA_SOURCE, p.response, answer) == pytest.approx(1.0)  # the reference solution
    assert compute_score(DATA_SOURCE, p.response, str(int(answer) + 1)) == pytest.approx(0.7)
    wrong_line = p.response.replace(" = ", " = 1", 1)  # first step's arithmetic now wrong
    lines = p.response.count(" = ")
    assert compute_score(DATA_SOURCE, wrong_line, answer) == pytest.approx(0.2 + 0.5 * (lines - 1) / lines + 0.3)
    assert compute_score(DATA_SOURCE, p.response.replace("\\boxed", "boxed"), answer) == 0.0
    assert compute_score(DATA_SOURCE, None, answer) == 0.0


def test_parquet_rows_are_verl_rlhf_rows(tmp_path):
    pd = pytest.importorskip("pandas", reason="pandas comes with the verl extra")
    path = write_parquet(tmp_path / "t.parquet", 5, seed=11)
    df = pd.read_parquet(path)
    assert len(df) == 5 and set(df.columns) >= {"data_source", "prompt", "reward_model", "extra_info"}
    problems = make_corpus(5, CorpusConfig(seed=11))
    for row, prob in zip(df.itertuples(), problems):
        assert list(row.prompt)[0]["content"] == prob.prompt
        assert compute_score(row.data_source, prob.response, row.reward_model["ground_truth"]) == pytest.approx(1.0)
