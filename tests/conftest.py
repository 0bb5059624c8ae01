"""Shared fixtures: small trained targets built by the project's own factory (no downloads)."""

from __future__ import annotations

import json

import pytest

from tlt.corpus import CorpusConfig, make_corpus
from tlt.target_factory import TargetSpec, ensure_target

# Trains in seconds yet answers with varied, prompt-dependent text.
SMALL_TRAINED = TargetSpec(hidden_size=64, num_layers=2, intermediate_size=176, train_steps=150,
                           seq_len=256, batch_size=8)


@pytest.fixture(scope="session")
def tlt_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tlt-cache")


@pytest.fixture(scope="session")
def trained_target(tlt_cache):
    return ensure_target(SMALL_TRAINED, tlt_cache, progress=False)


@pytest.fixture
def chat_prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    corpus = make_corpus(40, CorpusConfig(seed=77, median_steps=3))
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p.prompt}]}) + "\n"
                            for p in corpus))
    return path


FAMILIES = ("llama", "qwen2", "qwen3")


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param
