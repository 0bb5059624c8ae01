"""What the benches share: the demo target and its cached EAGLE drafter, and the paired bootstrap interval.

Owns :func:`demo_target` (the demo's target) and :func:`demo_drafter` (a warm-up drafter of a
target; by default the one the benches measure), each built once into TLT's cache, and
:func:`paired_ci90` (the 90% interval of a median paired ratio). Benches import these, never each
other's private helpers.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from tlt.demo.corpus import CorpusConfig, make_corpus
from tlt.demo.step_ratios import bootstrap_ci90
from tlt.demo.target_factory import default_cache_dir
from tlt.drafter.offline_train import TrainConfig
from tlt.warmup import WarmupConfig, run_warmup


def demo_target(quick: bool) -> Path:
    """The directory of the demo's target (``tlt demo --quick``'s when ``quick``)."""
    from tlt.demo.job import DEFAULT, QUICK
    from tlt.demo.target_factory import ensure_target

    return ensure_target((QUICK if quick else DEFAULT).target, progress=False)


def demo_drafter(target: Path, steps: int | None = None, quick: bool = False) -> Path:
    """The directory of an EAGLE drafter of ``target`` warmed up for ``steps`` steps (None: 20 when
    ``quick``, else 150: the benches' drafter) on the demo's corpus (32 prompts when ``quick``, else
    160), built once into the cache and reused by every bench."""
    steps = steps if steps is not None else 20 if quick else 150
    out = default_cache_dir() / "drafters" / f"{target.name}-eagle-{steps}"
    if (out / "tlt_drafter.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=out.parent) as tmp:
        prompts = Path(tmp) / "p.jsonl"
        corpus = make_corpus(32 if quick else 160, CorpusConfig(seed=7))
        prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p.prompt}]}) + "\n"
                                   for p in corpus))
        run_warmup(WarmupConfig(target=target, data=prompts, out=Path(tmp) / "d", max_new_tokens=200,
                                train=TrainConfig(max_steps=steps)), progress=False)
        (Path(tmp) / "d").rename(out)
    return out


def paired_ci90(ar_s: list[float], variant_s: list[float], seed: int,
                resamples: int = 2000) -> tuple[float, float] | None:
    """Bootstrap 90% interval of the median paired ratio (AR's time / the variant's, per repeat);
    None for a single repeat."""
    ratios = [a / t for a, t in zip(ar_s, variant_s)]
    return bootstrap_ci90(ratios, statistics.median, seed=seed, draws=resamples)


def show_ci90(iv: tuple[float, float] | list[float] | None) -> str:
    """``90% CI lo-hi``, or what a missing interval means."""
    return "no CI (1 repeat)" if iv is None else f"90% CI {iv[0]:.2f}-{iv[1]:.2f}"
