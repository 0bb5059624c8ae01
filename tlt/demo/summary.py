"""``tlt demo``'s comparison of its arms: the summary record, its printed lines and the plot.

Owns what the demo concludes from its arms' per-step records (``tlt_steps.jsonl``) and per-response
records (``tlt_responses.jsonl``): reward per arm (the means of the first and last two steps),
accept lengths pooled over verifies, spot vs stale, AR over TLT rollout and step time, each ratio
with a 90% interval from resampling RL steps (paired across arms), and the share of responses that
are token-identical between arms (matched by step, prompt index and sample index: with coupled
sampling the arms sample the same tokens, so their times compare the same work).
"""

from __future__ import annotations

import collections
from pathlib import Path

from tlt.demo.step_ratios import (eagle_accept, mean, over, pooled_accept, ratio_over_steps, same_strategy_ratio,
                                  serves_spot, step_interval, total)

ARM_LABELS = {"A": "no speculation", "B": "TLT, warm-up drafter frozen (stale)",
              "C": "full TLT (spot training, tail consolidation)",
              "D": "full TLT, EAGLE only (no model-free drafter)",
              "E": "full TLT without tail consolidation",
              "F": "no speculation, tail batching", "G": "full TLT, tail batching",
              "H": "TLT, warm-up drafter frozen, tail batching"}
COLOURS = {"A": "tab:gray", "B": "tab:orange", "C": "tab:blue", "D": "tab:green", "E": "tab:purple",
           "F": "tab:brown", "G": "tab:cyan", "H": "tab:olive"}


def identical_share(responses: dict[str, list[dict]], a: str, b: str) -> dict | None:
    """Share of arm ``a``'s responses, matched by (step, prompt index, sample index), that arm ``b``
    sampled token for token: pooled and per step."""
    if a not in responses or b not in responses:
        return None
    other = {(r["step"], r["index"], r["sample"]): r["sha1"] for r in responses[b]}
    same, total = collections.Counter(), collections.Counter()
    for r in responses[a]:
        key = (r["step"], r["index"], r["sample"])
        if key in other:
            total[r["step"]] += 1
            same[r["step"]] += other[key] == r["sha1"]
    if not total:
        return None
    return {"share": sum(same.values()) / sum(total.values()), "matched": sum(total.values()),
            "by_step": {s: same[s] / total[s] for s in sorted(total)}}


REPLICA_KEYS = (("decoding_s", "replica_gen_s"), ("idle_s", "replica_idle_s"), ("training_s", "replica_train_s"),
                ("moved", "replica_moved"))


def _kv_memory(rows) -> dict | None:
    """KV memory over steps and replicas: the fullest replica-step (the largest share of a static
    cache of its batch held at its peak), its positions held and that static cache's, and the
    evictions with their recomputed tokens."""
    rows = list(rows)
    peaks = [(p, st) for r in rows for p, st in zip(r.get("replica_kv_peak_positions") or [],
                                                     r.get("replica_kv_static_positions") or []) if st]
    if not peaks:
        return None
    p, st = max(peaks, key=lambda x: (x[0] / x[1], x[0]))
    return {"peak_positions": p, "static_positions": st, "peak_share": p / st,
            "evicted": sum(sum(r.get("replica_evicted") or []) for r in rows),
            "recomputed": sum(sum(r.get("replica_recomputed") or []) for r in rows)}


def summarize(records: dict[str, list[dict]], responses: dict[str, list[dict]] | None = None) -> dict:
    by = {a: {r["step"]: r for r in recs} for a, recs in records.items()}
    steps = sorted(set.intersection(*(set(v) for v in by.values()))) if by else []
    later = [s for s in steps if s > 1]  # step 1 also pays verl's lazy agent-loop start
    out: dict = {"steps": len(steps), "arms": {a: ARM_LABELS[a] for a in records}}
    out["reward_mean_by_arm"] = {a: mean(by[a][s].get("critic/score/mean") for s in steps) for a in by}
    # the means of the first two and the last two steps
    out["reward_first_last_by_arm"] = {a: [mean(by[a][s].get("critic/score/mean") for s in steps[:2]),
                                           mean(by[a][s].get("critic/score/mean") for s in steps[-2:])]
                                       for a in by if steps}
    first_last = out["reward_first_last_by_arm"].get("A")
    if first_last and first_last[0]:
        out["reward_rise_a"] = first_last[1] / first_last[0]
    responses = responses or {}
    out["identical_response_share"] = {f"{a}{b}": identical_share(responses, a, b)
                                       for a, b in (("A", "B"), ("A", "C"), ("C", "E"))
                                       if a in responses and b in responses}
    out["accept_length_by_arm"] = {a: pooled_accept(by[a][s] for s in later) for a in by if a != "A"}
    if "B" in by and "C" in by:
        # Steps whose rollout used a spot-trained drafter: pushed at the end of an earlier step.
        adapted = [s for s in later if serves_spot(by["C"].get(s - 1))]
        out["accept_length_ratio_spot_vs_stale"] = ratio_over_steps(by["C"], by["B"], adapted, over(pooled_accept))
        out["accept_length_ratio_ci90"] = step_interval(by["C"], by["B"], adapted, over(pooled_accept))
        # The drafters alone: the suffix drafter is the same in both arms, and each arm's tuner
        # picks its own depths, so the pooled figure mixes both into the drafters' difference.
        out["eagle_accept_length_by_arm"] = {a: eagle_accept(by[a][s] for s in adapted) for a in "BC"}
        out["eagle_accept_length_ratio_spot_vs_stale"] = ratio_over_steps(by["C"], by["B"], adapted, over(eagle_accept))
        out["eagle_accept_length_ratio_ci90"] = step_interval(by["C"], by["B"], adapted, over(eagle_accept))
        out["eagle_same_strategy_ratio_spot_vs_stale"] = ratio_over_steps(by["C"], by["B"], adapted, same_strategy_ratio)
        out["eagle_same_strategy_ratio_ci90"] = step_interval(by["C"], by["B"], adapted, same_strategy_ratio)
        out["eagle_accept_length_by_step"] = {a: {s: eagle_accept([by[a][s]]) for s in adapted} for a in "BC"}
        out["accept_length_steps"] = adapted
        out["accept_length_verifies"] = {a: int(sum(by[a][s].get("tlt/spec_verifies", 0) for s in adapted))
                                         for a in "BC"}
        out["target_drift"] = mean(by["C"][s].get("tlt/target_drift") for s in steps)
    if "A" in by and "C" in by and later:
        for key, name, ci_name in (
                ("tlt/rollout_s", "rollout_time_ratio_ar_over_tlt", "rollout_time_ratio_ci90_ar_over_tlt"),
                ("timing_s/step", "step_time_ratio_ar_over_tlt", "step_time_ratio_ci90_ar_over_tlt")):
            out[name] = ratio_over_steps(by["A"], by["C"], later, over(total(key)))
            out[ci_name] = step_interval(by["A"], by["C"], later, over(total(key)))
        out["rollout_s_by_arm"] = {a: sum(by[a][s].get("tlt/rollout_s", 0.0) for s in later) for a in by}
    out["response_length_mean_by_arm"] = {a: mean(by[a][s].get("response_length/mean") for s in later)
                                          for a in by}
    # per replica and RL step: what its time went to, and the requests that left it for another
    out["replica_seconds_by_step"] = {a: {s: {name: list(by[a][s].get(key) or []) for name, key in REPLICA_KEYS}
                                          for s in steps} for a in by}
    out["replica_seconds_by_arm"] = {a: {name: mean(sum(by[a][s].get(key) or []) for s in later)
                                         for name, key in REPLICA_KEYS} for a in by}
    out["kv_memory_by_arm"] = {a: _kv_memory(by[a][s] for s in steps) for a in by}
    out["arm_share_by_arm"] = {a: _arm_shares(by[a][s] for s in later) for a in by if a != "A"}
    out["proposer_share_by_arm"] = {a: _shares((by[a][s] for s in later), "tlt/proposer_share/")
                                    for a in by if a != "A"}
    out["proposer_share_by_step"] = {a: {s: _shares([by[a][s]], "tlt/proposer_share/") for s in steps}
                                     for a in by if a != "A"}
    if "B" in by and "E" in by:  # arm E's own spot vs stale figure (its pushes, its steps)
        adapted_e = [s for s in later if serves_spot(by["E"].get(s - 1))]
        out["accept_length_ratio_spot_vs_stale_e"] = ratio_over_steps(by["E"], by["B"], adapted_e, over(pooled_accept))
        out["accept_length_ratio_ci90_e"] = step_interval(by["E"], by["B"], adapted_e, over(pooled_accept))
    if "C" in by and "E" in by and later:  # tail consolidation on (C) vs off (E), the same seeds
        for key, name in (("tlt/rollout_s", "rollout"), ("timing_s/step", "step")):
            out[f"{name}_time_ratio_e_over_c"] = ratio_over_steps(by["E"], by["C"], later, over(total(key)))
            out[f"{name}_time_ratio_ci90_e_over_c"] = step_interval(by["E"], by["C"], later, over(total(key)))
        train = over(lambda rows: sum(sum(r.get("replica_train_s") or []) for r in rows))
        out["spot_training_ratio_c_over_e"] = ratio_over_steps(by["C"], by["E"], later, train)
        out["spot_training_ratio_ci90_c_over_e"] = step_interval(by["C"], by["E"], later, train)
        out["tail_moves_by_step_c"] = {s: by["C"][s].get("tlt/tail_moves", 0.0) for s in steps}
    if "C" in by and "D" in by and later:  # what the model-free drafter adds beside EAGLE
        out["rollout_time_ratio_d_over_c"] = ratio_over_steps(by["D"], by["C"], later, over(total("tlt/rollout_s")))
        out["rollout_time_ratio_ci90_d_over_c"] = step_interval(by["D"], by["C"], later,
                                                                 over(total("tlt/rollout_s")))
    return out


def _arm_shares(rows) -> dict[str, float]:
    """Share of the speculative steps per arm (strategy), over some step records (weighted by verifies)."""
    return _shares(rows, "tlt/arm_share/")


def _shares(rows, prefix: str) -> dict[str, float]:
    """Per-step shares under ``prefix`` pooled over steps, weighted by each step's verifies."""
    total: collections.Counter = collections.Counter()
    for r in rows:
        n = r.get("tlt/spec_verifies", 0)
        for k, v in r.items():
            if k.startswith(prefix):
                total[k.removeprefix(prefix)] += v * n
    s = sum(total.values())
    return {k: v / s for k, v in total.most_common()} if s else {}


def plot(records: dict[str, list[dict]], png: Path) -> None:
    """Reward, accept length, rollout and step time (start-up step left out), and each arm's idle
    and training replica-seconds per RL step; one colour per arm in every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(24, 4.2))
    width = 0.8 / max(1, len(records))
    for j, (arm, recs) in enumerate(records.items()):
        c, label = COLOURS[arm], f"{arm}: {ARM_LABELS[arm]}"
        s = [r["step"] for r in recs]
        later = [r for r in recs if r["step"] > 1]
        axes[0].plot(s, [r.get("critic/score/mean") for r in recs], marker="o", color=c, label=label)
        if arm != "A":
            axes[1].plot(s, [r.get("rollout/spec_accept_length") for r in recs], marker="o", color=c, label=arm)
        axes[2].plot([r["step"] for r in later], [r.get("tlt/rollout_s") for r in later], marker="o", color=c,
                     label=arm)
        axes[3].plot([r["step"] for r in later], [r.get("timing_s/step") for r in later], marker="o", color=c,
                     label=arm)
        x = [v + (j - (len(records) - 1) / 2) * width for v in s]
        idle = [sum(r.get("replica_idle_s", [])) for r in recs]
        train = [sum(p[2] for p in r.get("spot_phase_s", []) if len(p) > 2) for r in recs]
        axes[4].bar(x, idle, width, color=c, alpha=0.35, label=f"{arm} idle")
        axes[4].bar(x, train, width, color=c, label=f"{arm} training")
    axes[0].set(xlabel="RL step", ylabel="reward (mean)", title="reward")
    axes[1].set(xlabel="RL step", ylabel="tokens committed per verify", title="accept length")
    axes[2].set(xlabel="RL step", ylabel="seconds", title="rollout time (step 1, start-up, left out)")
    axes[3].set(xlabel="RL step", ylabel="seconds", title="step time (step 1 left out)")
    axes[4].set(xlabel="RL step", ylabel="replica-seconds", title="replicas idle (light) / spot-training (dark)")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def summary_lines(s: dict) -> list[str]:
    def f(x, spec=".2f"):
        return "n/a" if x is None else format(x, spec)

    lines = [f"verl GRPO, {s['steps']} RL steps per arm: " + ", ".join(f"{a}) {v}" for a, v in s["arms"].items())]
    lines.append("reward mean  " + ", ".join(f"{a} {f(v, '.3f')}" for a, v in s["reward_mean_by_arm"].items()))
    if s.get("reward_first_last_by_arm"):
        lines.append("reward       first two -> last two steps: " + ", ".join(
            f"{a} {f(v[0], '.3f')} -> {f(v[1], '.3f')}" for a, v in s["reward_first_last_by_arm"].items())
            + (f" (A rose {s['reward_rise_a']:.2f}x)" if s.get("reward_rise_a") else ""))
    for pair, v in (s.get("identical_response_share") or {}).items():
        if v:
            lines.append(f"identical    {100 * v['share']:.1f}% of {v['matched']} responses token-identical "
                         f"between arms {pair[0]} and {pair[1]} (coupled sampling)")
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
    if s.get("eagle_accept_length_ratio_spot_vs_stale") is not None:
        al = s.get("eagle_accept_length_by_arm") or {}
        lines.append(f"EAGLE alone  spot vs stale accept length {f(s['eagle_accept_length_ratio_spot_vs_stale'])}x"
                     f"{ci('eagle_accept_length_ratio_ci90')} (B {f(al.get('B'))}, C {f(al.get('C'))}); "
                     f"at the same strategies {f(s.get('eagle_same_strategy_ratio_spot_vs_stale'))}x"
                     f"{ci('eagle_same_strategy_ratio_ci90')}")
        per_step = s.get("eagle_accept_length_by_step") or {}
        if per_step.get("B") and per_step.get("C"):
            lines.append("EAGLE by step  C / B: " + " ".join(
                f"{st}:{f(c)}/{f(per_step['B'].get(st))}" for st, c in per_step["C"].items()))
    if "rollout_time_ratio_ar_over_tlt" in s:
        lines.append(f"AR / TLT     rollout time {f(s['rollout_time_ratio_ar_over_tlt'])}x"
                     f"{ci('rollout_time_ratio_ci90_ar_over_tlt')}, step time "
                     f"{f(s['step_time_ratio_ar_over_tlt'])}x{ci('step_time_ratio_ci90_ar_over_tlt')}")
    if s.get("response_length_mean_by_arm"):
        lens = ", ".join(f"{a} {f(v, '.0f')}" for a, v in s["response_length_mean_by_arm"].items())
        lines.append(f"mean response {lens} tokens (steps 2+)")
    for a, v in (s.get("replica_seconds_by_arm") or {}).items():
        if v and v.get("decoding_s") is not None:
            lines.append(f"replicas {a}   per RL step, summed over replicas (steps 2+): decoding "
                         f"{f(v['decoding_s'], '.1f')} s, idle {f(v['idle_s'], '.1f')} s, spot-training "
                         f"{f(v['training_s'], '.1f')} s, requests moved {f(v['moved'], '.1f')}")
    kv = {a: v for a, v in (s.get("kv_memory_by_arm") or {}).items() if v}
    if kv:
        lines.append("KV memory    peak positions held per replica / a static cache of its batch: " + ", ".join(
            f"{a} {v['peak_positions']:,}/{v['static_positions']:,} ({100 * v['peak_share']:.0f}%)" for a, v in kv.items())
            + "; evictions " + ", ".join(f"{a} {v['evicted']} ({v['recomputed']:,} tokens recomputed)"
                                         for a, v in kv.items()))
    for a, shares in (s.get("arm_share_by_arm") or {}).items():
        if shares:
            by_proposer = s.get("proposer_share_by_arm", {}).get(a) or {}
            lines.append(f"arms {a}       " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in list(shares.items())[:5])
                         + " of speculative steps (steps 2+)" + (" = " + ", ".join(
                             f"{k} {100 * v:.0f}%" for k, v in by_proposer.items()) if by_proposer else ""))
            per_step = s.get("proposer_share_by_step", {}).get(a) or {}
            if any(per_step.values()):
                lines.append(f"suffix {a}     share of speculative steps by RL step: " + " ".join(
                    f"{100 * v.get('suffix', 0.0):.0f}%" if v else "-" for v in per_step.values()))
    if s.get("accept_length_ratio_spot_vs_stale_e") is not None:
        lines.append(f"spot vs stale accept length, arm E {f(s['accept_length_ratio_spot_vs_stale_e'])}x"
                     f"{ci('accept_length_ratio_ci90_e')}")
    if s.get("rollout_time_ratio_e_over_c") is not None:
        lines.append(f"consolidation  E / C (off / on): rollout time {f(s['rollout_time_ratio_e_over_c'])}x"
                     f"{ci('rollout_time_ratio_ci90_e_over_c')}, step time {f(s['step_time_ratio_e_over_c'])}x"
                     f"{ci('step_time_ratio_ci90_e_over_c')}; spot-training replica-seconds C / E "
                     f"{f(s.get('spot_training_ratio_c_over_e'))}x{ci('spot_training_ratio_ci90_c_over_e')}; "
                     "requests moved by step " + " ".join(f"{v:.0f}" for v in s["tail_moves_by_step_c"].values()))
    if s.get("rollout_time_ratio_d_over_c") is not None:
        lines.append(f"model-free  rollout time EAGLE only / EAGLE + suffix drafter "
                     f"{f(s['rollout_time_ratio_d_over_c'])}x{ci('rollout_time_ratio_ci90_d_over_c')}")
    if "response_lengths" in s:
        r = s["response_lengths"]
        lines.append(f"responses    median {r['median']:.0f}, p90 {r['p90']} tokens (p90/median "
                     f"{f(r['p90_over_median'])}), {100 * r['share_at_cap']:.1f}% at the {r['cap']}-token cap")
    if s.get("careful_share_by_step"):
        lines.append("policy       careful share of arm A's step lines by RL step: " + " ".join(
            f"{v:.2f}" for v in s["careful_share_by_step"].values()))
    if "speedup_limit" in s:
        lim = s["speedup_limit"]
        lines.append("CPU ceiling  plain step / speculative step (depth 4): " + ", ".join(
            f"batch {k[5:]} {v['plain_over_spec_step']:.2f} (all accepted: {v['ceiling_all_accepted']:.2f}x)"
            for k, v in lim.items()))
    lines.append(f"done in {s['seconds']:.0f}s")
    return lines
