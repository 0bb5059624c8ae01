"""``tlt demo``: the main job — real verl 0.9.1 GRPO on this CPU, with and without TLT.

Owns the demo script: build (or reuse from cache) the trained target, write the arithmetic task
as verl parquet files, warm up an EAGLE drafter on the target's own (greedy, typical-style)
rollouts, export it for SGLang, then run verl's GRPO loop three times on the same seeds — A) no
speculation, B) TLT with the warm-up drafter frozen (stale), C) full TLT with spot training — each
as a separate ``python -m verl.trainer.main_ppo`` process with the ``tlt_grpo_cpu`` config, and
compare them (:mod:`tlt.demo.summary`) in ``summary.json`` and a PNG.

The default run is a scale model of reasoning RL on a GPU: a deep, narrow target (a verify costs
about one plain step on a CPU core, a drafter step about 1/L of one: ``tlt bench step-cost
--shape demo``), a task whose reward prefers a style the policy rarely writes at first (so the
policy really moves and a warm-up drafter goes stale), prompts that recur (two epochs) and a long
tail of response lengths. Coupled sampling makes the arms sample the same tokens, so their times
compare the same work.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tlt.drafter.export import export_drafter
from tlt.drafter.offline_train import TrainConfig
from tlt.demo.corpus import CorpusConfig, make_corpus
from tlt.demo.grpo_task import careful_lines, write_parquet
from tlt.demo.summary import ARM_LABELS, plot, summarize
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
    max_prompt: int = 128
    actor_lr: float = 2e-4
    kl_coef: float = 0.0       # > 0: verl's KL loss to the reference policy (low_var_kl) at this weight
    spot_nice: int = 0         # tlt.spot.nice: 19 makes training take only the CPU rollout does not want
    spot_lr: float = 1e-2      # a few spot steps per RL step must count
    spot_warmup: int = 4       # tlt.spot.warmup_steps: the first steps at 1e-2 would undo the warm-up drafter
    spot_tokens: int = 512     # tokens per spot micro-step: more steps in a short idle window
    timeout_s: int = 1500   # per arm

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps={self.steps}: use at least 1 RL step")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef={self.kl_coef}: use 0 (no KL loss) or a positive weight")


# The task's shape: a median of 6 steps with a lognormal tail; about one step line in seven in the
# careful style (the reward prefers it: the SFT policy rarely writes it, RL learns it).
DEMO_CORPUS = CorpusConfig(median_steps=6, max_steps=18, careful_share=0.15)
DEFAULT = DemoSize(target=TargetSpec(hidden_size=64, intermediate_size=176, num_layers=28, trained_layers=4,
                                     train_steps=300, grown_steps=10, corpus=DEMO_CORPUS),
                   prompts=32, batch=8, n=4, steps=8, max_response=320, warmup_steps=60, actor_lr=3e-4,
                   kl_coef=0.1,  # without the KL anchor the policy falls into "by step by step" loops by step 4
                   spot_nice=19)  # two shared cores: the scale model of a GPU the long tail left idle
# Quick: the untrained target writes to the 64-token cap on both replicas, so each step's idle window
# is a fraction of a second and one spot step fits it only sometimes; four steps make a run without
# any spot step (no drafter pushed) unlikely on a slow machine, at about a second per extra step.
QUICK = DemoSize(target=TargetSpec(hidden_size=64, num_layers=2, intermediate_size=128, train_steps=10,
                                   batch_size=4, seq_len=128, corpus=DEMO_CORPUS),
                 prompts=8, batch=4, n=2, steps=4, max_response=64, warmup_steps=5, timeout_s=600)

TAIL_BATCHING = ["tlt.tail.batching.enable=true", "tlt.tail.batching.prompt_factor=2.0",
                 "tlt.tail.batching.response_factor=1.5"]
ARMS = {  # arm -> verl overrides (D to H are not in the default run: `tlt demo --arms ACD` measures
    # the model-free drafter's contribution, `tlt demo --arms BCE` tail consolidation's: E is C without it)
    "A": ["tlt.speculation.enable=false", "tlt.drafter.train=false", "tlt.buffer.capture=off"],
    "B": ["tlt.drafter.train=false", "tlt.buffer.capture=off"],
    "C": ["tlt.tail.consolidate.mode=auto"],
    "D": ["tlt.speculation.suffix=false", "tlt.tail.consolidate.mode=auto"],
    "E": [],
    # F, G and H are A, C and B with RollPacker's tail batching: `tlt demo --arms ABCFGH` and
    # `tlt bench tail-batching --from OUT` compare them on the same seeds. Twice the prompts and 1.5x
    # the responses per short round, so that a 4-step epoch alternates short and long rounds
    "F": ["tlt.speculation.enable=false", "tlt.drafter.train=false", "tlt.buffer.capture=off", *TAIL_BATCHING],
    "G": ["tlt.tail.consolidate.mode=auto", *TAIL_BATCHING],
    "H": ["tlt.drafter.train=false", "tlt.buffer.capture=off", *TAIL_BATCHING],
}


def configs_dir() -> Path:
    import tlt.configs

    return Path(tlt.configs.__file__).parent


MARKER = ".tlt-demo"  # in a demo's directory: a later run may replace it
_DEMO_NAMES = {"train.parquet", "val.parquet", "prompts.jsonl", "drafter", "export-sglang", "demo.png", "summary.json"}


def _earlier_demo(workdir: Path) -> bool:
    """A directory a demo wrote, so replacing it loses nothing of the user's: its marker, or (a demo
    of a version before the marker) a finished demo's summary, drafter and arm runs, and nothing else."""
    names = {p.name for p in workdir.iterdir()}
    if MARKER in names:
        return True
    arms = [n for n in names if n.startswith("arm-") and len(n) == 5]
    return ({"summary.json", "drafter"} <= names and any((workdir / a / "command.txt").is_file() for a in arms)
            and names <= _DEMO_NAMES | set(arms))


def run_demo(workdir: Path, *, quick: bool = False, progress: bool = True, arms: str = "ABC",
             steps: int | None = None) -> dict:
    t0 = time.monotonic()
    workdir = Path(workdir).resolve()  # the verl runs start in the arm directories
    size = QUICK if quick else DEFAULT
    if steps is not None:
        size = dataclasses.replace(size, steps=steps)
    log.info("1/5 target: %s, %d training steps (cached after the first run)", size.target.family,
             size.target.train_steps)
    if workdir.exists() and not workdir.is_dir():
        raise ValueError(f"--out {workdir} is a file; give a directory")
    if workdir.exists() and any(workdir.iterdir()) and not _earlier_demo(workdir):
        raise ValueError(f"--out {workdir} is not empty and not an earlier demo's directory (it would be "
                         "replaced); choose a new one")
    target = ensure_target(size.target, progress=progress)
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    (workdir / MARKER).write_text("written by tlt demo: the next run into this directory replaces it\n")
    seed = size.target.seed + 1000  # held-out problems: a seed the target never trained on
    shape = size.target.corpus
    train = write_parquet(workdir / "train.parquet", size.prompts, seed, shape)
    val = write_parquet(workdir / "val.parquet", max(2, size.batch), seed + 1, shape)
    prompts = workdir / "prompts.jsonl"
    problems = make_corpus(size.prompts, dataclasses.replace(shape, seed=seed))
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p.prompt}]}) + "\n"
                               for p in problems))

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
        log.info("4/5 verl GRPO, arm %s (%s): %d steps [%d/%d]", arm, ARM_LABELS[arm], size.steps, i + 1, len(arms))
        records[arm] = run_arm(arm, workdir, size, target, workdir / "drafter", train, val, progress)

    log.info("5/5 summary (and the measured speedup ceiling of speculation on this CPU)")
    summary = summarize(records, {a: _jsonl(workdir / f"arm-{a}" / "tlt_responses.jsonl") for a in records})
    from tlt.tokenizer import TextTokenizer

    tok = TextTokenizer.from_pretrained(target)
    probe = [tok.chat_prompt([{"role": "user", "content": p.prompt}]) for p in problems[:4]]
    summary["speedup_limit"] = speedup_limit(target, workdir / "drafter", probe)
    summary.update(target=str(target), drafter_warmup=warm["trained"], export=export["out_dir"],
                   seconds=time.monotonic() - t0, quick=quick, machine=machine())
    lengths = response_lengths(workdir / "arm-A" / "generations", target, size.max_response) if "A" in records else []
    if lengths:
        med = statistics.median(lengths)
        p90 = sorted(lengths)[int(0.9 * (len(lengths) - 1))]
        summary["response_lengths"] = {"n": len(lengths), "median": med, "p90": p90,
                                       "p90_over_median": p90 / med if med else None, "cap": size.max_response,
                                       "share_at_cap": sum(x >= size.max_response for x in lengths) / len(lengths)}
        summary["careful_share_by_step"] = careful_shares(workdir / "arm-A" / "generations")
    try:
        plot(records, workdir / "demo.png")
        summary["png"] = str(workdir / "demo.png")
    except ImportError:
        log.warning("matplotlib is not installed: no demo.png (pip install 'tlt-rollout[demo]')")
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    return summary


def machine() -> dict:
    """The machine a run ran on: its CPU model (kernels round differently across CPUs, so a run's
    reward follows its CPU), core count, Python and torch."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
                    if ":" in line)
        info = {k.strip(): v.strip() for k, v in info.items()}
        cpu = f"{info['model name']} (family {info['cpu family']}, model {info['model']})"
    except (OSError, KeyError, ValueError):
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "processor": platform.machine(), "python": platform.python_version(),
            "torch": torch.__version__}


def arm_overrides(arm: str, workdir: Path, size: DemoSize, target: Path, drafter: Path, train: Path,
                  val: Path) -> list[str]:
    out = workdir / f"arm-{arm}"
    micro = max(1, size.batch * size.n // 2)  # one micro-batch per rank: fewer FSDP2 rounds over gloo
    return [
        f"data.train_files={train}", f"data.val_files={val}", f"data.train_batch_size={size.batch}",
        f"data.max_prompt_length={size.max_prompt}", f"data.max_response_length={size.max_response}", "data.seed=1",
        f"actor_rollout_ref.model.path={target}", f"actor_rollout_ref.rollout.n={size.n}",
        "actor_rollout_ref.rollout.seed=1", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.actor.optim.lr={size.actor_lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={size.batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.actor.use_kl_loss={str(size.kl_coef > 0).lower()}",
        f"actor_rollout_ref.actor.kl_loss_coef={size.kl_coef}",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
        f"trainer.total_training_steps={size.steps}", "trainer.total_epochs=100",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
        f"trainer.default_local_dir={out}", f"trainer.rollout_data_dir={out / 'generations'}",
        f"trainer.experiment_name=tlt-demo-{arm}", "trainer.project_name=tlt",
        f"reward.custom_reward_function.path={Path(__file__).with_name('grpo_task.py')}",
        f"tlt.drafter.init_path={drafter}", f"tlt.spot.lr={size.spot_lr}", f"tlt.spot.warmup_steps={size.spot_warmup}",
        f"tlt.spot.token_budget={size.spot_tokens}",
        f"tlt.spot.nice={size.spot_nice}",
        *ARMS[arm],
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
    return _jsonl(out / "tlt_steps.jsonl")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def speedup_limit(target: Path, drafter: Path, prompts: list[list[int]], depth: int = 4,
                  max_new: int = 96) -> dict:
    """Measured cost of a plain decode step vs a speculative step (draft ``depth`` + verify) on
    this machine, at the tail's batch sizes: the speedup ceiling is (tokens per verify) x ratio."""
    import torch

    from tlt.drafter.eagle import Drafter
    from tlt.rollout.eagle_proposer import EagleProposer
    from tlt.rollout.engine import EngineConfig, RolloutEngine
    from tlt.rollout.generate import SamplingParams
    from tlt.rollout.strategy import Arm
    from tlt.rollout.target import TargetModel

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


def careful_shares(gen_dir: Path) -> dict[int, float]:
    """Per RL step, the share of step lines in the careful style (the reward's) over the responses
    verl dumped: how far the policy has moved."""
    out = {}
    for f in sorted(gen_dir.glob("*.jsonl"), key=lambda f: int(f.stem)):
        counts = [careful_lines(json.loads(line)["output"]) for line in f.read_text().splitlines()]
        out[int(f.stem)] = sum(c for c, _ in counts) / max(1, sum(n for _, n in counts))
    return out


def response_lengths(gen_dir: Path, target: Path, cap: int) -> list[int]:
    """Token lengths (+ eos) of the responses verl dumped (``trainer.rollout_data_dir``), all steps."""
    from tlt.tokenizer import TextTokenizer

    tok = TextTokenizer.from_pretrained(target)
    return [min(cap, len(tok.encode(json.loads(line)["output"])) + 1)
            for f in sorted(gen_dir.glob("*.jsonl")) for line in f.read_text().splitlines()]


