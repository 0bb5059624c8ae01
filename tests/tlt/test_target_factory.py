"""The embedded default target: HF-loadable for each family, cached, tokenizer built here."""

from __future__ import annotations

import json

import pytest
import torch

from tlt.rollout.target import TargetModel
from tlt.cli import main
from tlt.demo.target_factory import TargetSpec, ensure_target
from tlt.tokenizer import TextTokenizer

transformers = pytest.importorskip("transformers", reason="needs the [dev] extra")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_make_target_loads_in_transformers_and_matches(family, tmp_path, tlt_cache):
    out = tmp_path / family
    assert main(["-q", "make-target", "--family", family, "--out", str(out), "--cache", str(tlt_cache)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ours = TargetModel.from_pretrained(out)
    ids = torch.randint(0, ours.config.vocab_size, (1, 20))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids).logits).abs().max() < 1e-4
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    tok = TextTokenizer.from_pretrained(out)
    text = "Compute 12 + 7.\n12 + 7 = 19"
    assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text)
    assert tok.decode(tok.encode(text)) == text
    chat = [{"role": "user", "content": "Compute 1 + 2."}]
    assert hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == tok.tok.decode(
        tok.chat_prompt(chat), skip_special_tokens=False)


def test_cache_is_reused_and_keyed_by_spec(tlt_cache):
    a = ensure_target(TargetSpec(hidden_size=32, num_layers=2, intermediate_size=64), tlt_cache, progress=False)
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    b = ensure_target(TargetSpec(hidden_size=32, num_layers=2, intermediate_size=64), tlt_cache, progress=False)
    assert a == b and (b / "model.safetensors").stat().st_mtime_ns == stamp
    c = ensure_target(TargetSpec(hidden_size=32, num_layers=2, intermediate_size=64, seed=1), tlt_cache,
                      progress=False)
    assert c != a
    assert not [p for p in a.parent.iterdir() if p.name.startswith(".build-")]


def test_trained_target_learned_the_corpus(trained_target):
    meta = json.loads((trained_target / "tlt_target.json").read_text())
    assert meta["final_loss"] < 0.5 * meta["first_loss"]


def test_bad_spec_and_out_dir(tmp_path, capsys):
    with pytest.raises(ValueError, match="family"):
        TargetSpec(family="gpt2")
    out = tmp_path / "o"
    out.mkdir()
    (out / "x").write_text("x")
    assert main(["make-target", "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
