"""The embedded GRPO task: its reward rule (careful lines preferred) and the verl parquet files."""

from __future__ import annotations

import pytest

from tlt.demo.corpus import CorpusConfig, make_corpus
from tlt.demo.grpo_task import DATA_SOURCE, careful_lines, compute_score, line_accuracy, write_parquet

CAREFUL = CorpusConfig(seed=3, careful_share=1.0)


def _answer(p):
    return p.response.rsplit("{", 1)[1].split("}")[0]


def test_reward_is_the_share_of_careful_lines():
    p = make_corpus(1, CAREFUL)[0]
    lines = p.response.count(" gives ")
    assert lines == p.careful_lines >= 1 and " = " not in p.response
    ans = _answer(p)
    assert compute_score(DATA_SOURCE, p.response, ans) == pytest.approx(1.0)  # the reference solution
    assert compute_score(DATA_SOURCE, p.response, str(int(ans) + 1)) == pytest.approx(1.0)  # style only
    plain = make_corpus(1, CorpusConfig(seed=3))[0]
    assert plain.careful_lines == 0 and compute_score(DATA_SOURCE, plain.response, _answer(plain)) == pytest.approx(0.1)
    # one plain line among careful ones: that line's share of the style credit is lost
    mixed = p.response.replace(p.response.splitlines()[1], "1 + 1 = 2", 1)
    assert careful_lines(mixed) == (lines - 1, lines)
    assert compute_score(DATA_SOURCE, mixed, ans) == pytest.approx(1.0 - 0.9 / lines)
    assert compute_score(DATA_SOURCE, p.response.replace("\\boxed", "boxed"), ans) == 0.0
    assert compute_score(DATA_SOURCE, None, ans) == 0.0


def test_line_accuracy_checks_the_arithmetic_in_both_styles():
    for share in (0.0, 1.0):
        p = make_corpus(1, CorpusConfig(seed=4, careful_share=share))[0]
        assert line_accuracy(p.response) == 1.0
        first = p.response.splitlines()[1]  # the first step line
        head, result = first.rsplit(" ", 1)
        wrong = f"{head} {int(result.rstrip('.')) + 1}" + ("." if share else "")
        lines = len([x for x in p.response.splitlines() if " = " in x or " gives " in x])
        assert line_accuracy(p.response.replace(first, wrong, 1)) == pytest.approx((lines - 1) / lines)
    assert line_accuracy("no steps here") is None


def test_careful_share_is_drawn_per_line():
    probs = make_corpus(2000, CorpusConfig(seed=1, careful_share=0.1))
    lines = sum(p.response.count(" gives ") + p.response.count(" = ") for p in probs)
    assert 0.09 < sum(p.careful_lines for p in probs) / lines < 0.11
    # per line, not per response: most responses of several steps mix the two styles
    mixed = [p for p in probs if 0 < p.careful_lines < p.response.count("\n") - 1]
    assert len(mixed) > 0.3 * len(probs)
    with pytest.raises(ValueError, match="careful_share"):
        CorpusConfig(careful_share=1.5)


def test_parquet_rows_are_verl_rlhf_rows(tmp_path):
    pd = pytest.importorskip("pandas", reason="pandas comes with the verl extra")
    path = write_parquet(tmp_path / "t.parquet", 5, seed=11, corpus=CAREFUL)
    df = pd.read_parquet(path)
    assert len(df) == 5 and set(df.columns) >= {"data_source", "prompt", "reward_model", "extra_info"}
    problems = make_corpus(5, CorpusConfig(seed=11, careful_share=1.0))
    for i, (row, prob) in enumerate(zip(df.itertuples(), problems)):
        assert list(row.prompt)[0]["content"] == prob.prompt
        assert row.extra_info["index"] == i  # the prompt index coupled sampling keys seeds on
        assert compute_score(row.data_source, prob.response, row.reward_model["ground_truth"]) == pytest.approx(1.0)
