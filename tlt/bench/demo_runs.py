"""``tlt bench demo``: what a set of ``tlt demo`` runs shows, by the arms they hold.

Owns the record README's results table reads (``docs/bench/demo_runs.json``) and the views of a
set of runs. ``--from DIR ...`` reads runs made before: each DIR is a ``tlt demo`` output
directory, and its figures are computed again from the arms' step and response records, with this
code, so every run is read the same way. Without ``--from`` it runs the default demo ``--repeats``
times (default 3) into a temporary directory. ``--add-to RECORD`` keeps an earlier main-job record's
runs (each with its own date and machine) before the new ones, and reads the figures across all of
them: a record grows over days, so its range shows what a user's single run may give on another day.

Each view reads the arms it compares, where every run holds them:
- the main job (arms A, B, C), per run and as mean, range and count across runs: rollout and RL
  step time AR / TLT (arm A over arm C), spot vs stale accept length (arm C over arm B), the share
  of responses token-identical between the arms, arm A's reward, last two steps over first two;
- tail consolidation (arms B, C, E): :mod:`tlt.bench.consolidation` (``tlt bench consolidation``
  is this view alone);
- tail batching (arms A and F; G against C and H against B where present), per run:
  :mod:`tlt.bench.tail_batching` (``tlt bench tail-batching`` is this view of one run, plotted).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import tempfile
from pathlib import Path

from tlt.demo.job import machine
from tlt.demo.summary import summarize
from tlt.sim.workloads import arm_lines

ARMS = "ABC"
KEYS = ("rollout_time_ratio_ar_over_tlt", "step_time_ratio_ar_over_tlt", "accept_length_ratio_spot_vs_stale",
        "reward_rise_a", "seconds")


def run_summary(run: Path, arms: str = ARMS) -> dict:
    """The demo's summary of one output directory, computed from its records."""
    records = {a: arm_lines(run, a, "tlt_steps.jsonl") for a in arms}
    responses = {a: arm_lines(run, a, "tlt_responses.jsonl") for a in arms
                 if (Path(run) / f"arm-{a}" / "tlt_responses.jsonl").is_file()}
    return summarize(records, responses)


def aggregate(runs: list[Path]) -> dict:
    per_run = []
    for run in runs:
        s = run_summary(run)
        written = run / "summary.json"  # the demo's own summary: its wall time, its CPU ceiling, when it ended
        done = json.loads(written.read_text()) if written.is_file() else {}
        same = s.get("identical_response_share") or {}
        per_run.append({"run": len(per_run) + 1, **{k: s.get(k) for k in KEYS if k != "seconds"},
                        "seconds": done.get("seconds"),
                        "identical_share_ab": (same.get("AB") or {}).get("share"),
                        "identical_share_ac": (same.get("AC") or {}).get("share"),
                        "responses_matched": (same.get("AC") or {}).get("matched"),
                        "rollout_time_ratio_ci90_ar_over_tlt": s.get("rollout_time_ratio_ci90_ar_over_tlt"),
                        # the machine's plain / speculative step cost in that run (the demo's CPU ceiling line)
                        "plain_over_spec_step": {k.removeprefix("batch"): v["plain_over_spec_step"]
                                                 for k, v in (done.get("speedup_limit") or {}).items()} or None,
                        "date": datetime.date.fromtimestamp((written if written.is_file() else run).stat().st_mtime)
                        .isoformat(),
                        # a run whose summary predates its machine field is taken as made on this one
                        "machine": done.get("machine") or machine()})
    return {"runs": per_run, "across_runs": across(per_run)}


def across(per_run: list[dict]) -> dict:
    """Mean, min, max and count of each figure over the runs that have it."""
    out = {}
    for k in (*KEYS, "identical_share_ab", "identical_share_ac"):
        vals = [r[k] for r in per_run if r.get(k) is not None]
        if vals:
            out[k] = {"mean": statistics.fmean(vals), "min": min(vals), "max": max(vals), "runs": len(vals)}
    return out


def check_earlier(earlier: dict, name: str) -> None:
    """``earlier`` is a main-job record this bench wrote."""
    if not isinstance(earlier, dict) or earlier.get("bench") != "demo" or not isinstance(earlier.get("runs"), list) \
            or earlier.get("views") != ["main job"]:
        raise ValueError(f"--add-to {name}: not a main-job record of `tlt bench demo` (bench 'demo', views "
                         "['main job']); name the record the README's table reads, docs/bench/demo_runs.json")


def add_to(earlier: dict, rec: dict, name: str) -> dict:
    """``rec`` (new main-job runs) after the runs of ``earlier`` (a record this bench wrote; ``name``
    its file, for errors), the figures read across all of them. A run the earlier record holds
    without its own date or machine gets the record's."""
    check_earlier(earlier, name)
    if rec["views"] != ["main job"]:
        raise ValueError(f"--add-to: the runs hold the views {rec['views']}; a main-job record takes `tlt demo` "
                         "runs of arms ABC only")
    if bool(earlier.get("quick")) != rec["quick"]:
        raise ValueError(f"--add-to {name}: its runs are {'quick' if earlier.get('quick') else 'full'} demos, "
                         f"these are {'quick' if rec['quick'] else 'full'}: a record compares one size")
    old = [{**r, "date": r.get("date") or earlier.get("date"), "machine": r.get("machine") or earlier.get("machine")}
           for r in earlier["runs"]]
    runs = [{**r, "run": i + 1} for i, r in enumerate(old + rec["runs"])]
    dates = sorted({r["date"] for r in runs if r.get("date")})
    merged = {**rec, "runs": runs, "across_runs": across(runs), "date": dates[-1], "dates": dates}
    merged["summary"] = [f"{len(runs)} `tlt demo` runs, arms ABC, {', '.join(dates)}: main job "
                         f"({len(old)} from {name})", *main_job_lines(merged)]
    return merged


VIEWS = {"main job": "ABC", "consolidation": "BCE", "tail batching": "AF"}  # view -> the arms it reads


def arms_of(run: Path) -> set[str]:
    """The arms a ``tlt demo`` output directory holds step records of."""
    return {p.name.removeprefix("arm-") for p in Path(run).glob("arm-*") if (p / "tlt_steps.jsonl").is_file()}


def main_job_lines(rec: dict) -> list[str]:
    names = {"rollout_time_ratio_ar_over_tlt": "rollout time AR / TLT", "step_time_ratio_ar_over_tlt":
             "RL step time AR / TLT", "accept_length_ratio_spot_vs_stale": "spot vs stale accept length",
             "reward_rise_a": "arm A reward, last two / first two steps", "seconds": "demo seconds",
             "identical_share_ab": "identical responses A-B", "identical_share_ac": "identical responses A-C"}
    return [f"  {names[k]}: mean {v['mean']:.2f}, range {v['min']:.2f}-{v['max']:.2f} over {v['runs']} runs"
            for k, v in rec["across_runs"].items()]


def views(runs: list[Path]) -> tuple[dict, list[str]]:
    """Every view whose arms all the runs hold: the record's fields (the main job's at the top, as
    the results table reads them; the others under their names) and the summary's lines."""
    from tlt.bench import consolidation, tail_batching

    if not runs:
        raise ValueError("--from: name at least one `tlt demo` output directory")
    common = set.intersection(*(arms_of(r) for r in runs))
    shown = [v for v, arms in VIEWS.items() if set(arms) <= common]
    if not shown:
        raise ValueError(f"--from: the runs hold arms {''.join(sorted(common)) or 'none'} in common; the demo "
                         "bench reads arms ABC (the main job: `tlt demo`), BCE (tail consolidation: `tlt demo "
                         "--arms BCE`) or A and F (tail batching: `tlt demo --arms ABCFGH`)")
    rec: dict = {"arms": "".join(sorted(common)), "views": shown}
    lines = [f"{len(runs)} `tlt demo` runs, arms {rec['arms']}: " + ", ".join(shown)]
    if "main job" in shown:
        rec.update(aggregate(runs))
        lines += main_job_lines(rec)
    if "consolidation" in shown:
        rec["consolidation"] = consolidation.aggregate(runs)
        lines += consolidation.lines(rec["consolidation"])
    if "tail batching" in shown:
        rec["tail_batching"] = [{"run": str(r), **tail_batching.compare(r)} for r in runs]
        lines += [line for tb in rec["tail_batching"] for line in [tb["run"], *tail_batching.lines(tb)]]
    return rec, lines


def run(args: argparse.Namespace) -> dict:
    from tlt.demo.job import run_demo

    runs = [Path(d) for d in (getattr(args, "runs_from", None) or [])]
    earlier = None
    if getattr(args, "add_to", None):  # read first: a run of the demo does not end on a bad record
        try:
            earlier = json.loads(Path(args.add_to).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--add-to {args.add_to}: cannot read it as a JSON record ({e})") from None
        check_earlier(earlier, args.add_to)
    if not runs:
        root = Path(tempfile.mkdtemp(prefix="tlt-demo-runs-"))
        for i in range(args.repeats or 3):
            run_demo(root / f"run-{i + 1}", quick=args.quick, progress=True, arms=ARMS)
            runs.append(root / f"run-{i + 1}")
    found, lines = views(runs)
    rec = {"bench": "demo", "quick": bool(args.quick), **found, "machine": machine(),
           "date": datetime.date.today().isoformat(),
           "command": (f"tlt demo{'' if found['arms'] == ARMS else ' --arms ' + found['arms']} (one per run), "
                       "aggregated by `tlt bench demo --from DIR ...`"),
           "summary": lines}
    if earlier:
        rec = add_to(earlier, rec, args.add_to)
        rec["command"] += f" --add-to {args.add_to}"
    return rec
