"""`tlt export` and `tlt bench packing` through the CLI (the main job: tests/integrations/test_verl_loop.py)."""

from __future__ import annotations

import json

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


def test_bench_packing_quick_writes_record(tmp_path, capsys):
    record = tmp_path / "packing.json"
    assert main(["-q", "bench", "packing", "--quick", "--json", str(record)]) == 0
    r = json.loads(record.read_text())
    assert set(r["tokens_per_s"]) == {"packed", "padded", "padded_sorted"}
    assert r["pad_fraction"]["packed"] == 0 and r["pad_fraction"]["padded"] > 0.2
    assert r["ratio_packed_vs_padded"] == pytest.approx(r["tokens_per_s"]["packed"] / r["tokens_per_s"]["padded"])
    assert "packed / padded" in capsys.readouterr().out
