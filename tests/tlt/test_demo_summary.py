"""`tlt demo`'s summary: accept lengths pooled over verifies, paired step intervals, identical
responses matched by (step, prompt index, sample index), reward over the first and last two steps."""

from __future__ import annotations

import math

from tlt.demo import summary as demo


def _step(step: int, verifies: int, committed: int, version: int) -> dict:
    return {"step": step, "rollout/spec_accept_length": committed / verifies if verifies else math.nan,
            "tlt/spec_verifies": float(verifies), "tlt/spec_committed": float(committed),
            "tlt/drafter_version": float(version), "critic/score/mean": 0.1, "tlt/rollout_s": 1.0,
            "timing_s/step": 2.0}


def test_accept_lengths_are_pooled_and_steps_without_verifies_do_not_count():
    records = {  # step 1 is set-up (left out); C's first drafter is pushed at the end of step 2
        "B": [_step(1, 10, 20, 0), _step(2, 0, 0, 0), _step(3, 100, 150, 0), _step(4, 2, 8, 0)],
        "C": [_step(1, 10, 20, 0), _step(2, 4, 12, 1), _step(3, 100, 200, 2), _step(4, 0, 0, 3)],
    }
    s = demo.summarize(records)
    assert s["accept_length_by_arm"] == {"B": 158 / 102, "C": 212 / 104}
    assert s["accept_length_steps"] == [3, 4]
    assert s["accept_length_verifies"] == {"B": 102, "C": 100}
    assert math.isclose(s["accept_length_ratio_spot_vs_stale"], (200 / 100) / (158 / 102))
    # a per-step mean would have counted B's step 2 as 0 (or skipped it) and weighed step 4's 2
    # verifies like step 3's 100
    assert "verifies B 102, C 100" in "\n".join(demo.summary_lines({**s, "seconds": 1.0}))


def test_spot_vs_stale_counts_only_steps_that_served_a_spot_drafter():
    """A push the guard rolled back to the warm-up drafter raises the drafter version but serves no
    spot-trained drafter: the step after it is not a spot step (records without the key: by version)."""
    records = {"B": [_step(s, 10, 20, 0) for s in (1, 2, 3, 4)],
               "C": [_step(1, 10, 20, 1), _step(2, 10, 30, 2), _step(3, 10, 20, 3), _step(4, 10, 30, 3)]}
    for r, spot in zip(records["C"], (4, 0, 6, 6)):  # step 2's push rolled back to the warm-up drafter
        r["tlt/drafter_spot_step"] = float(spot)
    s = demo.summarize(records)
    assert s["accept_length_steps"] == [2, 4]  # the steps after steps 1 and 3
    assert math.isclose(s["accept_length_ratio_spot_vs_stale"], 3.0 / 2.0)
    for r in records["C"]:
        del r["tlt/drafter_spot_step"]
    assert demo.summarize(records)["accept_length_steps"] == [2, 3, 4]


def test_no_verifies_at_all_gives_no_ratio():
    records = {a: [_step(1, 0, 0, 0), _step(2, 0, 0, 1)] for a in "BC"}
    s = demo.summarize(records)
    assert s["accept_length_by_arm"] == {"B": None, "C": None}
    assert s["accept_length_ratio_spot_vs_stale"] is None
    assert "spot vs stale accept length n/a" in "\n".join(demo.summary_lines({**s, "seconds": 1.0}))


def test_ratio_intervals_resample_steps_for_both_arms_at_once():
    same = {a: [_step(s, 50, 100, s - 1) for s in range(1, 6)] for a in "BC"}
    s = demo.summarize(same)
    assert s["accept_length_ratio_ci90"] == [1.0, 1.0]  # paired steps: identical arms never differ
    records = {"B": [_step(s, 50, 100, 0) for s in range(1, 6)],
               "C": [_step(s, 50, 100 + 25 * (s % 2), s - 1) for s in range(1, 6)]}
    s = demo.summarize(records)
    lo, hi = s["accept_length_ratio_ci90"]
    assert 1.0 <= lo < s["accept_length_ratio_spot_vs_stale"] < hi <= 1.25
    assert "(90% CI " in "\n".join(demo.summary_lines({**s, "seconds": 1.0}))
    one = {a: [_step(1, 10, 20, 0), _step(2, 10, 20, 1)] for a in "BC"}
    assert demo.summarize(one)["accept_length_ratio_ci90"] is None  # one step: no interval


def test_time_ratio_intervals_come_with_the_ratios():
    records = {a: [{**_step(s, 0, 0, 0), "tlt/rollout_s": 1.0 + (a == "C") * 0.1 * s,
                    "response_length/mean": 50.0 + 10 * (a == "C") + (s == 1) * 100} for s in range(1, 7)]
               for a in "AC"}
    s = demo.summarize(records)
    assert s["response_length_mean_by_arm"] == {"A": 50.0, "C": 60.0}  # step 1 left out, like the times
    lo, hi = s["rollout_time_ratio_ci90_ar_over_tlt"]
    assert lo < s["rollout_time_ratio_ar_over_tlt"] < hi < 1.0
    assert s["step_time_ratio_ci90_ar_over_tlt"] == [1.0, 1.0]
    line = next(x for x in demo.summary_lines({**s, "seconds": 1.0}) if x.startswith("AR / TLT"))
    assert "rollout time" in line and line.count("90% CI") == 2


def test_identical_share_matches_responses_by_step_prompt_and_sample():
    def resp(step, index, sample, sha):
        return {"step": step, "index": index, "sample": sample, "length": 3, "sha1": sha}

    a = [resp(1, 0, 0, "x"), resp(1, 0, 1, "y"), resp(2, 5, 0, "z"), resp(2, 5, 1, "w")]
    c = [resp(1, 0, 1, "y"), resp(1, 0, 0, "x"), resp(2, 5, 0, "z"), resp(2, 5, 1, "DIFF"), resp(3, 1, 0, "q")]
    got = demo.identical_share({"A": a, "C": c}, "A", "C")
    assert got == {"share": 0.75, "matched": 4, "by_step": {1: 1.0, 2: 0.5}}  # order does not matter
    records = {x: [_step(s, 0, 0, 0) for s in (1, 2)] for x in "AC"}
    s = demo.summarize(records, {"A": a, "C": c})
    assert s["identical_response_share"]["AC"]["share"] == 0.75
    assert "75.0% of 4 responses token-identical between arms A and C" in "\n".join(
        demo.summary_lines({**s, "seconds": 1.0}))
    assert demo.identical_share({"A": a}, "A", "C") is None


def test_reward_first_and_last_are_two_step_means():
    records = {"A": [{**_step(s, 0, 0, 0), "critic/score/mean": r} for s, r in enumerate((0.1, 0.2, 0.3, 0.5, 0.4), 1)]}
    s = demo.summarize(records)
    first, last = s["reward_first_last_by_arm"]["A"]
    assert math.isclose(first, 0.15) and math.isclose(last, 0.45) and math.isclose(s["reward_rise_a"], 3.0)


def test_proposer_shares_and_the_model_free_drafters_contribution():
    def step(s, arm, proposer_suffix, rollout):
        return {**_step(s, 10, 20, 1), f"tlt/arm_share/{arm}": 1.0, "tlt/proposer_share/suffix": proposer_suffix,
                "tlt/proposer_share/eagle": 1.0 - proposer_suffix, "tlt/rollout_s": rollout}

    records = {"C": [step(s, "d4k1v4@suffix", 0.75, 1.0) for s in range(1, 5)],
               "D": [step(s, "d5k1v5", 0.0, 1.5) for s in range(1, 5)]}
    records["C"][0] = step(1, "d4k1v4@suffix", 1.0, 1.0)  # out of the pooled share (steps 2+), kept per step
    s = demo.summarize(records)
    assert s["proposer_share_by_arm"]["C"] == {"suffix": 0.75, "eagle": 0.25}
    assert s["proposer_share_by_step"]["C"][1] == {"suffix": 1.0, "eagle": 0.0}
    assert s["proposer_share_by_step"]["C"][4] == {"suffix": 0.75, "eagle": 0.25}
    assert math.isclose(s["rollout_time_ratio_d_over_c"], 1.5)
    text = "\n".join(demo.summary_lines({**s, "seconds": 1.0}))
    assert "by RL step: 100% 75% 75% 75%" in text
    assert "suffix 75%, eagle 25%" in text and "EAGLE only / EAGLE + suffix drafter 1.50x" in text


def test_eagle_ratios_leave_the_suffix_drafter_out_and_match_strategies():
    def step(s, version, arms):  # arms: {arm: (verifies, committed)}
        r = _step(s, sum(v for v, _ in arms.values()), sum(c for _, c in arms.values()), version)
        for arm, (v, c) in arms.items():
            r[f"tlt/arm_verifies/{arm}"], r[f"tlt/arm_committed/{arm}"] = float(v), float(c)
        return r

    # Stale B: d3 accepts 2.0, d5 2.2, and the suffix drafter (the same in both arms) carries most
    # verifies. Spot C: d3 3.0, d5 3.3 (1.5x at each strategy), but its tuner picks d5 more often.
    b = {"d3k1v3": (80, 160), "d5k1v5": (20, 44), "d4k1v4@suffix": (300, 540)}
    c = {"d3k1v3": (20, 60), "d5k1v5": (80, 264), "d4k1v4@suffix": (100, 180)}
    records = {"B": [step(s, 0, b) for s in range(1, 5)], "C": [step(s, s - 1, c) for s in range(1, 5)]}
    s = demo.summarize(records)
    assert s["accept_length_steps"] == [3, 4]
    assert math.isclose(s["eagle_accept_length_by_arm"]["B"], 204 / 100)
    assert math.isclose(s["eagle_accept_length_by_arm"]["C"], 324 / 100)
    assert math.isclose(s["eagle_accept_length_ratio_spot_vs_stale"], 324 / 204)
    # same strategies: weights 100 (d3) and 100 (d5) verifies per step -> (3.0 + 3.3) / (2.0 + 2.2)
    assert math.isclose(s["eagle_same_strategy_ratio_spot_vs_stale"], 1.5)
    assert s["eagle_same_strategy_ratio_ci90"] == [1.5, 1.5]
    # the pooled figure is diluted by the suffix drafter's verifies
    assert math.isclose(s["accept_length_ratio_spot_vs_stale"], (504 / 200) / (744 / 400))  # 1.35
    text = "\n".join(demo.summary_lines({**s, "seconds": 1.0}))
    assert "EAGLE alone  spot vs stale accept length 1.59x" in text and "at the same strategies 1.50x" in text
    # records without per-arm counters (older runs): no EAGLE figures, no error
    old = {a: [_step(s, 10, 20, s - 1) for s in range(1, 4)] for a in "BC"}
    assert demo.summarize(old)["eagle_accept_length_ratio_spot_vs_stale"] is None


def test_replica_seconds_per_step_and_their_means():
    """Per replica and RL step: decoding, idle and spot-training seconds and requests moved, as the
    trainer records them; the arm's figure is the per-step sum over replicas, averaged over steps 2+."""
    def rec(step, gen, idle, train, moved):
        return {**_step(step, 10, 20, 0), "replica_gen_s": gen, "replica_idle_s": idle, "replica_train_s": train,
                "replica_moved": moved}

    records = {"C": [rec(1, [9.0, 9.0], [0.0, 0.0], [0.0, 0.0], [0, 0]),  # step 1: set-up, left out
                     rec(2, [4.0, 2.0], [0.0, 2.0], [0.0, 1.5], [0, 1]),
                     rec(3, [5.0, 1.0], [0.5, 4.0], [0.0, 3.5], [0, 3])]}
    s = demo.summarize(records)
    assert s["replica_seconds_by_step"]["C"][3] == {"decoding_s": [5.0, 1.0], "idle_s": [0.5, 4.0],
                                                    "training_s": [0.0, 3.5], "moved": [0, 3]}
    assert s["replica_seconds_by_arm"]["C"] == {"decoding_s": 6.0, "idle_s": 3.25, "training_s": 2.5, "moved": 2.0}
    line = next(x for x in demo.summary_lines({**s, "seconds": 1.0}) if x.startswith("replicas C"))
    assert "decoding 6.0 s, idle 3.2 s, spot-training 2.5 s, requests moved 2.0" in line


def test_kv_memory_is_the_largest_peak_beside_a_static_cache_of_its_batch():
    """The KV line: over steps and replicas, the fullest replica-step (its peak positions over the
    static cache of its peak batch), and every eviction with its recomputed tokens."""
    def rec(step, peak, static, evicted, recomputed):
        return {**_step(step, 10, 20, 0), "replica_kv_peak_positions": peak, "replica_kv_static_positions": static,
                "replica_evicted": evicted, "replica_recomputed": recomputed}

    records = {"A": [rec(1, [300, 100], [1000, 400], [0, 1], [0, 40]), rec(2, [500, 0], [1000, 0], [2, 0], [90, 0])],
               "B": [_step(1, 10, 20, 0), _step(2, 10, 20, 0)]}  # records without memory fields (an older run)
    s = demo.summarize(records)
    assert s["kv_memory_by_arm"]["A"] == {"peak_positions": 500, "static_positions": 1000, "peak_share": 0.5,
                                         "evicted": 3, "recomputed": 130}  # (the fullest: 500 of 1000, not 300)
    assert s["kv_memory_by_arm"]["B"] is None
    line = next(x for x in demo.summary_lines({**s, "seconds": 1.0}) if x.startswith("KV memory"))
    assert "A 500/1,000 (50%)" in line and "A 3 (130 tokens recomputed)" in line and "B " not in line


def test_one_repeat_has_no_interval():
    """A bootstrap over one item resamples only it: the zero-width interval it gave (`tlt bench
    rollout --quick` printed "90% CI 2.00-2.00") says nothing of the noise, so there is none."""
    from tlt.bench.fixtures import paired_ci90, show_ci90

    assert paired_ci90([2.0], [1.0], seed=0) is None
    assert show_ci90(None) == "no CI (1 repeat)"
    lo, hi = paired_ci90([2.0, 2.2, 1.9], [1.0, 1.0, 1.0], seed=0)
    assert 1.9 <= lo < hi <= 2.2 and show_ci90((lo, hi)) == f"90% CI {lo:.2f}-{hi:.2f}"
