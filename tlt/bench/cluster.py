"""``tlt bench cluster``: rollout systems side by side in the tail at 8, 64 and 256 replicas (simulated).

Owns the bench's record and plot. For each set of step-cost curves (bench records in docs/bench/,
each named with what it measured), each cluster scale of :data:`tlt.sim.workloads.SCALES` and each
system of :mod:`tlt.sim.systems`, it simulates RL steps on the same response lengths and writes:
the rollout seconds per step, the GPU-seconds idle, the replica-seconds left for drafter training,
the share of tokens thrown away (RollPacker's aborts), and which system is fastest at each scale with
its speedup over TLT alone. ``--lengths DIR`` takes a ``tlt demo`` run's recorded lengths (scaled to
each scale's maximum length) instead of the reasoning profile.

``--measure-cpu`` first measures this machine's curve (``tlt bench rollout``, one repeat, written
beside the JSON record as ``*_cpu_curve.json``) and simulates the CPU row on it instead of the
recorded ``rollout.json``; ``--cpu-curve`` takes such a curve measured earlier.

``--validate --from FIT PREDICT`` instead predicts one ``tlt demo`` run's per-step rollout time
from another run's recorded step costs (:func:`validate`) and reports the error.

The GPU curves come in pairs: the engine before the device-resident step (``*_eager_draft``, batches
1-32) and after it (the Llama-8B shape: batches 1-256). The Llama-8B rows take their accept lengths from the demo target's trained drafter on the
same GPU (``rollout_gpu.json``), capped at what the step-cost chain (depth 4) can commit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import random
import statistics
import tempfile
from pathlib import Path

from tlt.bench import pyplot
from tlt.coordinator.consolidation import StepCurve, ConsolidationConfig
from tlt.sim.systems import (
    SYSTEMS,
    Knobs,
    StepOutcome,
    rollpacker_rounds,
    run_rollpacker,
    run_step,
    consolidator,
)
from tlt.sim.rollout import Request, Speed, simulate
from tlt.sim.workloads import (
    SCALES,
    AcceptModel,
    arm_lines,
    reasoning_lengths,
    recorded_lengths,
    speeds_from_record,
)

log = logging.getLogger(__name__)


def _records() -> Path:
    """docs/bench/ of a checkout, or its curve records installed from a wheel as ``tlt.records``."""
    here = Path(__file__).resolve().parents[2] / "docs" / "bench"
    return here if here.is_dir() else Path(__file__).resolve().parents[1] / "records"


BENCH = _records()
CHAIN_MAX = 5.0  # a depth-4 chain commits at most 5 tokens per verify


def curve_sets(cpu: Path | None = None) -> dict[str, tuple[Path, bool]]:
    """name -> (record, take the accept lengths from the demo target's GPU rollout record).
    ``cpu``: this machine's rollout record, measured by this run (default: the recorded one)."""
    return {
        "CPU, demo target": (cpu or BENCH / "rollout.json", False),
        "H200, demo target, eager draft": (BENCH / "rollout_gpu_eager_draft.json", False),
        "H200, demo target, device step": (BENCH / "rollout_gpu.json", False),
        "H200, Llama-8B shape, eager draft": (BENCH / "step_cost_llama8b_gpu_eager_draft.json", True),
        "H200, Llama-8B shape, device step": (BENCH / "step_cost_llama8b_curve_gpu.json", True),
    }


def measure_cpu(args: argparse.Namespace, out: Path) -> Path:
    """This machine's step-cost curve: ``tlt bench rollout`` (one repeat) run here, written to ``out``."""
    from tlt.bench import rollout

    log.info("measuring this machine's step costs by batch (tlt bench rollout --repeats 1)")
    rec = rollout.run(argparse.Namespace(quick=bool(args.quick), seed=args.seed, repeats=1, threads=1))
    out.write_text(json.dumps(rec, indent=2))
    return out


def _accept_from_gpu_rollout() -> AcceptModel:
    rec = json.loads((BENCH / "rollout_gpu.json").read_text())
    return AcceptModel(tuple(sorted((int(b), min(CHAIN_MAX, float(v["mean_accept_length"])))
                                    for b, v in rec["by_batch"].items())))


def _mean(outs: list[StepOutcome]) -> dict:
    n = len(outs)
    tokens = sum(o.tokens for o in outs)
    return {"rollout_s": sum(o.rollout_s for o in outs) / n, "idle_s": sum(o.idle_s for o in outs) / n,
            "train_s": sum(o.train_s for o in outs) / n, "wasted_share": sum(o.wasted_tokens for o in outs) / tokens
            if tokens else 0.0, "moves": sum(o.moves for o in outs) / n, "steps": n,
            "tp": max(o.switched_tp for o in outs)}


def _prompts(scale, steps: int, seed: int, recorded: list[int] | None, per_prompt: int) -> list[list[float]]:
    """``steps`` steps' worth of prompts, each with ``per_prompt`` responses' lengths (RollPacker's
    extra responses; the other systems run the first ``scale.responses``)."""
    n = scale.prompts * steps
    if recorded:  # a demo run's lengths, scaled to this scale's maximum
        top = max(recorded)
        pool = [max(1, round(x * scale.max_len / top)) for x in recorded]
        rng = random.Random(seed)
        return [[rng.choice(pool) for _ in range(per_prompt)] for _ in range(n)]
    flat = reasoning_lengths(n * per_prompt, scale.max_len, seed=seed)
    return [flat[i * per_prompt:(i + 1) * per_prompt] for i in range(n)]


def simulate_scale(name: str, record: Path, gpu_accept: bool, scale, steps: int, knobs: Knobs, seed: int,
                   recorded: list[int] | None) -> dict:
    plain, spec = speeds_from_record(record, _accept_from_gpu_rollout() if gpu_accept else None)
    # BS_max: the largest batch the curves measured (past it a step's cost grows in proportion to the
    # batch, so no system gains from batches no engine ran)
    knobs = dataclasses.replace(knobs, max_batch=max(b for b, _ in plain.plain.points))
    rounds = rollpacker_rounds(steps, scale.prompts, knobs.prompt_over)  # RollPacker: whole cycles of rounds
    prompts = _prompts(scale, max(steps, rounds), seed, recorded, math.ceil(scale.responses * (1 + knobs.response_over)))
    per_step = [prompts[s * scale.prompts:(s + 1) * scale.prompts] for s in range(steps)]
    rows = {}
    for system in SYSTEMS:
        if system.endswith("rollpacker"):
            speed = spec if system.startswith("tlt") else plain
            # whole cycles of rounds over the same prompts (the other systems' steps first): short
            # rounds and the long rounds they feed
            outs = run_rollpacker(prompts[:rounds * scale.prompts], speed, scale.replicas, knobs, p0=scale.prompts,
                                  r0=scale.responses)
        else:
            outs = []
            for s, ps in enumerate(per_step):
                reqs = [Request(f"s{s}p{i}r{j}", ln, group=i) for i, p in enumerate(ps)
                        for j, ln in enumerate(p[:scale.responses])]
                outs.append(run_step(system, reqs, plain, spec, scale.replicas, knobs))
        rows[system] = _mean(outs)
        log.debug("%s, %d replicas, %s: %.1f s per step", name, scale.replicas, system, rows[system]["rollout_s"])
    tlt = rows["tlt"]["rollout_s"]
    best = min(rows, key=lambda p: rows[p]["rollout_s"])
    return {"replicas": scale.replicas, "prompts": scale.prompts, "responses": scale.responses,
            "max_len": scale.max_len, "source": scale.source, "systems": rows, "fastest": best,
            "fastest_over_tlt": tlt / rows[best]["rollout_s"]}


def fitted_speeds(recs: list[dict]) -> list[Speed]:
    """Each replica's seconds per committed token per request, by batch, pooled over steps 2+ of a
    run (its engine steps as the step records hold them: speculation and accept length folded in)."""
    pooled: dict[int, dict[int, list[float]]] = {}
    for r in recs:
        if r["step"] < 2:
            continue
        for rank, cost in enumerate(r.get("replica_step_cost") or []):
            for b, (sec, _, committed) in cost.items():
                c = pooled.setdefault(rank, {}).setdefault(int(b), [0.0, 0.0])
                c[0], c[1] = c[0] + sec, c[1] + committed
    if not pooled:
        raise ValueError("the run's step records hold no replica_step_cost (recorded since this bench existed)")
    return [Speed(StepCurve(tuple((b, sec * b / tok) for b, (sec, tok) in sorted(by.items()) if tok > 0)))
            for _, by in sorted(pooled.items())]


def validate(fit: Path, predict: Path, arms: str = "AC") -> dict:
    """Predict ``predict``'s per-step rollout time (steps 2+) from ``fit``'s step costs and move cost,
    and ``predict``'s own response lengths; nothing is fitted on the run predicted. The driver's
    time outside decoding (requests arriving, the last answers returning) is ``fit``'s median."""
    out = {}
    for arm in arms:
        recs_fit, recs_pred = arm_lines(fit, arm, "tlt_steps.jsonl"), arm_lines(predict, arm, "tlt_steps.jsonl")
        speeds = fitted_speeds(recs_fit)
        later = [r for r in recs_fit if r["step"] >= 2]
        overhead = statistics.median(min(r["replica_lead_s"]) + min(r["replica_trail_s"]) for r in later)
        moves = [r["tail"]["move_s"] for r in later if (r.get("tail") or {}).get("move_s")]
        lengths = recorded_responses(predict, arm)
        rows = []
        for r in recs_pred:
            if r["step"] < 2 or r["step"] not in lengths:
                continue
            reqs = [Request(f"i{i}s{j}", n, group=i) for (i, j), n in sorted(lengths[r["step"]].items())]
            if moves:  # the arm consolidated its tail (tlt.tail.consolidate.mode=auto)
                cfg = ConsolidationConfig(mode="auto", move_s=statistics.median(moves), max_batch=len(reqs))
                res = simulate(reqs, speeds, consolidation=consolidator(cfg), tick_s=0.1, move_s=cfg.move_s)
            else:
                res = simulate(reqs, speeds)
            predicted = res.seconds + overhead
            rows.append({"step": r["step"], "predicted_s": predicted, "measured_s": r["tlt/rollout_s"],
                         "error": predicted / r["tlt/rollout_s"] - 1})
        errs = [abs(x["error"]) for x in rows]
        out[arm] = {"steps": rows, "median_abs_error": statistics.median(errs) if errs else None,
                    "median_error": statistics.median(x["error"] for x in rows) if rows else None,
                    "overhead_s": overhead}
    return out


def recorded_responses(run: Path, arm: str) -> dict[int, dict[tuple[int, int], int]]:
    """A demo run's response lengths by step, keyed by (prompt index, sample index)."""
    out: dict[int, dict[tuple[int, int], int]] = {}
    for rec in arm_lines(run, arm, "tlt_responses.jsonl"):
        out.setdefault(rec["step"], {})[(rec["index"], rec["sample"])] = rec["length"]
    return out


def run(args: argparse.Namespace) -> dict:
    if getattr(args, "validate", False):
        runs = getattr(args, "runs_from", None) or []
        if len(runs) != 2:
            raise ValueError("--validate takes --from FIT_RUN PREDICT_RUN (two `tlt demo` output directories)")
        val = validate(Path(runs[0]), Path(runs[1]))
        lines = [(f"held-out validation: step costs from {Path(runs[0]).name}, lengths and measured rollout times "
                  f"from {Path(runs[1]).name} (steps 2+)")]
        for arm, v in val.items():
            per = ", ".join(f"{x['step']}: {x['predicted_s']:.2f}/{x['measured_s']:.2f}s" for x in v["steps"])
            lines.append(f"  arm {arm}: median |error| {100 * v['median_abs_error']:.0f}%, median error "
                         f"{100 * v['median_error']:+.0f}% (predicted/measured by step {per})")
        return {"bench": "cluster", "validation": val, "summary": lines}
    quick = bool(args.quick)
    steps = args.repeats or (1 if quick else 4)
    scales = [SCALES[8]] if quick else list(SCALES.values())
    knobs = Knobs()
    recorded = None
    if getattr(args, "runs_from", None):
        recorded = [n for run in args.runs_from for ls in recorded_lengths(Path(run)).values() for n in ls]
    cpu = Path(args.cpu_curve) if getattr(args, "cpu_curve", None) else None
    if cpu is not None and getattr(args, "measure_cpu", False):
        raise ValueError("--cpu-curve and --measure-cpu both give the CPU row's curve: pass one")
    if cpu is not None and not cpu.is_file():
        raise ValueError(f"--cpu-curve {cpu}: no such file (--measure-cpu --json X.json writes X_cpu_curve.json)")
    if getattr(args, "measure_cpu", False):
        where = Path(args.json).with_name(Path(args.json).stem + "_cpu_curve.json") if getattr(args, "json", None) \
            else Path(tempfile.mkdtemp(prefix="tlt-cluster-")) / "cpu_curve.json"
        cpu = measure_cpu(args, where)
    sets = curve_sets(cpu)
    if quick:
        keep = "CPU" if cpu else "Llama-8B shape, device step"
        sets = {k: v for k, v in sets.items() if keep in k}
    out = {}
    for name, (record, gpu_accept) in sets.items():
        out[name] = {str(s.replicas): simulate_scale(name, record, gpu_accept, s, steps, knobs, args.seed, recorded)
                     for s in scales}
    rec = {"bench": "cluster", "quick": quick, "steps": steps, "lengths": "recorded" if recorded else "reasoning profile",
           "knobs": knobs.__dict__, "curves": {k: str(v[0].name) for k, v in sets.items()},
           "cpu_curve_measured_here": bool(getattr(args, "measure_cpu", False)), "results": out}
    lines = [(f"rollout systems, simulated: {steps} RL steps per system, lengths from the {rec['lengths']}; rollout "
              "seconds per step (train: replica-seconds free for drafter training per step)")]
    for name, by in out.items():
        lines.append(f"{name}:")
        for n, r in by.items():
            rows = r["systems"]
            base = rows["plain"]["rollout_s"]
            cells = ", ".join(f"{p} {rows[p]['rollout_s']:.0f}s ({base / rows[p]['rollout_s']:.2f}x, train "
                              f"{rows[p]['train_s']:.0f})" for p in SYSTEMS)
            lines.append(f"  {n} replicas: {cells}")
            lines.append(f"  {n} replicas: fastest {r['fastest']}, {r['fastest_over_tlt']:.2f}x over TLT alone")
    rec["summary"] = lines
    if getattr(args, "json", None):
        _plot(rec, Path(args.json).with_suffix(".png"))
    return rec


def _plot(rec: dict, path: Path) -> None:
    """Rollout speedup over plain decoding per system and scale, for the headline curves."""
    plt = pyplot(path)
    if plt is None:
        return
    name = next((k for k in rec["results"] if "Llama-8B shape, device step" in k), next(iter(rec["results"])))
    by = rec["results"][name]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(by)
    for i, (n, r) in enumerate(by.items()):
        base = r["systems"]["plain"]["rollout_s"]
        xs = [j + i * width for j in range(len(SYSTEMS))]
        ax.bar(xs, [base / r["systems"][p]["rollout_s"] for p in SYSTEMS], width, label=f"{n} replicas")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(SYSTEMS))], SYSTEMS, rotation=20)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("rollout speedup over plain decoding")
    ax.set_title(f"tlt bench cluster (simulated): {name}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    rec["plot"] = path.name
    log.info("wrote %s", path)
