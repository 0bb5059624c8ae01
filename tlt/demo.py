"""``tlt demo``: the main job end to end on a CPU, with nothing downloaded.

Owns the demo script: build (or reuse from cache) the tiny trained target, write its arithmetic
prompts, warm up an EAGLE drafter on the target's own rollouts, export it for SGLang and vLLM, run
a GRPO-style rollout plain and speculative (greedy, so the outputs must be identical), and report
what happened (also as ``summary.json`` in the work directory).
"""

from __future__ import annotations

import json
import logging
import shutil
import statistics
import time
from pathlib import Path

from drafter.export import export_drafter
from drafter.trainer import TrainConfig
from tlt.corpus import CorpusConfig, make_corpus
from tlt.rollout_job import RolloutJob, run_rollout
from tlt.target_factory import TargetSpec, ensure_target
from tlt.warmup import ROLLOUTS_NAME, WarmupConfig, run_warmup

log = logging.getLogger(__name__)
DEMO_TARGET = TargetSpec(train_steps=300)
# Small enough for the test suite: seconds, not minutes.
QUICK_TARGET = TargetSpec(hidden_size=64, num_layers=2, intermediate_size=128, train_steps=10,
                          batch_size=4, seq_len=128)


def run_demo(workdir: Path, *, quick: bool = False, progress: bool = True) -> dict:
    t0 = time.monotonic()
    spec = QUICK_TARGET if quick else DEMO_TARGET
    n_prompts, steps, max_new = (12, 20, 48) if quick else (160, 150, 320)
    log.info("1/5 target: %s, %d training steps (cached after the first run)", spec.family,
             spec.train_steps)
    target = ensure_target(spec, progress=progress)
    meta = json.loads((target / "tlt_target.json").read_text())

    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    prompts = workdir / "prompts.jsonl"
    # Held-out problems: a seed the target never trained on.
    corpus = make_corpus(n_prompts, CorpusConfig(seed=spec.seed + 1000))
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p.prompt}]}) + "\n"
                               for p in corpus))

    log.info("2/5 rollouts + 3/5 drafter warm-up on %d prompts", n_prompts)
    report = run_warmup(WarmupConfig(target=target, data=prompts, out=workdir / "drafter",
                                     max_new_tokens=max_new,
                                     train=TrainConfig(max_steps=steps, save_every=max(steps // 3, 1))),
                        progress=progress)
    rollouts = [json.loads(x) for x in (workdir / "drafter" / ROLLOUTS_NAME).read_text().splitlines()]
    lengths = sorted(len(r["response"]) for r in rollouts)

    log.info("4/5 export for SGLang and vLLM")
    exports = {fmt: export_drafter(workdir / "drafter", target, fmt, workdir / f"export-{fmt}")
               for fmt in ("sglang", "vllm")}

    log.info("5/5 GRPO rollout (4 samples per prompt, greedy): plain vs speculative with the drafter")
    spec_runs = {}
    for name, kw in (("AR", {"no_sd": True}), ("SD", {"drafter": workdir / "drafter"})):
        job = RolloutJob(target=target, data=prompts, max_prompts=4 if quick else 8, n=4, temperature=0.0,
                         max_new_tokens=max_new, **kw)
        spec_runs[name] = run_rollout(job, workdir / f"rollout-{name}.jsonl", workdir / f"record-{name}.json")
    same = (workdir / "rollout-AR.jsonl").read_text() == (workdir / "rollout-SD.jsonl").read_text()
    summary = {
        "target": str(target), "target_train_steps": meta["train_steps"],
        "target_final_loss": meta.get("final_loss"),
        "rollouts": len(rollouts), "response_len_min": lengths[0],
        "response_len_median": statistics.median(lengths), "response_len_max": lengths[-1],
        "drafter": str(workdir / "drafter"), "untrained": report["untrained"], "trained": report["trained"],
        "exports": {k: v["out_dir"] for k, v in exports.items()},
        "rollout_ar_tok_s": spec_runs["AR"]["tokens_per_s"], "rollout_sd_tok_s": spec_runs["SD"]["tokens_per_s"],
        "rollout_accept_length": spec_runs["SD"]["mean_accept_length"], "rollout_identical": same,
        "seconds": time.monotonic() - t0,
    }
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def summary_lines(s: dict) -> list[str]:
    b, t = s["untrained"], s["trained"]
    loss = f", loss {s['target_final_loss']:.2f}" if s["target_final_loss"] else ""
    return [
        f"target      {s['target']} ({s['target_train_steps']} training steps{loss})",
        f"rollouts    {s['rollouts']} responses, lengths {s['response_len_min']}..{s['response_len_max']} "
        f"tokens (median {s['response_len_median']:.0f})",
        f"drafter     held-out top-1 {b['top1']:.3f} -> {t['top1']:.3f}, top-3 {b['top3']:.3f} -> "
        f"{t['top3']:.3f}, est. accept length {b['accept_length']:.2f} -> {t['accept_length']:.2f}",
        f"rollout     AR {s['rollout_ar_tok_s']:.0f} tok/s, EAGLE + BEG-MAB {s['rollout_sd_tok_s']:.0f} tok/s "
        f"({s['rollout_sd_tok_s'] / s['rollout_ar_tok_s']:.2f}x, mean accept length "
        f"{s['rollout_accept_length'] or 0:.2f}); outputs identical: {s['rollout_identical']}",
        "exports     " + ", ".join(f"{k}: {v}" for k, v in s["exports"].items()),
        f"done in {s['seconds']:.0f}s",
    ]
