"""Ratios between arms of step records, as ``tlt demo`` and the benches that read its runs compute them.

Owns the measures of a list of per-step records (``tlt_steps.jsonl`` rows: accept length pooled over
verifies, the EAGLE drafter's alone, a summed key), the ratio of a measure between two arms over the
same RL steps, and its 90% interval from resampling those steps for both arms at once; and the
one bootstrap interval routine the demo and the benches use (:func:`bootstrap_ci90`). Pure: no
files, no plots (``tlt.demo.summary`` reads the runs and prints).
"""

from __future__ import annotations

import random
import statistics


def serves_spot(rec: dict | None) -> bool:
    """Whether the drafter served after this step record's step is a spot-trained one: its spot step
    (records before that key: any drafter version above the warm-up's, which a guard's rollback to
    the warm-up drafter also raises)."""
    rec = rec or {}
    return rec.get("tlt/drafter_spot_step", rec.get("tlt/drafter_version", 0)) >= 1


def mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def pooled_accept(rows) -> float | None:
    """Tokens committed per verify over all the steps' verifies (a step with few verifies weighs
    little; one with none, whose per-step accept length is NaN, not at all)."""
    rows = list(rows)
    verifies = sum(r.get("tlt/spec_verifies", 0) for r in rows)
    return sum(r.get("tlt/spec_committed", 0) for r in rows) / verifies if verifies else None


def per_arm(rows) -> dict[str, list[float]]:
    """EAGLE-drafted arms (strategies) -> [tokens committed, verifies], pooled over step records."""
    out: dict[str, list[float]] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("tlt/arm_verifies/") and not k.endswith("@suffix"):
                arm = k.removeprefix("tlt/arm_verifies/")
                c = out.setdefault(arm, [0.0, 0.0])
                c[0] += r.get(f"tlt/arm_committed/{arm}", 0.0)
                c[1] += v
    return out


def eagle_accept(rows) -> float | None:
    """Tokens committed per verify over the verifies the EAGLE drafter drafted (suffix arms left out)."""
    arms = per_arm(rows).values()
    verifies = sum(v for _, v in arms)
    return sum(c for c, _ in arms) / verifies if verifies else None


def same_strategy_ratio(num_rows, den_rows) -> float | None:
    """EAGLE accept length of num over den at the same strategies: per arm both arms verified, each
    arm's accept length weighted by its verifies in both (the tuners' different depth choices cancel)."""
    a, b = per_arm(num_rows), per_arm(den_rows)
    common = [k for k in a if k in b and a[k][1] and b[k][1]]
    num = sum((a[k][1] + b[k][1]) * a[k][0] / a[k][1] for k in common)
    den = sum((a[k][1] + b[k][1]) * b[k][0] / b[k][1] for k in common)
    return num / den if den else None


def total(key: str):
    """The summed ``key`` of some step records (a measure for :func:`over`)."""
    return lambda rows: sum(r.get(key, 0.0) for r in rows)


def over(measure):
    """The ratio of a per-arm ``measure`` (of a list of step records): num's over den's."""
    def ratio(num_rows, den_rows) -> float | None:
        a, b = measure(num_rows), measure(den_rows)
        return a / b if a is not None and b else None  # (0 over something: 0x, not n/a)
    return ratio


def ratio_over_steps(num: dict[int, dict], den: dict[int, dict], steps, ratio) -> float | None:
    """``ratio`` (of two lists of step records, e.g. :func:`over`) of num's ``steps`` and den's."""
    return ratio([num[s] for s in steps], [den[s] for s in steps])


def step_interval(num: dict[int, dict], den: dict[int, dict], steps: list[int], ratio,
                   draws: int = 2000) -> list[float] | None:
    """90% interval of :func:`ratio_over_steps` when the RL steps are resampled with replacement.

    The arms run the same prompts at the same step, so a step is resampled for both sides at once.
    This is the step-to-step variation inside one run only (the responses are the arms' same ones;
    their times vary with the machine's load); runs on a shared machine spread further (docs/verl.md).
    """
    if len(steps) < 2:
        return None
    iv = bootstrap_ci90(steps, lambda sample: ratio_over_steps(num, den, sample, ratio), draws=draws)
    return list(iv) if iv is not None else None


def bootstrap_ci90(items: list, statistic, *, seed: int = 0, draws: int = 2000) -> tuple[float, float] | None:
    """90% interval of ``statistic`` (of a resampled list; None: nothing to compare in it) over
    ``draws`` resamples of ``items`` with replacement. None for fewer than 2 items (every resample
    is the one item: a zero-width interval says nothing of the noise), or when most resamples give None."""
    if len(items) < 2:
        return None
    rng = random.Random(seed)
    got = sorted(x for x in (statistic(rng.choices(items, k=len(items))) for _ in range(draws)) if x is not None)
    if len(got) < draws // 2:
        return None
    return got[int(0.05 * (len(got) - 1))], got[int(0.95 * (len(got) - 1))]
