"""``tlt bench tail-batching --from DIR``: RollPacker's tail batching in the trainer, against the default.

Owns the record of one ``tlt demo --arms ABCFGH`` run (``docs/bench/tail_batching.json``) and its
plot: arms F, G and H are arms A, C and B with ``tlt.tail.batching.enable=true``, on the same
seeds. From the arms' step and response records:

- rollout seconds per step, by round (short, long; the flush at an epoch's end runs like a long
  round), and step time, each arm against its default;
- the share of generated tokens dropped (partial responses of dropped requests) and thrown away
  (those plus finished responses a short round did not keep);
- kept vs launched response lengths: what short rounds kept, what they finished and did not keep,
  what long rounds trained, and what the default arm trained (the whole distribution);
- spot-training replica-seconds per step (G against C) and the spot vs stale accept length with
  and without tail batching (C over B, G over H);
- the reward curve of arm F against arm A's.

Ratios of totals over steps 2+ (step 1 also pays verl's lazy start) with a bootstrap 90% interval
over steps, computed by the demo's own summary code (:func:`tlt.demo.summary.summarize`). This is
one view of ``tlt bench demo`` (:mod:`tlt.bench.demo_runs`), which shows it for every run holding
arms A and F.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
from pathlib import Path

from tlt.bench import pyplot
from tlt.demo.summary import summarize
from tlt.sim.workloads import arm_lines

PAIRS = {"F": "A", "G": "C", "H": "B"}  # tail batching arm -> its default


def _dist(xs: list[int]) -> dict | None:
    if not xs:
        return None
    s = sorted(xs)
    return {"n": len(s), "mean": statistics.fmean(s), "median": statistics.median(s),
            "p90": s[int(0.9 * (len(s) - 1))], "max": s[-1]}


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None  # None: a run of one step has no step 2+


def arm_figures(steps: list[dict], responses: list[dict]) -> dict:
    """One tail batching arm: rounds, tokens, lengths."""
    trained_len: dict[int, list[int]] = {}
    for r in responses:
        trained_len.setdefault(int(r["step"]), []).append(int(r["length"]))
    by_kind: dict[str, list[float]] = {}
    kept, unkept, partial, long_len = [], [], [], []
    tokens = dropped = thrown = 0
    rounds = {}
    for rec in steps:
        tb, s = rec.get("tail_batching") or {}, int(rec["step"])
        kind = tb.get("round", "?")
        rounds[s] = kind
        if s == 1:  # every figure but the round map is over steps 2+, as the default arm's
            continue
        by_kind.setdefault(kind, []).append(float(rec.get("tlt/rollout_s", 0.0)))
        if kind == "short":
            kept += tb["kept_lengths"]
            unkept += tb["finished_not_kept_lengths"]
            partial += tb["dropped_partial_lengths"]
            tokens += tb["tokens"]
            dropped += tb["dropped_tokens"]
            thrown += tb["thrown_away_tokens"]
        else:
            long_len += trained_len.get(s, [])
            tokens += sum(trained_len.get(s, []))
    return {"rounds": rounds, "rollout_s_by_round": {k: {"mean": statistics.fmean(v), "steps": len(v)}
                                                     for k, v in by_kind.items()},
            "tokens": tokens, "dropped_share": dropped / tokens if tokens else None,
            "thrown_away_share": thrown / tokens if tokens else None,
            "lengths": {"short_kept": _dist(kept), "short_finished_not_kept": _dist(unkept),
                        "short_dropped_partial": _dist(partial), "long_trained": _dist(long_len)}}


def compare(run: Path) -> dict:
    arms = [a for a in "ABCFGH" if (Path(run) / f"arm-{a}" / "tlt_steps.jsonl").is_file()]
    missing = [a for a in "AF" if a not in arms]
    if missing:
        raise ValueError(f"{run}: arms {''.join(missing)} missing; run `tlt demo --arms ABCFGH --out {run}` first")
    steps = {a: arm_lines(run, a, "tlt_steps.jsonl") for a in arms}
    responses = {a: arm_lines(run, a, "tlt_responses.jsonl") for a in arms}
    out: dict = {"arms": arms, "by_arm": {}, "vs_default": {}}
    for tb, base in PAIRS.items():
        if tb not in arms or base not in arms:
            continue
        fig = arm_figures(steps[tb], responses[tb])
        fig["default_trained_lengths"] = _dist([int(r["length"]) for r in responses[base] if r["step"] > 1])
        # the summary's AR-over-TLT ratios, read as default over tail batching
        s = summarize({"A": steps[base], "C": steps[tb]})
        fig["rollout_time_ratio_default_over_tb"] = s.get("rollout_time_ratio_ar_over_tlt")
        fig["rollout_time_ratio_ci90"] = s.get("rollout_time_ratio_ci90_ar_over_tlt")
        fig["step_time_ratio_default_over_tb"] = s.get("step_time_ratio_ar_over_tlt")
        fig["step_time_ratio_ci90"] = s.get("step_time_ratio_ci90_ar_over_tlt")
        fig["reward_by_step"] = {a: {int(r["step"]): r.get("critic/score/mean") for r in steps[a]} for a in (base, tb)}
        fig["rollout_s_by_step"] = {a: {int(r["step"]): r.get("tlt/rollout_s") for r in steps[a]} for a in (base, tb)}
        train = {a: _mean([sum(r.get("replica_train_s") or []) for r in steps[a] if r["step"] > 1])
                 for a in (base, tb)}
        fig["spot_train_s_per_step"] = train
        out["by_arm"][tb] = fig
    for default, pair in (("BC", ("B", "C")), ("HG", ("H", "G"))):
        if all(a in arms for a in pair):
            s = summarize({"B": steps[pair[0]], "C": steps[pair[1]]})
            out["vs_default"][f"spot_vs_stale_{default}"] = {
                "ratio": s.get("accept_length_ratio_spot_vs_stale"), "ci90": s.get("accept_length_ratio_ci90"),
                "steps": s.get("accept_length_steps")}
    return out


def _fmt(x, spec=".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def lines(rec: dict) -> list[str]:
    out = [f"tail batching vs default, one `tlt demo --arms {''.join(rec['arms'])}` run (steps 2+)"]
    for tb, fig in rec["by_arm"].items():
        base = PAIRS[tb]
        rs = fig["rollout_s_by_round"]
        ci = fig.get("rollout_time_ratio_ci90") or [None, None]
        out.append(f"  {tb} vs {base}: rollout time {base}/{tb} {_fmt(fig['rollout_time_ratio_default_over_tb'])}x "
                   f"(90% CI {_fmt(ci[0])}-{_fmt(ci[1])}), step time {_fmt(fig['step_time_ratio_default_over_tb'])}x; "
                   "rollout s per round " + ", ".join(f"{k} {v['mean']:.1f} ({v['steps']})" for k, v in rs.items()))
        ln = fig["lengths"]
        out.append(f"    tokens dropped {_fmt(fig['dropped_share'], '.0%')}, thrown away "
                   f"{_fmt(fig['thrown_away_share'], '.0%')}; median length kept "
                   f"{_fmt((ln['short_kept'] or {}).get('median'), '.0f')}, finished not kept "
                   f"{_fmt((ln['short_finished_not_kept'] or {}).get('median'), '.0f')}, long rounds "
                   f"{_fmt((ln['long_trained'] or {}).get('median'), '.0f')}, default "
                   f"{_fmt((fig['default_trained_lengths'] or {}).get('median'), '.0f')}")
        tr = fig["spot_train_s_per_step"]
        out.append(f"    spot-training replica-s per step {_fmt(tr[base], '.1f')} ({base}) vs {_fmt(tr[tb], '.1f')} ({tb})")
    for k, v in rec["vs_default"].items():
        ci = v.get("ci90") or [None, None]
        out.append(f"  {k}: {_fmt(v['ratio'])}x (90% CI {_fmt(ci[0])}-{_fmt(ci[1])})")
    return out


def run(args: argparse.Namespace) -> dict:
    runs = getattr(args, "runs_from", None) or []
    if len(runs) != 1:
        raise ValueError("tail-batching: give one `tlt demo --arms ABCFGH` output directory: --from DIR")
    rec = {"bench": "tail-batching", **compare(Path(runs[0])),
           "machine": {"cpus": os.cpu_count(), "processor": platform.machine(), "python": platform.python_version()},
           "date": datetime.date.today().isoformat(),
           "command": "tlt demo --arms ABCFGH --out DIR; tlt bench tail-batching --from DIR"}
    rec["summary"] = lines(rec)
    if getattr(args, "json", None):
        _plot(rec, Path(args.json).with_suffix(".png"))
    return rec


def _plot(rec: dict, path: Path) -> None:
    """Rollout seconds per step (short rounds marked) and the reward, each arm against its default."""
    plt = pyplot(path)
    if plt is None:
        return
    from tlt.demo.summary import ARM_LABELS, COLOURS

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for tb, f in rec["by_arm"].items():
        for arm, series in f["rollout_s_by_step"].items():
            xs = sorted(x for x in series if int(x) > 1)  # step 1 also pays verl's start-up
            style = "--" if arm == tb else "-"
            ax1.plot(xs, [series[x] for x in xs], style, color=COLOURS[arm], label=f"{arm}: {ARM_LABELS[arm]}")
            if arm == tb:
                short = [x for x in xs if f["rounds"].get(x) == "short"]
                ax1.plot(short, [series[x] for x in short], "o", color=COLOURS[arm])
        if tb == "F":
            for arm, series in f["reward_by_step"].items():
                xs = sorted(series)
                ax2.plot(xs, [series[x] for x in xs], "--" if arm == tb else "-", color=COLOURS[arm],
                         label=f"{arm}: {ARM_LABELS[arm]}")
    ax1.set(xlabel="RL step", ylabel="rollout seconds", title="rollout per step, steps 2+ (dots: short rounds)")
    ax2.set(xlabel="RL step", ylabel="mean reward", title="reward: no speculation, with and without")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    rec["plot"] = path.name
