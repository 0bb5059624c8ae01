"""`tlt bench` names: a renamed bench runs under its old name with a warning; a research experiment
moved to examples/research/ is refused with where it went."""

from __future__ import annotations

import pytest

from tlt import bench
from tlt.cli import build_parser, main


def test_a_benchs_old_name_runs_it_with_a_warning(caplog):
    for old, new in [("sglang-policy", "sglang-tuner"), ("tail", "cluster")]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="tlt.bench"):
            assert bench.get(old) is bench.get(new)
        assert f"renamed `tlt bench {new}`" in caplog.text
        assert build_parser().parse_args(["bench", old, "--quick"]).which == old


@pytest.mark.parametrize("name, script", [("headroom", "headroom.py"), ("drafters", "drafters.py"),
                                          ("tuner", "tuner_surface.py")])
def test_a_research_experiment_is_refused_with_where_it_went(name, script, capsys):
    assert main(["-q", "bench", name, "--quick"]) == 2
    assert f"python examples/research/{script} --help" in capsys.readouterr().err


def test_the_research_experiments_flag_is_refused_with_where_they_went(capsys):
    assert main(["-q", "bench", "drafters", "--target-steps", "600"]) == 2  # the documented form of before
    assert "python examples/research/drafters.py --help" in capsys.readouterr().err
    assert main(["-q", "bench", "rollout", "--quick", "--target-steps", "5"]) == 2
    assert "--target-steps: only the research experiments took it" in capsys.readouterr().err
