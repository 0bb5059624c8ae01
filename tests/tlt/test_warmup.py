"""`tlt warmup` end to end on a trained tiny target, its resume, and its input errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tlt.drafter.checkpoint import latest
from tlt.drafter.offline_train import STATE_NAME
from tlt.cli import main

SHARED_PROMPTS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "eurus2_rl_sample_prompts.json"


def _warmup(target, data, out, *extra):
    return main(["-q", "warmup", "--target", str(target), "--data", str(data), "--out", str(out),
                 "--max-new-tokens", "48", *extra])


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_warmup_raises_heldout_accuracy(warm_drafters, method):
    """The session's warm-up drafters (tests/conftest.py: ``run_warmup``, 60 steps, the same code the
    CLI runs) against their own untrained start, on held-out rollouts."""
    out = warm_drafters[method]
    report = json.loads((out / "warmup_report.json").read_text())
    before, after = report["untrained"], report["trained"]
    print(f"{method}: held-out top-1 {before['top1']:.3f} -> {after['top1']:.3f}, "
          f"accept length {before['accept_length']:.2f} -> {after['accept_length']:.2f}")
    assert after["top1"] > before["top1"] + 0.3
    assert after["accept_length"] > before["accept_length"] + 0.5
    for name in ("model.safetensors", "tlt_drafter.json", "rollouts.jsonl"):
        assert (out / name).is_file()
    assert latest(out / STATE_NAME) is not None  # the DCP training state, for --resume


def test_resume_continues_without_regenerating(trained_target, chat_prompts, tmp_path, capsys):
    out = tmp_path / "d"
    assert _warmup(trained_target, chat_prompts, out, "--max-steps", "4", "--save-every", "2") == 0
    assert "held-out top-1" in capsys.readouterr().out  # the CLI's report line
    rollouts = (out / "rollouts.jsonl").read_text()
    assert _warmup(trained_target, chat_prompts, out, "--max-steps", "8", "--resume") == 0
    assert (out / "rollouts.jsonl").read_text() == rollouts
    assert json.loads((out / "tlt_drafter.json").read_text())["step"] == 8
    capsys.readouterr()
    assert _warmup(trained_target, chat_prompts, out, "--max-steps", "8", "--resume") == 0  # done already: a report
    assert "8 steps, no step trained" in capsys.readouterr().out


@pytest.mark.skipif(not SHARED_PROMPTS.is_file(), reason="../shared/data is not beside the checkout")
def test_shared_eurus_sample_works(trained_target, tmp_path):
    out = tmp_path / "eurus"
    assert _warmup(trained_target, SHARED_PROMPTS, out, "--max-steps", "3", "--max-prompts", "6") == 0
    report = json.loads((out / "warmup_report.json").read_text())
    assert report["train_samples"] + report["heldout_samples"] == 6


def test_responses_from_file(trained_target, tmp_path):
    data = tmp_path / "pairs.json"
    data.write_text(json.dumps([{"prompt": f"Compute {i} + 1.", "response": f"{i} + 1 = {i + 1}"}
                                for i in range(6)]))
    out = tmp_path / "d"
    assert _warmup(trained_target, data, out, "--max-steps", "2", "--responses", "file") == 0
    first = json.loads((out / "rollouts.jsonl").read_text().splitlines()[0])
    assert first["response"][-1] == 2  # the file's text, ended by <|eos|> (id 2)


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("schema", "no usable 'prompt'"),
    ("empty", "holds no prompts"),
    ("badjson", "not valid JSON"),
])
def test_bad_data_is_one_clear_error(trained_target, tmp_path, capsys, case, message):
    data = tmp_path / "data.json"
    if case == "schema":
        data.write_text(json.dumps([{"question": "hi"}]))
    elif case == "empty":
        data.write_text("[]")
    elif case == "badjson":
        data.write_text("[{")
    out = tmp_path / "out"
    assert _warmup(trained_target, data, out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()  # nothing half-written


def test_target_drafter_mismatch_on_resume(trained_target, chat_prompts, tmp_path, tlt_cache, capsys):
    from tlt.demo.target_factory import TargetSpec, ensure_target

    out = tmp_path / "d"
    assert _warmup(trained_target, chat_prompts, out, "--max-steps", "2") == 0
    other = ensure_target(TargetSpec(hidden_size=32, num_layers=2, intermediate_size=64), tlt_cache,
                          progress=False)
    before = sorted(p.name for p in out.iterdir())
    assert _warmup(other, chat_prompts, out, "--max-steps", "4", "--resume") == 2
    assert "mismatch" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == before


def test_non_empty_out_and_bad_target(trained_target, chat_prompts, tmp_path, capsys):
    out = tmp_path / "d"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert _warmup(trained_target, chat_prompts, out) == 2
    assert "not empty" in capsys.readouterr().err
    broken = tmp_path / "broken"
    shutil.copytree(trained_target, broken)
    (broken / "model.safetensors").unlink()
    assert _warmup(broken, chat_prompts, tmp_path / "d2") == 2
    assert "no model.safetensors" in capsys.readouterr().err
    assert not (tmp_path / "d2").exists()


@pytest.mark.parametrize("args, message", [
    (["--draft-vocab-size", "-5", "--method", "eagle3"], "--draft-vocab-size -5: must be >= 0"),
    (["--draft-vocab-size", "100"], "only --method eagle3 has a draft vocabulary"),  # (eagle would ignore it)
    (["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
    (["--max-steps", "-3"], "max_steps (--max-steps) -3: must be >= 0"),
    (["--lr", "0"], "lr (--lr) 0.0: must be > 0"),
])
def test_each_bad_value_names_its_flag_before_anything_runs(tmp_path, capsys, args, message):
    out = tmp_path / "d"
    assert _warmup(tmp_path / "no-target", tmp_path / "no-data", out, *args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()
