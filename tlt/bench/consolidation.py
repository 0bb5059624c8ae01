"""``tlt bench consolidation``: tail consolidation on vs off in the demo, over several paired runs.

Each run is ``tlt demo --arms BCE``: arm C is full TLT, tail consolidation included
(``tlt.tail.consolidate.mode=auto``), arm E is arm C without it, and arm B (the frozen drafter) is
the stale reference both arms' spot vs stale accept length is measured against. The arms sample the same tokens
(coupled sampling), so each RL step is a paired comparison. ``--from DIR ...`` aggregates runs made
before (their step and response records) instead of running the demo.

This is one view of ``tlt bench demo`` (:mod:`tlt.bench.demo_runs`), which shows it for any runs
holding these arms. The record gives, per run and pooled over the runs' steps (start-up step left out), with 90%
intervals from resampling steps: the rollout and step time ratios E / C (off / on), the
spot-training replica-seconds ratio C / E, each arm's spot vs stale accept length, the share of identical
responses and the requests moved per step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from tlt.bench.demo_runs import run_summary
from tlt.demo.step_ratios import over, pooled_accept, ratio_over_steps, serves_spot, step_interval, total
from tlt.sim.workloads import arm_lines

ARMS = "BCE"
KEYS = ("rollout_time_ratio_e_over_c", "step_time_ratio_e_over_c", "spot_training_ratio_c_over_e",
        "accept_length_ratio_spot_vs_stale", "accept_length_ratio_spot_vs_stale_e")


def _records(run: Path, arm: str) -> dict[int, dict]:
    return {r["step"]: r for r in arm_lines(run, arm, "tlt_steps.jsonl")}


def _train_s(rows) -> float:
    return sum(sum(r.get("replica_train_s") or []) for r in rows)


def pooled(runs: list[Path]) -> dict:
    """The paired ratios over every run's steps 2+ (a step of run i in E pairs with the same step
    of run i in C), with 90% intervals from resampling those (run, step) pairs."""
    by = {a: {} for a in ARMS}
    for i, run in enumerate(runs):
        for a in ARMS:
            by[a].update({(i, s): r for s, r in _records(run, a).items()})
    later = sorted(k for k in set(by["C"]) & set(by["E"]) & set(by["B"]) if k[1] > 1)

    def adapted(arm):  # steps whose rollout served a spot-trained drafter
        return [k for k in later if serves_spot(by[arm].get((k[0], k[1] - 1)))]

    out = {"steps": len(later)}
    for name, num, den, steps, ratio in (
            ("rollout_time_ratio_e_over_c", "E", "C", later, over(total("tlt/rollout_s"))),
            ("step_time_ratio_e_over_c", "E", "C", later, over(total("timing_s/step"))),
            ("spot_training_ratio_c_over_e", "C", "E", later, over(_train_s)),
            ("accept_length_ratio_spot_vs_stale", "C", "B", adapted("C"), over(pooled_accept)),
            ("accept_length_ratio_spot_vs_stale_e", "E", "B", adapted("E"), over(pooled_accept))):
        out[name] = ratio_over_steps(by[num], by[den], steps, ratio)
        out[f"{name}_ci90"] = step_interval(by[num], by[den], steps, ratio)
    out["spot_training_s_per_step"] = {a: _train_s([by[a][k] for k in later]) / len(later) for a in "CE"} \
        if later else {}
    out["moves_per_step_c"] = sum(by["C"][k].get("tlt/tail_moves", 0) for k in later) / len(later) if later else None
    return out


def aggregate(runs: list[Path]) -> dict:
    per_run = []
    for run in runs:
        s = run_summary(run, ARMS)  # computed again from the records, whatever an older demo labelled
        same = (s.get("identical_response_share") or {}).get("CE") or {}
        per_run.append({"run": run.name, "identical_share_c_e": same.get("share"), "matched": same.get("matched"),
                        **{k: s.get(k) for k in KEYS},
                        "rollout_time_ratio_ci90_e_over_c": s.get("rollout_time_ratio_ci90_e_over_c"),
                        "tail_moves_by_step_c": s.get("tail_moves_by_step_c")})
    spread = {}
    for k in KEYS:
        vals = [r[k] for r in per_run if r[k] is not None]
        if vals:
            spread[k] = {"mean": statistics.fmean(vals), "min": min(vals), "max": max(vals), "runs": len(vals)}
    return {"runs": per_run, "across_runs": spread, "pooled": pooled(runs)}


def lines(agg: dict) -> list[str]:
    """The summary of :func:`aggregate`'s record."""
    p = agg["pooled"]

    def ci(k):
        iv = p.get(f"{k}_ci90")
        return f" (90% CI {iv[0]:.2f}-{iv[1]:.2f})" if iv else ""

    def f(x):
        return "n/a" if x is None else f"{x:.2f}"

    same = [r["identical_share_c_e"] for r in agg["runs"]]
    out = [f"{len(agg['runs'])} paired runs (tlt demo --arms BCE), {p['steps']} RL steps pooled (steps 2+ of each)",
           "identical responses C vs E: " + ", ".join("n/a" if x is None else f"{100 * x:.1f}%" for x in same),
           f"rollout time E / C (off / on) {f(p['rollout_time_ratio_e_over_c'])}x"
           f"{ci('rollout_time_ratio_e_over_c')}; step time {f(p['step_time_ratio_e_over_c'])}x"
           f"{ci('step_time_ratio_e_over_c')}"]
    train = p.get("spot_training_s_per_step") or {}
    out.append(f"spot-training replica-seconds per RL step C {f(train.get('C'))}, E {f(train.get('E'))}: C / E "
               f"{f(p['spot_training_ratio_c_over_e'])}x{ci('spot_training_ratio_c_over_e')}; requests moved "
               f"per step (C) {f(p['moves_per_step_c'])}")
    out.append(f"spot vs stale accept length: C {f(p['accept_length_ratio_spot_vs_stale'])}x"
               f"{ci('accept_length_ratio_spot_vs_stale')}, E {f(p['accept_length_ratio_spot_vs_stale_e'])}x"
               f"{ci('accept_length_ratio_spot_vs_stale_e')}")
    for k, v in agg["across_runs"].items():
        out.append(f"  {k}: mean {v['mean']:.2f}, range {v['min']:.2f}-{v['max']:.2f} over {v['runs']} runs")
    return out


def run(args: argparse.Namespace) -> dict:
    from tlt.demo.job import run_demo

    runs = [Path(d) for d in (getattr(args, "runs_from", None) or [])]
    if not runs:
        n = args.repeats or 3
        root = Path(tempfile.mkdtemp(prefix="tlt-consolidation-"))
        for i in range(n):
            run_demo(root / f"run-{i + 1}", quick=args.quick, progress=True, arms=ARMS)
            runs.append(root / f"run-{i + 1}")
    rec = {"bench": "consolidation", "quick": bool(args.quick), **aggregate(runs)}
    rec["summary"] = lines(rec)
    return rec
