"""Shared fixtures: small trained targets built by the project's own factory (no downloads)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tlt.demo.corpus import CorpusConfig, make_corpus
from tlt.demo.target_factory import TargetSpec, ensure_target

# The examples (examples/, examples/research/) import as their scripts do: from their own folder.
_EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
for _folder in (_EXAMPLES, _EXAMPLES / "research"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

# Trains in seconds yet answers with varied, prompt-dependent text.
SMALL_TRAINED = TargetSpec(hidden_size=64, num_layers=2, intermediate_size=176, train_steps=150,
                           seq_len=256, batch_size=8)


@pytest.fixture(scope="session")
def tlt_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tlt-cache")


@pytest.fixture(scope="session", autouse=True)
def _one_cache_per_session(tlt_cache):
    """Every test's default ``TLT_CACHE`` (targets, warm-up drafters) is this session's: built once
    per run, shared by the benches and integrations that ask for the same one, never the user's
    ~/.cache. (The quick demo's test gives its subprocess a fresh cache of its own.)"""
    mp = pytest.MonkeyPatch()
    mp.setenv("TLT_CACHE", str(tlt_cache))
    yield
    mp.undo()


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


def _warm_drafter(target, prompts_file, out, method):
    from tlt.drafter.offline_train import TrainConfig
    from tlt.warmup import WarmupConfig, run_warmup

    extra = {"draft_vocab_size": 200} if method == "eagle3" else {}
    run_warmup(WarmupConfig(target=target, data=prompts_file, out=out, method=method, max_new_tokens=64,
                            train=TrainConfig(max_steps=60), **extra), progress=False)
    return out


@pytest.fixture(scope="session")
def warm_drafters(trained_target, tmp_path_factory):
    """{"eagle": dir, "eagle3": dir}: drafters warmed up on the trained target's own rollouts."""
    root = tmp_path_factory.mktemp("drafters")
    prompts = root / "prompts.jsonl"
    corpus = make_corpus(48, CorpusConfig(seed=78, median_steps=3))
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p.prompt}]}) + "\n"
                               for p in corpus))
    return {m: _warm_drafter(trained_target, prompts, root / m, m) for m in ("eagle", "eagle3")}
