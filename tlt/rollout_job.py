"""``tlt rollout`` and ``tlt report``: a GRPO-style rollout from a prompt file, and its plot.

Owns the rollout job (target, optional drafter or the suffix drafter, BEG-MAB tuner or a fixed
strategy, assembled by :mod:`tlt.rollout.assembly` as a replica's engine is), writing the responses (JSONL) and the per-rollout record (JSON), and
rendering a record as a PNG.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import torch

from tlt.drafter.eagle import Drafter, read_config
from tlt.rollout import assembly
from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.generate import SamplingParams
from tlt.rollout.suffix import SuffixProposer
from tlt.rollout.record import rollout_record
from tlt.rollout.strategy import Arm
from tlt.rollout.target import TargetModel
from tlt.rollout.tuner import BegMab
from tlt.data import load_prompts
from tlt.tokenizer import TextTokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutJob:
    target: Path
    data: Path
    drafter: Path | None = None  # None: the suffix drafter
    n: int = 1  # samples per prompt (a GRPO group)
    max_prompts: int = 0
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    arm: Arm | None = None  # fixed strategy; None = BEG-MAB
    no_sd: bool = False
    elastic_threshold: int | None = None  # None: learned by the tuner
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"--n must be >= 1, got {self.n}")
        if self.max_prompts < 0:
            raise ValueError(f"--max-prompts must be >= 0 (0: every prompt), got {self.max_prompts}")
        if self.no_sd and self.arm is not None and not self.arm.is_off:
            raise ValueError(f"--no-sd decodes without speculation: --arm {self.arm} would be ignored; give one of them")


def build_engine(job: RolloutJob, model: TargetModel, batch: int, max_len: int
                 ) -> tuple[RolloutEngine, BegMab | None]:
    """The engine ``tlt rollout`` runs (:mod:`tlt.rollout.assembly`'s conventions, as a replica's):
    the EAGLE drafter given, else the suffix drafter; BEG-MAB unless a strategy is fixed."""
    cfg = EngineConfig(max_batch=batch, max_len=max_len, elastic_threshold=job.elastic_threshold, seed=job.seed)
    if job.no_sd:
        return RolloutEngine(model, dataclasses.replace(cfg, arm=job.arm)), None
    if job.drafter is not None:
        read_config(job.drafter).check_target(model.config)
        named = assembly.proposers(cfg, drafter=Drafter.load(job.drafter, model.embed_weight, model.lm_head.weight))
    else:
        named = assembly.proposers(cfg, suffix=SuffixProposer())
    arm = assembly.fixed_arm(job.arm, named)
    tuner = assembly.tuner(named, device=model.embed_weight.device.type, seed=job.seed, fixed=arm)
    return RolloutEngine(model, dataclasses.replace(cfg, arm=arm), proposers=named, tuner=tuner), tuner


def run_rollout(job: RolloutJob, out: Path | None, record_path: Path | None) -> dict:
    model = TargetModel.from_pretrained(job.target)
    tok = TextTokenizer.from_pretrained(job.target)
    records = load_prompts(job.data)[: job.max_prompts or None]
    prompts, groups = [], []
    for g, rec in enumerate(records):
        ids = tok.encode(rec.text) if rec.text is not None else tok.chat_prompt(rec.chat())
        prompts += [ids] * job.n
        groups += [g] * job.n
    stops = model.config.eos_ids or ((tok.eos_id,) if tok.eos_id is not None else ())
    params = SamplingParams(temperature=job.temperature, top_p=job.top_p, top_k=job.top_k,
                            max_new_tokens=job.max_new_tokens, stop_ids=stops)
    max_len = max(len(p) for p in prompts) + job.max_new_tokens + 1
    engine, tuner = build_engine(job, model, len(prompts), max_len)
    torch.manual_seed(job.seed)
    result = engine.generate(prompts, params, groups)
    record = rollout_record(result, tuner_stats=tuner.stats() if tuner else None,
                            meta={"target": str(job.target), "drafter": str(job.drafter) if job.drafter else
                                  ("none" if job.no_sd else "suffix"), "n": job.n})
    for path in (out, record_path):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
    if out is not None:
        out.write_text("".join(json.dumps({"group": g, "prompt": p, "response": o, "text": tok.decode(o)}) + "\n"
                               for g, p, o in zip(groups, prompts, result.outputs)))
    if record_path is not None:
        record_path.write_text(json.dumps(record, indent=2))
    return record


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("tlt report needs matplotlib: pip install 'tlt-rollout[report]'") from None
    return plt


def plot_steps(records: list[dict], png: Path) -> None:
    """Per-RL-step records of a verl run (``tlt_steps.jsonl``): accept length, times, idle/train."""
    if not records or "step" not in records[0]:
        raise ValueError("not a TLT step record (one JSON object per RL step with a 'step' key)")
    plt = _pyplot()
    s = [r["step"] for r in records]
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    accept = [r.get("rollout/spec_accept_length", math.nan) for r in records]  # NaN: nothing verified
    axes[0].plot(s, accept, marker="o")
    axes[0].set(ylabel="tokens / verify", title="accept length (drafter version in labels)")
    for x, y, r in zip(s, accept, records):
        if not math.isnan(y):
            axes[0].annotate(f"v{int(r.get('tlt/drafter_version', 0))}", (x, y), fontsize=8)
    axes[1].plot(s, [r.get("tlt/rollout_s") for r in records], marker="o", label="rollout")
    axes[1].plot(s, [r.get("timing_s/step") for r in records], marker="o", label="RL step")
    axes[1].set(ylabel="seconds", title="rollout and step time")
    axes[1].legend()
    axes[2].bar(s, [r.get("tlt/idle_replica_s", 0) for r in records], label="replica idle s (summed)")
    axes[2].plot(s, [r.get("tlt/spot_train_steps", 0) for r in records], color="tab:red", marker="o",
                 label="drafter train steps")
    axes[2].set(xlabel="RL step", title="idle replicas and spot training")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def plot_record(record: dict, png: Path) -> None:
    plt = _pyplot()
    tl = record.get("timeline") if isinstance(record, dict) else None
    if not tl:
        raise ValueError("the record has no timeline (is it a `tlt rollout --record` file?)")
    fig, axes = plt.subplots(3, 1, figsize=(9, 9))
    t = [s["t"] for s in tl]
    axes[0].step(t, [s["batch"] for s in tl], where="post", label="running requests")
    sd_t = [s["t"] for s in tl if s["sd"]]
    axes[0].scatter(sd_t, [0] * len(sd_t), marker="|", color="tab:red", label="SD on")
    axes[0].set(xlabel="seconds", ylabel="batch", title="running batch and SD timeline")
    axes[0].legend()
    hist = record["accept_length_hist"]
    axes[1].bar([int(k) for k in hist], list(hist.values()))
    axes[1].set(xlabel="tokens committed per SD step", ylabel="count",
                title=f"accept length (mean {record['mean_accept_length'] or 0:.2f})")
    arms = record["arms"]
    names = sorted(arms)
    axes[2].bar(names, [arms[a]["steps"] for a in names])
    for i, a in enumerate(names):
        axes[2].annotate(f"{arms[a]['goodput_tok_s']:.0f} tok/s", (i, arms[a]["steps"]), ha="center",
                         va="bottom", fontsize=8)
    axes[2].set(ylabel="steps", title="strategy use (label: goodput)")
    axes[2].tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
