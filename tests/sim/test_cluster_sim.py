"""The cluster simulator (tlt.sim): event arithmetic against hand-computed cases, and each system's
rule (moves, RollPacker's rounds, PAT's switch) doing what its paper states."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tlt.coordinator.consolidation import StepCurve, drain_s

from tlt.sim.systems import SYSTEMS, Knobs, rollpacker_rounds, run_rollpacker, run_step
from tlt.sim.rollout import Request, Speed, place, simulate, with_lengths
from tlt.sim.workloads import AcceptModel, reasoning_lengths

FLAT = StepCurve(((1, 0.01), (64, 0.01)))  # 10 ms a step whatever the batch
GROWING = StepCurve(((1, 0.010), (8, 0.012), (32, 0.020)))


def test_one_replica_drains_like_the_consolidation_rules_say():
    lengths = [10, 20, 35]
    r = simulate(with_lengths(lengths), [Speed(GROWING)])
    assert r.seconds == pytest.approx(drain_s(lengths, GROWING, 1.0))
    assert [q.finished_at for q in r.finished] == sorted(q.finished_at for q in r.finished)
    assert r.idle_s == pytest.approx(0.0) and r.train_s == (0.0,)


def test_speculation_is_taken_only_where_it_pays():
    spec = StepCurve(((1, 0.02), (32, 0.08)))
    s = Speed(GROWING, spec, AcceptModel(((1, 3.0), (32, 3.0))))
    assert s.rate(1) == pytest.approx(3.0 / 0.02)  # 150 tok/s beats 100
    assert s.rate(32) == pytest.approx(1 / 0.020)  # 3 / 0.08 = 37.5 < 50: plain steps


def test_groups_stay_together_and_idle_replicas_count_as_training_time():
    reqs = [Request("a", 100, group=0), Request("b", 100, group=0), Request("c", 10, group=1)]
    assert [[q.rid for q in p] for p in place(reqs, 2)] == [["a", "b"], ["c"]]
    r = simulate(reqs, [Speed(FLAT), Speed(FLAT)])
    assert r.seconds == pytest.approx(1.0)
    assert r.train_s[0] == pytest.approx(0.0) and r.train_s[1] == pytest.approx(0.9)
    assert r.idle_s == pytest.approx(0.9)


def test_consolidation_frees_replicas_and_reallocation_balances():
    # 4 replicas, one long request per group of 4: the tail sits on every replica
    lengths = [50, 50, 50, 2000] * 4
    plain = Speed(GROWING)
    base = run_step("plain", with_lengths(lengths, 4), plain, plain, 4)
    fuse = run_step("rlhfuse", with_lengths(lengths, 4), plain, plain, 4,
                    Knobs(tick_s=0.1, move_s=0.01, remaining_share=0.3, max_batch=8))
    assert fuse.moves == 3 and fuse.train_s > base.train_s + 2 * 19  # three replicas freed for ~20 s
    assert fuse.rollout_s < base.rollout_s * 1.10  # the tail at batch 4 costs 9% more per step
    skewed = [2000] * 64 + [5] * 64  # one replica gets every long request: reallocation spreads them
    realloc = run_step("rlhfspec", with_lengths(skewed, 64), plain, plain, 2, Knobs(tick_s=0.1, move_s=0.0, knee=0.9))
    alone = run_step("tlt", with_lengths(skewed, 64), plain, plain, 2)
    assert realloc.moves > 0 and realloc.rollout_s < alone.rollout_s


def test_rollpacker_trains_every_prompt_once_with_r0_responses():
    r0, p0 = 4, 8
    prompts = [reasoning_lengths(r0, 4096, seed=i) for i in range(40)]
    out = run_rollpacker(prompts, Speed(GROWING), 4, Knobs(prompt_over=0.25, response_over=0.0), p0=p0, r0=r0)
    trained = [i for o in out for i in o.trained]
    assert len(trained) == len(set(trained)) == 40  # every prompt once (no queue left: 40 = 4 x 10)
    assert all(len(o.trained) == p0 for o in out)  # every step trains p0 prompts
    short = [o for o in out if o.wasted_tokens > 0]
    assert len(short) == 4 and len(out) == 5  # 4 short rounds of 10 launched prompts, then one long round
    assert all(0 < o.wasted_tokens < o.tokens for o in short)


def test_rollpacker_flushes_what_is_left_and_counts_whole_cycles():
    """Too few fresh prompts for a short round: the queue, topped up with fresh ones, runs to the
    end like the trainer's flush, so no prompt is left unrun."""
    r0, p0 = 4, 8
    prompts = [reasoning_lengths(r0, 4096, seed=i) for i in range(44)]
    out = run_rollpacker(prompts, Speed(GROWING), 4, Knobs(prompt_over=0.25, response_over=0.0), p0=p0, r0=r0)
    trained = [i for o in out for i in o.trained]
    assert sorted(trained) == list(range(44))
    assert [len(o.trained) for o in out] == [8, 8, 8, 8, 8, 4] and out[-1].wasted_tokens == 0
    assert [rollpacker_rounds(n, 8, 0.25) for n in (1, 2, 5, 6)] == [5, 5, 5, 10]
    # 8 x 1.3 launches 11 and queues 3 a round: 3 short rounds and the long one
    assert rollpacker_rounds(3, 8, 0.3) == 4 and rollpacker_rounds(3, 8, 0.0) == 3
    # the flush with a queue: 35 prompts, 10 launched a round, 2 queued each: 3 short rounds leave
    # 6 queued and 5 fresh; the flush trains the 6 and 2 fresh, then the last 3
    prompts = [reasoning_lengths(r0, 4096, seed=i) for i in range(35)]
    out = run_rollpacker(prompts, Speed(GROWING), 4, Knobs(prompt_over=0.25, response_over=0.0), p0=p0, r0=r0)
    assert sorted(i for o in out for i in o.trained) == list(range(35))
    assert [len(o.trained) for o in out] == [8, 8, 8, 8, 3]


def test_rollpacker_refuses_prompts_with_too_few_responses():
    with pytest.raises(ValueError, match="at least 5 response lengths"):  # 4 x 1.25 launched
        run_rollpacker([[10, 20]], Speed(FLAT), 2, p0=1, r0=4)


def test_pat_switches_only_when_a_higher_tp_pays():
    lengths = [20] * 15 + [4000]  # one long request: the tail runs on one of 8 replicas
    plain = Speed(FLAT)
    never = run_step("pat", with_lengths(lengths), plain, plain, 8,
                     Knobs(tp_speedup=((1, 1.0), (2, 1.0), (4, 1.0), (8, 1.0)), tick_s=0.05))
    assert never.switched_tp == 1
    fast = run_step("pat", with_lengths(lengths), plain, plain, 8,
                    Knobs(tp_speedup=((1, 1.0), (2, 1.9), (4, 3.6), (8, 6.8)), tick_s=0.05, switch_s=1.0))
    assert fast.switched_tp == 8 and fast.rollout_s < 0.5 * never.rollout_s
    assert fast.train_s < never.train_s  # every GPU joins the tail's TP group: none is left to train


def test_a_system_name_is_checked():
    with pytest.raises(ValueError, match=re.escape("system='pat+'")):
        run_step("pat+", [], Speed(FLAT), Speed(FLAT), 2)


def test_bench_tail_quick_writes_its_record_and_plot(tmp_path):
    import json

    from tlt.cli import main

    out = tmp_path / "cluster.json"
    assert main(["-q", "bench", "cluster", "--quick", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    (_, by), = rec["results"].items()
    row = by["8"]
    assert set(row["systems"]) == set(SYSTEMS) and row["fastest"] in SYSTEMS
    assert row["fastest_over_tlt"] >= 1.0 and row["systems"]["pat"]["tp"] >= 1
    assert row["systems"]["rollpacker"]["wasted_share"] > 0 and row["systems"]["plain"]["wasted_share"] == 0
    # RollPacker's means hold a whole cycle: 4 short rounds and the long round they feed (its
    # figures once came from short rounds alone, the long prompts queued and never run)
    assert rec["steps"] == 1 and row["systems"]["rollpacker"]["steps"] == rollpacker_rounds(1, 64, 0.25) == 5
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_bench_tail_reruns_on_a_curve_measured_earlier(tmp_path):
    import json

    from tlt.cli import main

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "cluster.json"
    curve = root / "docs/bench/cluster_cpu_curve.json"
    assert main(["-q", "bench", "cluster", "--quick", "--cpu-curve", str(curve), "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["curves"] == {"CPU, demo target": "cluster_cpu_curve.json"} and not rec["cpu_curve_measured_here"]
    assert main(["-q", "bench", "cluster", "--quick", "--cpu-curve", str(tmp_path / "none.json")]) == 2


def test_bench_tail_measures_this_machines_curve(tmp_path):
    """--measure-cpu: the CPU row runs on the curve this run measured (written beside the record)."""
    import json

    from tlt.cli import main

    out = tmp_path / "cluster.json"
    assert main(["-q", "bench", "cluster", "--quick", "--measure-cpu", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    curve = json.loads((tmp_path / "cluster_cpu_curve.json").read_text())
    assert rec["cpu_curve_measured_here"] and rec["curves"] == {"CPU, demo target": "cluster_cpu_curve.json"}
    assert curve["bench"] == "rollout" and curve["by_batch"]
    assert rec["results"]["CPU, demo target"]["8"]["systems"]["plain"]["rollout_s"] > 0


def test_step_cost_batches_are_checked():
    from tlt.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "step-cost", "--batches", "0,8"])


def test_docs_tail_table_is_the_records():
    """docs/tail.md's results table shows docs/bench/cluster.json's figures (H200 Llama-8B, device step)."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    by = json.loads((root / "docs/bench/cluster.json").read_text())["results"]["H200, Llama-8B shape, device step"]
    text = (root / "docs/tail.md").read_text().split("## Results", 1)[1]
    for p in SYSTEMS:
        row = next(line for line in text.splitlines() if line.startswith(f"| `{p}` |"))
        for n in ("8", "64", "256"):
            r = by[n]["systems"]
            cell = f"{r[p]['rollout_s']:.0f} s, {r['plain']['rollout_s'] / r[p]['rollout_s']:.2f}x, {r[p]['train_s']:.0f}"
            assert cell in row, (p, n, cell, row)
    fastest = next(line for line in text.splitlines() if line.startswith("| fastest, over TLT alone |"))
    for n in ("8", "64", "256"):
        assert f"`{by[n]['fastest']}`, {by[n]['fastest_over_tlt']:.2f}x" in fastest


def _demo_run(root, seconds_per_token: float, rollout_s: dict[int, float]):
    """A stand-in `tlt demo` output directory (arm A): 2 replicas, 2 prompts x 2 samples per step."""
    import json

    arm = root / "arm-A"
    arm.mkdir(parents=True)
    cost = {"1": [seconds_per_token * 10, 10, 10], "2": [seconds_per_token * 10, 10, 20]}
    steps = [{"step": s, "tlt/rollout_s": t, "replica_step_cost": [cost, cost], "replica_lead_s": [0.1, 0.2],
              "replica_trail_s": [0.05, 0.3], "tail": {}} for s, t in rollout_s.items()]
    (arm / "tlt_steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    lines = [{"step": s, "index": i, "sample": j, "length": 100 * (i + 1) + 10 * j}
             for s in rollout_s for i in range(2) for j in range(2)]
    (arm / "tlt_responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return root


def test_validation_predicts_a_run_from_another_runs_step_costs(tmp_path):
    from tlt.bench.cluster import validate

    # replica 0 gets prompt 0 (lengths 100, 110), replica 1 prompt 1 (200, 210): at 0.01 s per token
    # per request the rollout decodes 2.1 s, plus the fit run's overhead 0.1 + 0.05
    fit = _demo_run(tmp_path / "fit", 0.01, {1: 9.0, 2: 1.0, 3: 1.0})
    exact = _demo_run(tmp_path / "exact", 0.01, {1: 9.0, 2: 2.25, 3: 2.25})
    v = validate(fit, exact, "A")["A"]
    assert v["median_abs_error"] == pytest.approx(0.0, abs=1e-9) and [x["step"] for x in v["steps"]] == [2, 3]
    off = _demo_run(tmp_path / "off", 0.01, {2: 4.5, 3: 4.5})
    assert validate(fit, off, "A")["A"]["median_error"] == pytest.approx(-0.5)
