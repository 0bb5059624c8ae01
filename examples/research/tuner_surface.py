"""``python examples/research/tuner_surface.py``: BEG-MAB vs the per-step oracle on a modelled long-tail rollout.

Pure-Python simulation (seeded, no GPU, no torch): a long-tail rollout of requests with lognormal
output lengths runs engine step by step; the running batch is the set of unfinished requests. Each
step's time and accepted tokens come from a modelled speedup *surface* (:class:`Surface`); the
surface can shift mid-rollout (acceptance drops when half the tokens are done: a stale drafter
after a target update; or rises: a refreshed drafter). Every variant runs on the same request sets
and the same noise seeds.

Model, per step with ``bs`` running requests and arm (depth d, topk k, tokens_to_verify v), in ms:

* acceptance: the verifier's budget of v nodes buys an effective width ``w = clip(v/d, 1, k)``
  candidates per level over ``d_eff = min(d, v)`` levels; a level is accepted with
  ``q = 1 - (1-alpha) * w**-beta``: the independent-candidate formula ``1-(1-alpha)^w`` is far too
  optimistic (candidates are correlated, and only the children of the accepted parent count), so
  misses shrink as a power of the width instead (beta=0.5: 4 candidates halve the misses).
  Accepted drafts per request are truncated-geometric, ``P(acc >= i) = q**i`` (i <= d_eff), so
  ``E[acc] = sum_{i=1..d_eff} q**i``; each request also commits one bonus token.
* verify (target forward of ``bs*(v+1)`` tokens, roofline): ``fixed + max(weights, n*weights/knee)
  + kv*ctx_tokens`` -- memory-bound below the knee (extra tokens nearly free), compute-bound above.
* draft: ``d * (level + per_token*bs*k) + tree`` (a single-layer drafter; 0 when off).
* noise: the step time is multiplied by a seeded lognormal (and rare x3 outliers: GC, prefill).

Calibration (a ~8B target on one H100; knee ~384 tokens): at alpha=0.8 the best tuner arm is
3.3x faster than AR at bs 1 (3.7x over a wide grid of arms) and 2.5x at bs 32 -- TLT Table 2
anchors: 3.62x, 2.48x -- still ~2x at bs 64, and at bs 256 only shallow chains gain (~1.1x) while
deep trees lose 2-3x. At alpha=0.4 (stale drafter) gains are ~1.7x at bs 1 and ~1.3x at bs 32.

Variants: the oracle takes, every step, the arm (AR included) with the best *expected* rate given
the true alpha, batch and context, over the union of the tuner's arms, at any batch size; then
restricted to the arms of the step's bucket (the tuner's ceiling), behind a fixed elastic switch
(AR above 32 running: what a fixed threshold costs), and over a wide grid of arms (what the
default arm sets leave on the table). So BEG-MAB's shortfall splits into bucket arm sets and
learning. BEG-MAB speculates at any batch size where its "off" arm loses (the learned threshold)
and keeps learning across the rollouts of a scenario, like one engine across RL steps. Ablations
change one thing each: a fixed elastic switch at 32, uniform exploration, the paper's
median-of-goodput estimator, raw (not per-request) goodput. Static arms speculate at every size.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import math
import random
from collections.abc import Callable

from tlt.drafter.seeds import derive, replica_seed
from tlt.rollout.strategy import Arm
from tlt.rollout.tuner import BegMab, TunerConfig, describe
from tlt.sim.workloads import lognormal_lengths

log = logging.getLogger(__name__)

# The usual SGLang EAGLE flags: --speculative-num-steps 5 --speculative-eagle-topk 4
# --speculative-num-draft-tokens 8; SGLang's 8 include the root, so 7 drafts are verified.
ENGINE_DEFAULT = Arm(5, 4, 7)
ELASTIC = 32  # the fixed elastic switch of the ablations: SD only while running requests <= this


@dataclasses.dataclass(frozen=True, kw_only=True)
class Surface:
    """The modelled speedup surface (see the module docstring); times in ms."""

    fixed_ms: float = 2.0  # launch, sampling, scheduler per step
    weights_ms: float = 8.0  # memory-bound target forward (weight reads)
    knee_tokens: int = 384  # tokens per forward where compute time equals weights_ms
    kv_us_per_token: float = 0.01  # KV reads per context token of every running request
    draft_level_ms: float = 1.0  # one drafter level (single layer + lm head), memory-bound
    draft_token_us: float = 2.0  # drafter compute per (request x topk) per level
    tree_ms: float = 0.5  # tree build + mask, per SD step
    beta: float = 0.5  # width exponent of the miss rate (see module docstring)
    noise_sigma: float = 0.1  # lognormal step-time noise
    outlier_p: float = 0.01  # probability a step is an outlier (x3 time)

    def __post_init__(self) -> None:
        if self.knee_tokens < 1 or self.beta < 0 or self.noise_sigma < 0:
            raise ValueError(f"{self}: need knee_tokens >= 1, beta >= 0, noise_sigma >= 0")

    def level_q(self, arm: Arm, alpha: float) -> tuple[float, int]:
        """(per-level acceptance q, effective depth) of ``arm`` at per-token acceptance alpha."""
        w = min(float(arm.topk), max(1.0, arm.tokens_to_verify / arm.depth))
        return 1.0 - (1.0 - alpha) * w ** -self.beta, min(arm.depth, arm.tokens_to_verify)

    def expected_accepted(self, arm: Arm, alpha: float) -> float:
        if arm.is_off:
            return 0.0
        q, d = self.level_q(arm, alpha)
        return sum(q ** i for i in range(1, d + 1))

    def step_ms(self, bs: int, arm: Arm, ctx_tokens: int) -> float:
        """Noiseless step time [ms] for ``bs`` requests holding ``ctx_tokens`` KV tokens in all."""
        n = bs * (arm.tokens_to_verify + 1)
        t = self.fixed_ms + max(self.weights_ms, n * self.weights_ms / self.knee_tokens)
        t += self.kv_us_per_token * ctx_tokens / 1000
        if not arm.is_off:
            t += arm.depth * (self.draft_level_ms + self.draft_token_us * bs * arm.topk / 1000)
            t += self.tree_ms
        return t

    def rate(self, bs: int, arm: Arm, alpha: float, ctx_tokens: int) -> float:
        """Expected tokens committed per ms per running request (the oracle's objective)."""
        return (self.expected_accepted(arm, alpha) + 1) / self.step_ms(bs, arm, ctx_tokens)


# A chooser maps (bs, alpha, ctx_tokens) -> Arm and is told each step's outcome.
Choose = Callable[[int, float, int], Arm]
Record = Callable[[int, Arm, int, float], None]


def _no_record(bs: int, arm: Arm, accepted: int, step_s: float) -> None:
    return None


def simulate(lengths: list[int], prompt: int, choose: Choose, record: Record, surf: Surface,
             alphas: tuple[float, float], seed: int) -> dict:
    """One rollout; alpha = alphas[0] until half the tokens are committed, then alphas[1]."""
    r_noise, r_acc = random.Random(seed), random.Random(seed + 7919)
    remaining = list(lengths)
    total, done = sum(lengths), 0
    ctx_sum = prompt * len(lengths)  # KV tokens held by the running requests
    active = list(range(len(lengths)))
    wall_ms, steps, sd_steps = 0.0, 0, 0
    log_, rand = math.log, r_acc.random
    while active:
        bs = len(active)
        alpha = alphas[0] if 2 * done < total else alphas[1]
        arm = choose(bs, alpha, ctx_sum)
        t = surf.step_ms(bs, arm, ctx_sum) * r_noise.lognormvariate(0.0, surf.noise_sigma)
        if r_noise.random() < surf.outlier_p:
            t *= 3.0
        committed, finished = 0, False
        if arm.is_off:
            for i in active:
                remaining[i] -= 1
                finished |= remaining[i] == 0
            committed = bs
        else:
            q, d = surf.level_q(arm, alpha)
            logq = log_(q)
            for i in active:
                a = min(d, int(log_(1.0 - rand()) / logq))  # P(a >= j) = q**j, j <= d
                c = min(a + 1, remaining[i])
                remaining[i] -= c
                committed += c
                finished |= remaining[i] == 0
        done += committed
        ctx_sum += committed
        record(bs, arm, committed - bs, t / 1000)
        wall_ms += t
        steps += 1
        sd_steps += not arm.is_off
        if finished:
            ctx_sum -= sum(prompt + lengths[i] for i in active if remaining[i] == 0)
            active = [i for i in active if remaining[i] > 0]
    return {"wall_s": wall_ms / 1000, "tokens": total, "steps": steps, "sd_steps": sd_steps}


def oracle(surf: Surface, arms: tuple[Arm, ...] | Callable[[int], tuple[Arm, ...]],
           elastic: int | None = None) -> Choose:
    """Per-step best arm from the noiseless surface, knowing the true alpha (AR is an arm).
    ``arms``: the candidates, or a function of the batch size giving them (a tuner's bucket)."""
    arms_at = arms if callable(arms) else (lambda bs: arms)
    front: dict[tuple[int, float], list[tuple[float, float, Arm]]] = {}

    def choose(bs: int, alpha: float, ctx: int) -> Arm:
        if elastic is not None and bs > elastic:
            return Arm.off()
        key = (bs, alpha)
        if key not in front:  # arms not dominated in (tokens per step, time without KV reads)
            pts = sorted((surf.step_ms(bs, a, 0), -(surf.expected_accepted(a, alpha) + 1), a)
                         for a in dict.fromkeys((Arm.off(), *arms_at(bs))))
            keep, best = [], float("inf")
            for t, neg_tok, a in pts:
                if neg_tok < best:
                    keep.append((-neg_tok, t, a))
                    best = neg_tok
            front[key] = keep
        kv_ms = surf.kv_us_per_token * ctx / 1000
        return max(front[key], key=lambda p: p[0] / (p[1] + kv_ms))[2]
    return choose


def static(arm: Arm, elastic: int | None = None) -> Choose:
    return lambda bs, alpha, ctx: Arm.off() if elastic is not None and bs > elastic else arm


def bandit(cfg: TunerConfig, elastic: int | None = None, raw_goodput: bool = False
           ) -> tuple[Choose, Record, BegMab]:
    """BEG-MAB, optionally behind a fixed elastic switch (above it: AR, the tuner is neither asked
    nor fed).
    ``raw_goodput`` is an ablation: rank arms by batch goodput instead of per-request goodput
    (the tuner divides tokens by bs; feeding step_time/bs scales its estimate back by bs)."""
    tuner = BegMab(cfg)

    def choose(bs: int, alpha: float, ctx: int) -> Arm:
        return Arm.off() if elastic is not None and bs > elastic else tuner.choose(bs)

    def record(bs: int, arm: Arm, accepted: int, step_s: float) -> None:
        if elastic is None or bs <= elastic:
            tuner.record(bs, arm, accepted, step_s / bs if raw_goodput else step_s)
    return choose, record, tuner


def grid_arms() -> tuple[Arm, ...]:
    out = []
    for d in range(1, 11):
        for k in (1, 2, 4, 8):
            for v in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
                try:
                    out.append(Arm(d, k, v))
                except ValueError:
                    continue
    return tuple(out)


SCENARIOS = {"stationary": (0.8, 0.8), "shift_down": (0.8, 0.4), "shift_up": (0.4, 0.8)}


def _add(totals: dict[str, list[float]], key: str, rec: dict) -> None:
    t = totals.setdefault(key, [0.0, 0.0, 0.0, 0.0])
    for j, f in enumerate(("wall_s", "tokens", "steps", "sd_steps")):
        t[j] += rec[f]


def run(args: argparse.Namespace) -> dict:
    """Simulated rollout wall time and goodput of BEG-MAB vs the oracle and static strategies."""
    seed = int(args.seed)
    # rollouts share one engine (the tuner keeps learning across them, as across RL steps);
    # every BEG-MAB variant runs with several tuner seeds, pooled (its own randomness is a cost).
    rollouts, n_req, tuner_seeds = (2, 48, 1) if args.quick else (12, 64, 3)
    median_len, sigma, cap, prompt = 300, 1.0, 4096, 256
    surf = Surface()
    cfg = TunerConfig.default()
    tuner_arms = tuple(dict.fromkeys(a for _, arms in cfg.buckets for a in arms if not a.is_off))
    statics = tuple(dict.fromkeys(tuner_arms + (ENGINE_DEFAULT,)))
    sets = [lognormal_lengths(n_req, random.Random(seed * 100_003 + r), median_len, sigma, hi=cap)
            for r in range(rollouts)]
    grid = grid_arms()
    oracles = {"oracle": oracle(surf, tuner_arms), "oracle_elastic": oracle(surf, tuner_arms, ELASTIC),
               "oracle_bucket": oracle(surf, BegMab(cfg).arms),
               "oracle_grid": oracle(surf, grid)}  # stateless apart from their caches
    result: dict = {
        "bench": "tuner", "quick": bool(args.quick), "seed": seed, "rollouts": rollouts,
        "requests": n_req, "tuner_seeds": [replica_seed(seed, k) for k in range(tuner_seeds)],  # tuner k seeded as replica k
        "lengths": {"median": median_len, "sigma": sigma, "cap": cap, "prompt": prompt,
                    "total_tokens_per_rollout": [sum(L) for L in sets]},
        "surface": dataclasses.asdict(surf), "elastic_threshold_ablation": ELASTIC,
        "tuner": {"buckets": describe(cfg.buckets), "epsilon": cfg.epsilon, "explore_gap": cfg.explore_gap,
                  "window": cfg.window, "median_of_goodput": cfg.median_of_goodput},
        "engine_default": str(ENGINE_DEFAULT), "scenarios": {},
    }
    lines = [(f"tuner bench (simulated): {rollouts} rollouts x {n_req} requests, lognormal lengths "
              f"(median {median_len}, sigma {sigma}, cap {cap}), step noise sigma {surf.noise_sigma}, "
              f"BEG-MAB pooled over {tuner_seeds} tuner seed(s)"),
             f"  BEG-MAB eps={cfg.epsilon} explore_gap={cfg.explore_gap} window={cfg.window}: {describe(cfg.buckets)}"]
    for name, alphas in SCENARIOS.items():
        totals: dict[str, list[float]] = {}
        per_seed: list[dict[str, list[float]]] = [{} for _ in range(tuner_seeds)]
        bandits = []
        for k in range(tuner_seeds):
            tcfg = dataclasses.replace(cfg, seed=replica_seed(seed, k))
            bandits.append({
                "begmab": bandit(tcfg), "begmab_elastic32": bandit(tcfg, elastic=ELASTIC),
                "begmab_uniform_explore": bandit(dataclasses.replace(tcfg, explore_gap=math.inf)),
                "begmab_median_goodput": bandit(dataclasses.replace(tcfg, median_of_goodput=True)),
                "begmab_raw_goodput": bandit(tcfg, raw_goodput=True)})
        for r, lengths in enumerate(sets):
            sim = functools.partial(simulate, lengths, prompt, surf=surf, alphas=alphas,
                                    seed=derive(seed, r * 101 + 17))  # same noise for all
            for key, choose in oracles.items():
                _add(totals, key, sim(choose, _no_record))
            for k, group in enumerate(bandits):
                for key, (ch, rec, _) in group.items():
                    out = sim(ch, rec)
                    _add(totals, key, out)
                    _add(per_seed[k], key, out)
            for arm in statics:
                _add(totals, f"static:{arm}", sim(static(arm), _no_record))
            _add(totals, "ar", sim(static(Arm.off()), _no_record))
        for key in bandits[0]:  # pooled over tuner seeds -> per rollout set, like the others
            totals[key] = [v / tuner_seeds for v in totals[key]]
        result["scenarios"][name] = _scenario(name, alphas, totals, per_seed, bandits[0], len(grid), lines)
    result["summary"] = lines
    return result


def _scenario(name: str, alphas: tuple[float, float], totals: dict[str, list[float]],
              per_seed: list[dict[str, list[float]]], bandits: dict, grid_size: int,
              lines: list[str]) -> dict:
    gp = {k: v[1] / v[0] for k, v in totals.items()}  # tokens/s
    best_static = max((k for k in gp if k.startswith("static:")), key=gp.get)
    seed_pct = [100 * t["begmab"][1] / t["begmab"][0] / gp["oracle"] for t in per_seed]
    sc = {
        "alphas": list(alphas),
        "variants": {k: {"wall_s": v[0], "tokens": int(v[1]), "steps": v[2], "sd_steps": v[3],
                         "goodput_tok_s": gp[k]} for k, v in totals.items()},
        "best_static": best_static[7:],
        "begmab_pct_of_oracle": 100 * gp["begmab"] / gp["oracle"],
        "begmab_pct_of_oracle_per_tuner_seed": seed_pct,
        "begmab_pct_of_oracle_bucket": 100 * gp["begmab"] / gp["oracle_bucket"],
        "fixed_elastic_switch_cost_pct": 100 * (1 - gp["oracle_elastic"] / gp["oracle"]),
        "bucket_arms_cost_pct": 100 * (1 - gp["oracle_bucket"] / gp["oracle"]),
        "gain_vs_best_static": gp["begmab"] / gp[best_static],
        "gain_vs_engine_default": gp["begmab"] / gp[f"static:{ENGINE_DEFAULT}"],
        "gain_vs_fixed_elastic32": gp["begmab"] / gp["begmab_elastic32"],
        "gain_vs_ar": gp["begmab"] / gp["ar"],
        "tuner_stats_seed0": bandits["begmab"][2].stats(),
    }
    rows = [("oracle", "oracle (per-step best tuner arm or AR)"),
            ("oracle_bucket", "  ... only its bucket's arms"),
            ("oracle_elastic", f"  ... AR above {ELASTIC} (fixed switch)"),
            ("oracle_grid", f"oracle over a {grid_size}-arm grid"),
            ("begmab", "BEG-MAB (default config)"),
            (best_static, f"best static {best_static[7:]}"),
            (f"static:{ENGINE_DEFAULT}", f"engine default {ENGINE_DEFAULT}"),
            ("begmab_elastic32", f"BEG-MAB, fixed elastic switch {ELASTIC}"),
            ("begmab_uniform_explore", "BEG-MAB, uniform exploration"),
            ("begmab_median_goodput", "BEG-MAB, median-of-goodput estimator"),
            ("begmab_raw_goodput", "BEG-MAB, raw (not per-request) goodput"),
            ("ar", "AR only")]
    shift = "no shift" if alphas[0] == alphas[1] else "shift when half the tokens are done"
    lines.append(f"scenario {name}: alpha {alphas[0]} -> {alphas[1]} ({shift})")
    lines.append(f"  {'variant':42s} {'wall s':>8s} {'tok/s':>8s} {'% oracle':>9s} {'BEG-MAB x':>9s}")
    for key, label in rows:
        lines.append(f"  {label:42s} {totals[key][0]:8.1f} {gp[key]:8.0f} "
                     f"{100 * gp[key] / gp['oracle']:8.1f}% {gp['begmab'] / gp[key]:8.2f}x")
    pct = sc["begmab_pct_of_oracle"]
    lines.append(f"  BEG-MAB = {pct:.1f}% of the oracle free to speculate at any batch size: "
                 f"{'meets' if pct >= 97 else 'FALLS SHORT of'} the 97% goal. Shortfall: bucket arm sets "
                 f"{sc['bucket_arms_cost_pct']:.1f}%, learning {100 - sc['begmab_pct_of_oracle_bucket']:.1f}%; "
                 f"a fixed elastic switch at {ELASTIC} would cost the oracle {sc['fixed_elastic_switch_cost_pct']:.1f}%")
    per_seed_txt = " / ".join(f"{p:.1f}" for p in seed_pct)
    lines.append(f"  BEG-MAB vs its own ceiling (its bucket arms): {sc['begmab_pct_of_oracle_bucket']:.1f}%; "
                 f"vs the oracle per tuner seed: {per_seed_txt}%")
    return sc


if __name__ == "__main__":
    import sys

    from _run import main

    sys.exit(main(run, __doc__))
