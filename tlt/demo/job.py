"""``tlt demo``: the main job — real verl 0.9.1 GRPO on this CPU, with and without TLT.

Owns the demo script: build (or reuse from cache) the tiny trained target, write the arithmetic
task as verl parquet files, warm up an EAGLE drafter on the target's own rollouts, export it for
SGLang, then run verl's GRPO loop three times on the same seeds — A) no speculation, B) TLT with
the warm-up drafter frozen (stale), C) full TLT with spot training — each as a separate
``python -m verl.trainer.main_ppo`` process with the ``tlt_grpo_cpu`` config, and compare them in
``summary.json`` and a PNG (reward, accept length and step time per RL step).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from drafter.export import export_drafter
from drafter.trainer import TrainConfig
from tlt.demo.corpus import CorpusConfig, make_corpus
from tlt.demo.grpo_task import write_parquet
from tlt.demo.target_factory import TargetSpec, ensure_target
from tlt.warmup import WarmupConfig, run_warmup

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoSize:
    target: TargetSpec
    prompts: int            # training prompts (one epoch = prompts / batch steps)
    batch: int              # prompts per RL step
    n: int                  # GRPO samples per prompt
    steps: int              # RL steps per arm
    max_response: int
    warmup_steps: int       # drafter warm-up optimizer steps
    actor_lr: float = 2e-4
    timeout_s: int = 900    # per arm


DEFAULT = DemoSize(target=TargetSpec(train_steps=300), prompts=64, batch=8, n=4, steps=8, max_response=256,
                   warmup_steps=60)
QUICK = DemoSize(target=TargetSpec(hidden_size=64, num_layers=2, intermediate_size=128, train_steps=10,
                                   batch_size=4, seq_len=128),
                 prompts=8, batch=4, n=2, steps=2, max_response=64, warmup_steps=5, timeout_s=600)

ARMS = {
    "A": ("no speculation", ["tlt.speculation.enable=false", "tlt.drafter.train=false",
                             "tlt.buffer.capture=off"]),
    "B": ("TLT, warm-up drafter frozen (stale)", ["tlt.drafter.train=false", "tlt.buffer.capture=off"]),
    "C": ("full TLT (spot training)", []),
}


def configs_dir() -> Path:
    import tlt.configs

    return Path(tlt.configs.__file__).parent


def run_demo(workdir: Path, *, quick: bool = False, progress: bool = True, arms: str = "ABC") -> dict:
    t0 = time.monotonic()
    workdir = Path(workdir).resolve()  # the verl runs start in the arm directories
    size = QUICK if quick else DEFAULT
    log.info("1/5 target: %s, %d training steps (cached after the first run)", size.target.family,
             size.target.train_steps)
    if workdir.exists() and any(workdir.iterdir()) and not (workdir / "summary.json").exists() \
            and not (workdir / "train.parquet").exists():
        raise ValueError(f"--out {workdir} is not empty and not an earlier demo's directory; choose a new one")
    target = ensure_target(size.target, progress=progress)
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    seed = size.target.seed + 1000  # held-out problems: a seed the target never trained on
    train = write_parquet(workdir / "train.parquet", size.prompts, seed)
    val = write_parquet(workdir / "val.parquet", max(2, size.batch), seed + 1)
    prompts = workdir / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p.prompt}]}) + "\n"
                               for p in make_corpus(size.prompts, CorpusConfig(seed=seed))))

    log.info("2/5 drafter warm-up on the target's rollouts of the %d training prompts", size.prompts)
    warm = run_warmup(WarmupConfig(target=target, data=prompts, out=workdir / "drafter",
                                   max_new_tokens=size.max_response,
                                   train=TrainConfig(max_steps=size.warmup_steps,
                                                     save_every=max(size.warmup_steps // 2, 1))),
                      progress=progress)
    log.info("3/5 export the drafter for SGLang")
    export = export_drafter(workdir / "drafter", target, "sglang", workdir / "export-sglang")

    records = {}
    for i, arm in enumerate(arms):
        label = ARMS[arm][0]
        log.info("4/5 verl GRPO, arm %s (%s): %d steps [%d/%d]", arm, label, size.steps, i + 1, len(arms))
        records[arm] = run_arm(arm, workdir, size, target, workdir / "drafter", train, val, progress)

    log.info("5/5 summary (and the measured speedup ceiling of speculation on this CPU)")
    summary = summarize(records, size)
    from tlt.tokenizer import TextTokenizer

    tok = TextTokenizer.from_pretrained(target)
    probe = [tok.chat_prompt([{"role": "user", "content": p.prompt}]) for p in make_corpus(4, CorpusConfig(seed=seed))]
    summary["speedup_limit"] = speedup_limit(target, workdir / "drafter", probe)
    summary.update(target=str(target), drafter_warmup=warm["trained"], export=export["out_dir"],
                   seconds=time.monotonic() - t0, quick=quick)
    lengths = response_lengths(workdir / "arm-A" / "generations", target, size.max_response) if "A" in records else []
    if lengths:
        med = statistics.median(lengths)
        p90 = sorted(lengths)[int(0.9 * (len(lengths) - 1))]
        summary["response_lengths"] = {"n": len(lengths), "median": med, "p90": p90,
                                       "p90_over_median": p90 / med if med else None, "cap": size.max_response,
                                       "share_at_cap": sum(x >= size.max_response for x in lengths) / len(lengths)}
    try:
        plot(records, workdir / "demo.png")
        summary["png"] = str(workdir / "demo.png")
    except ImportError:
        log.warning("matplotlib is not installed: no demo.png (pip install 'tlt[demo]')")
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    return summary


def arm_overrides(arm: str, workdir: Path, size: DemoSize, target: Path, drafter: Path, train: Path,
                  val: Path) -> list[str]:
    out = workdir / f"arm-{arm}"
    micro = max(1, size.batch * size.n // 4)
    return [
        f"data.train_files={train}", f"data.val_files={val}", f"data.train_batch_size={size.batch}",
        "data.max_prompt_length=64", f"data.max_response_length={size.max_response}", "data.seed=1",
        f"actor_rollout_ref.model.path={target}", f"actor_rollout_ref.rollout.n={size.n}",
        "actor_rollout_ref.rollout.seed=1", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.actor.optim.lr={size.actor_lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={size.batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}",
        "actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.actor.entropy_coeff=0",
        f"trainer.total_training_steps={size.steps}", "trainer.total_epochs=100",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
        f"trainer.default_local_dir={out}", f"trainer.rollout_data_dir={out / 'generations'}",
        f"trainer.experiment_name=tlt-demo-{arm}", "trainer.project_name=tlt",
        f"reward.custom_reward_function.path={Path(__file__).with_name('grpo_task.py')}",
        f"tlt.drafter.init_path={drafter}",
        *ARMS[arm][1],
    ]


def verl_command(overrides: list[str]) -> list[str]:
    """``python -m verl.trainer.main_ppo`` with the ``tlt_grpo_cpu`` config and these overrides."""
    return [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={configs_dir()}",
            "--config-name=tlt_grpo_cpu", *overrides]


def run_arm(arm: str, workdir: Path, size: DemoSize, target: Path, drafter: Path, train: Path, val: Path,
            progress: bool = True) -> list[dict]:
    """One verl GRPO run; returns its per-step TLT records. Raises RuntimeError on failure."""
    out = workdir / f"arm-{arm}"
    out.mkdir(parents=True, exist_ok=True)
    cmd = verl_command(arm_overrides(arm, workdir, size, target, drafter, train, val))
    (out / "command.txt").write_text(" ".join(cmd) + "\n")
    env = {**os.environ, "VERL_PLATFORM": "cpu", "PYTHONUNBUFFERED": "1"}
    log_path = out / "verl.log"
    t0 = time.monotonic()
    step_re = re.compile(r"step:(\d+) ")
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=out)
        seen = 0
        try:
            while proc.poll() is None:
                time.sleep(1.0)
                if time.monotonic() - t0 > size.timeout_s:
                    proc.kill()
                    raise RuntimeError(f"arm {arm}: verl did not finish within {size.timeout_s}s; see {log_path}")
                steps = [int(m.group(1)) for m in step_re.finditer(log_path.read_text(errors="replace"))]
                if steps and max(steps) > seen:
                    seen = max(steps)
                    if progress:
                        log.info("  arm %s: RL step %d/%d done (%.0fs)", arm, seen, size.steps,
                                 time.monotonic() - t0)
        finally:
            if proc.poll() is None:
                proc.kill()
    if proc.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"arm {arm}: verl exited with {proc.returncode}; see {log_path}\n{tail}")
    rec = out / "tlt_steps.jsonl"
    return [json.loads(x) for x in rec.read_text().splitlines()] if rec.is_file() else []


def speedup_limit(target: Path, drafter: Path, prompts: list[list[int]], depth: int = 4,
                  max_new: int = 96) -> dict:
    """Measured cost of a plain decode step vs a speculative step (draft ``depth`` + verify) on
    this machine, at the tail's batch sizes: the speedup ceiling is (tokens per verify) x ratio."""
    import torch

    from drafter.eagle import Drafter
    from rollout.eagle_proposer import EagleProposer
    from rollout.engine import EngineConfig, RolloutEngine
    from rollout.generate import SamplingParams
    from rollout.strategy import Arm
    from rollout.target import TargetModel

    model = TargetModel.from_pretrained(target)
    d = Drafter.load(drafter, model.embed_weight, model.lm_head.weight).eval()
    out = {}
    for b in (1, 4):
        ps = prompts[:b]
        max_len = max(map(len, ps)) + max_new + 1
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new)
        times = {}
        for name, arm in (("plain", None), ("spec", Arm(depth, 1, depth))):
            cfg = EngineConfig(max_batch=b, max_len=max_len, max_draft_tokens=16, arm=arm)
            prop = EagleProposer(d, max_batch=b, max_len=max_len + 32) if arm else None
            eng = RolloutEngine(model, cfg, proposer=prop)
            torch.manual_seed(0)
            res = eng.generate(ps, params)
            steps = [s.seconds for s in res.steps if s.batch == b][2:]
            times[name] = statistics.median(steps) if steps else float("nan")
        ratio = times["plain"] / times["spec"]
        out[f"batch{b}"] = {"plain_step_s": times["plain"], "spec_step_s": times["spec"],
                            "plain_over_spec_step": ratio, "ceiling_all_accepted": (depth + 1) * ratio}
    return out


def response_lengths(gen_dir: Path, target: Path, cap: int) -> list[int]:
    """Token lengths (+ eos) of the responses verl dumped (``trainer.rollout_data_dir``), all steps."""
    from tlt.tokenizer import TextTokenizer

    tok = TextTokenizer.from_pretrained(target)
    return [min(cap, len(tok.encode(json.loads(line)["output"])) + 1)
            for f in sorted(gen_dir.glob("*.jsonl")) for line in f.read_text().splitlines()]


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _pooled_accept(rows) -> float | None:
    """Tokens committed per verify over all the steps' verifies (a step with few verifies weighs
    little; one with none, whose per-step accept length is NaN, not at all)."""
    rows = list(rows)
    verifies = sum(r.get("tlt/spec_verifies", 0) for r in rows)
    return sum(r.get("tlt/spec_committed", 0) for r in rows) / verifies if verifies else None


def _total(key: str):
    """The summed ``key`` of some step records (a measure for :func:`_ratio`)."""
    return lambda rows: sum(r.get(key, 0.0) for r in rows)


def _ratio(num: dict[int, dict], den: dict[int, dict], steps, measure) -> float | None:
    """``measure`` (of a list of step records) of num's ``steps`` over den's."""
    a, b = measure([num[s] for s in steps]), measure([den[s] for s in steps])
    return a / b if a and b else None


def _step_interval(num: dict[int, dict], den: dict[int, dict], steps: list[int], measure,
                   draws: int = 2000) -> list[float] | None:
    """90% interval of :func:`_ratio` when the RL steps are resampled with replacement.

    The arms run the same prompts at the same step, so a step is resampled for both sides at once.
    This is the step-to-step variation inside one run only (the arms sample their own responses);
    runs on a shared machine spread further (docs/verl.md).
    """
    if len(steps) < 2:
        return None
    rng = random.Random(0)
    got = sorted(r for r in (_ratio(num, den, rng.choices(steps, k=len(steps)), measure)
                             for _ in range(draws)) if r is not None)
    if len(got) < draws // 2:  # most resamples have nothing to compare
        return None
    return [got[int(0.05 * (len(got) - 1))], got[int(0.95 * (len(got) - 1))]]


def summarize(records: dict[str, list[dict]], size: DemoSize) -> dict:
    by = {a: {r["step"]: r for r in recs} for a, recs in records.items()}
    steps = sorted(set.intersection(*(set(v) for v in by.values()))) if by else []
    later = [s for s in steps if s > 1]  # step 1 also pays verl's lazy agent-loop start
    out: dict = {"steps": len(steps), "arms": {a: ARMS[a][0] for a in records}}
    out["reward_mean_by_arm"] = {a: _mean(by[a][s].get("critic/score/mean") for s in steps) for a in by}
    out["reward_first_last_by_arm"] = {a: [by[a][steps[0]].get("critic/score/mean"),
                                           by[a][steps[-1]].get("critic/score/mean")] for a in by if steps}
    out["accept_length_by_arm"] = {a: _pooled_accept(by[a][s] for s in later) for a in by if a != "A"}
    if "B" in by and "C" in by:
        # Steps whose rollout used a spot-trained drafter: pushed at the end of an earlier step.
        adapted = [s for s in later if by["C"].get(s - 1, {}).get("tlt/drafter_version", 0) >= 1]
        out["accept_length_ratio_spot_vs_stale"] = _ratio(by["C"], by["B"], adapted, _pooled_accept)
        out["accept_length_ratio_ci90"] = _step_interval(by["C"], by["B"], adapted, _pooled_accept)
        out["accept_length_steps"] = adapted
        out["accept_length_verifies"] = {a: int(sum(by[a][s].get("tlt/spec_verifies", 0) for s in adapted))
                                         for a in "BC"}
        out["target_drift"] = _mean(by["C"][s].get("tlt/target_drift") for s in steps)
    if "A" in by and "C" in by and later:
        for key, name, ci_name in (
                ("tlt/rollout_s", "rollout_time_ratio_ar_over_tlt", "rollout_time_ratio_ci90_ar_over_tlt"),
                ("timing_s/step", "step_time_ratio_ar_over_tlt", "step_time_ratio_ci90_ar_over_tlt")):
            out[name] = _ratio(by["A"], by["C"], later, _total(key))
            out[ci_name] = _step_interval(by["A"], by["C"], later, _total(key))
        out["rollout_s_by_arm"] = {a: sum(by[a][s].get("tlt/rollout_s", 0.0) for s in later) for a in by}
    # The arms sample different responses: a rollout with longer ones takes longer whatever decodes it.
    out["response_length_mean_by_arm"] = {a: _mean(by[a][s].get("response_length/mean") for s in later)
                                          for a in by}
    return out


def plot(records: dict[str, list[dict]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for arm, recs in records.items():
        s = [r["step"] for r in recs]
        axes[0].plot(s, [r.get("critic/score/mean") for r in recs], marker="o", label=f"{arm}: {ARMS[arm][0]}")
        if arm != "A":
            axes[1].plot(s, [r.get("rollout/spec_accept_length") for r in recs], marker="o", label=arm)
        axes[2].plot(s, [r.get("timing_s/step") for r in recs], marker="o", label=arm)
    axes[0].set(xlabel="RL step", ylabel="reward (mean)", title="reward")
    axes[1].set(xlabel="RL step", ylabel="tokens committed per verify", title="accept length")
    axes[2].set(xlabel="RL step", ylabel="seconds", title="step time")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def summary_lines(s: dict) -> list[str]:
    def f(x, spec=".2f"):
        return "n/a" if x is None else format(x, spec)

    lines = [f"verl GRPO, {s['steps']} RL steps per arm: " + ", ".join(f"{a}) {v}" for a, v in s["arms"].items())]
    lines.append("reward mean  " + ", ".join(f"{a} {f(v, '.3f')}" for a, v in s["reward_mean_by_arm"].items()))
    if "accept_length_by_arm" in s:
        lines.append("accept len   " + ", ".join(f"{a} {f(v)}" for a, v in s["accept_length_by_arm"].items()))

    def ci(key):  # " (90% CI lo-hi over steps)", or nothing
        iv = s.get(key)
        return f" (90% CI {iv[0]:.2f}-{iv[1]:.2f} over steps)" if iv else ""

    if "accept_length_ratio_spot_vs_stale" in s:
        lines.append(f"spot vs stale accept length {f(s['accept_length_ratio_spot_vs_stale'])}x"
                     f"{ci('accept_length_ratio_ci90')} (target drift {f(s.get('target_drift'), '.3f')}; "
                     "verifies " + ", ".join(f"{a} {n}" for a, n in s.get("accept_length_verifies", {}).items())
                     + ")")
    if "rollout_time_ratio_ar_over_tlt" in s:
        lines.append(f"AR / TLT     rollout time {f(s['rollout_time_ratio_ar_over_tlt'])}x"
                     f"{ci('rollout_time_ratio_ci90_ar_over_tlt')}, step time "
                     f"{f(s['step_time_ratio_ar_over_tlt'])}x{ci('step_time_ratio_ci90_ar_over_tlt')}")
    if s.get("response_length_mean_by_arm"):
        lens = ", ".join(f"{a} {f(v, '.0f')}" for a, v in s["response_length_mean_by_arm"].items())
        lines.append(f"mean response {lens} tokens (steps 2+; each arm samples its own)")
    if "response_lengths" in s:
        r = s["response_lengths"]
        lines.append(f"responses    median {r['median']:.0f}, p90 {r['p90']} tokens (p90/median "
                     f"{f(r['p90_over_median'])}), {100 * r['share_at_cap']:.1f}% at the {r['cap']}-token cap")
    if "speedup_limit" in s:
        lim = s["speedup_limit"]
        lines.append("CPU ceiling  plain step / speculative step (depth 4): " + ", ".join(
            f"batch {k[5:]} {v['plain_over_spec_step']:.2f} (all accepted: {v['ceiling_all_accepted']:.2f}x)"
            for k, v in lim.items()))
    lines.append(f"done in {s['seconds']:.0f}s")
    return lines
