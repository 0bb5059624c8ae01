"""`tlt export`, `tlt bench packing` and `tlt demo`'s output directory through the CLI (the main job:
tests/integrations/test_verl_loop.py)."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file

from tlt.cli import main


def test_export_cli_refuses_then_overwrites(tmp_path, trained_target, chat_prompts, capsys):
    drafter = tmp_path / "d"
    assert main(["-q", "warmup", "--target", str(trained_target), "--data", str(chat_prompts),
                 "--out", str(drafter), "--method", "eagle3", "--max-steps", "2",
                 "--draft-vocab-size", "100", "--max-new-tokens", "16"]) == 0
    out = tmp_path / "e"
    args = ["export", "--drafter", str(drafter), "--target", str(trained_target), "--format", "vllm",
            "--out", str(out)]
    assert main(args) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 100 and cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert load_file(str(out / "model.safetensors"))["d2t"].numel() == 100
    capsys.readouterr()
    assert main(args) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(args + ["--overwrite"]) == 0
    model = tmp_path / "model"  # a model directory (a copy: the session's target stays out of harm's way)
    shutil.copytree(trained_target, model)
    for kept in (drafter, model):  # --overwrite replaces an earlier export only, never a drafter or a model
        before = sorted(p.name for p in kept.iterdir())
        assert main(args[:-1] + [str(kept), "--overwrite"]) == 2
        assert "is not an earlier export" in capsys.readouterr().err
        assert sorted(p.name for p in kept.iterdir()) == before


def test_bench_packing_quick_writes_record(tmp_path, capsys):
    record = tmp_path / "packing.json"
    assert main(["-q", "bench", "packing", "--quick", "--json", str(record)]) == 0
    r = json.loads(record.read_text())
    assert set(r["tokens_per_s"]) == {"packed", "padded", "padded_sorted"}
    assert r["pad_fraction"]["packed"] == 0 and r["pad_fraction"]["padded"] > 0.2
    assert r["ratio_packed_vs_padded"] == pytest.approx(r["tokens_per_s"]["packed"] / r["tokens_per_s"]["padded"])
    assert "packed / padded" in capsys.readouterr().out


def test_the_demo_replaces_only_a_directory_it_wrote(tmp_path, capsys):
    """``tlt demo --out DIR`` replaces DIR only when a demo wrote it: a user's data folder that happens
    to hold a ``train.parquet`` (verl's usual name) is refused, untouched, before anything runs."""
    from tlt.demo.job import MARKER, _earlier_demo

    data = tmp_path / "gsm8k"
    data.mkdir()
    for name in ("train.parquet", "test.parquet", "README.txt"):
        (data / name).write_text("x")
    assert main(["demo", "--quick", "--out", str(data)]) == 2
    assert "not an earlier demo's directory" in capsys.readouterr().err
    assert sorted(p.name for p in data.iterdir()) == ["README.txt", "test.parquet", "train.parquet"]
    (tmp_path / "afile").write_text("x")
    assert main(["demo", "--quick", "--out", str(tmp_path / "afile")]) == 2 and "is a file" in capsys.readouterr().err
    old = tmp_path / "old"  # an earlier version's finished demo (no marker)
    old.mkdir()
    for name in ("train.parquet", "val.parquet"):  # a verl data folder's layout: never a demo's
        (old / name).write_text("x")
    assert not _earlier_demo(old)
    for name in ("prompts.jsonl", "drafter", "arm-A", "summary.json"):
        (old / name).mkdir() if "." not in name else (old / name).write_text("x")
    assert not _earlier_demo(old)  # no arm ran in it
    (old / "arm-A" / "command.txt").write_text("python -m verl.trainer.main_ppo ...")
    assert _earlier_demo(old)
    (old / "notes.md").write_text("mine")
    assert not _earlier_demo(old)
    (old / MARKER).write_text("")
    assert _earlier_demo(old)


def test_the_demo_marks_its_directory_before_anything_else(tmp_path, monkeypatch):
    from tlt.demo import job

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(job, "ensure_target", lambda spec, progress: tmp_path / "target")
    monkeypatch.setattr(job, "write_parquet", stop)  # the first thing written after the marker
    with pytest.raises(Stop):
        job.run_demo(tmp_path / "demo", quick=True, progress=False)
    assert job._earlier_demo(tmp_path / "demo") and (tmp_path / "demo" / job.MARKER).is_file()
