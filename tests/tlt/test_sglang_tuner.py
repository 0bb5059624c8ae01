"""TLT's SGLang tuner, lossless guard and idle signal as plain Python (SGLang not needed; the
same classes run inside both SGLang versions in tests/integrations/test_sglang_plugin.py)."""

from __future__ import annotations

import random

import pytest

from tlt.rollout.strategy import Arm
from tlt.bench.sglang_tuner import SGLANG_SPEC_GRAPH_BS, graph_memory
from tlt.integrations.sglang import guard
from tlt.integrations.sglang.idle import IdleSignal
from tlt.integrations.sglang.adaptive import DEFAULT_SLOTS, AdaptiveTuner, EmaCompatTuner, load_slots
from tlt.bench.graph_memory import QWEN25_32B


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def test_tuner_buckets_follow_sglang_routing():
    """A batch padded to a captured size may cross a slot key: the tuner must offer exactly the
    slot's steps there, so every chosen step has a captured graph."""
    p = AdaptiveTuner(3, DEFAULT_SLOTS)
    p.set_cuda_graph_bs(list(SGLANG_SPEC_GRAPH_BS))
    for bs in range(1, 80):
        slot = p.slot_of(bs)
        assert {a.depth for a in p.tuner.arms(bs)} == set(p.slots[slot]), bs
        for _ in range(5):
            s = p.get_steps_for_batch(bs)
            graphs = p.cuda_graph_bs_for_step(s)
            padded = next((g for g in SGLANG_SPEC_GRAPH_BS if g >= bs), None)
            assert padded is None or padded in graphs, (bs, s)


def test_tuner_learns_the_best_step_count_per_slot():
    clock, rng = Clock(), random.Random(0)
    p = AdaptiveTuner(0, {"1": {"candidate_steps": [0, 1, 3]}, "8": {"candidate_steps": [0, 1]}}, clock=clock)
    # bs <= 7: 3 steps pay (2.4 accepted for 1.5x time); bs >= 8: speculation costs (off wins)
    for _ in range(4000):
        bs = rng.choice([1, 2, 4, 16, 24])
        s = p.get_steps_for_batch(bs)
        accepts = [min(s, int(rng.random() < 0.8) + int(rng.random() < 0.8) + int(rng.random() < 0.8)) for _ in range(bs)]
        clock.t += 0.01 * ((1 + 0.25 * s) if bs < 8 else (1 + 1.5 * s))
        p.on_verify_complete(accepts, bs)
    assert p.tuner.best(2) == Arm(3, 1, 3) and p.tuner.best(16) == Arm.off()
    assert p.learned > 3900


def test_results_are_matched_to_their_own_choice_under_overlap():
    """With the overlap scheduler the next batch's step count is chosen before the previous
    result arrives; a result must be credited to the step count it ran with."""
    clock = Clock()
    p = AdaptiveTuner(0, {"1": {"candidate_steps": [0, 5]}}, clock=clock)
    first = p.get_steps_for_batch(4)
    second = p.get_steps_for_batch(4)
    assert {first, second} == {0, 5}  # untried arms first
    clock.t = 1.0
    p.on_verify_complete([0, 0, 0, 0], 4)  # no previous stamp: nothing learned yet
    clock.t = 2.0
    p.on_verify_complete([5, 5, 5, 5] if second == 5 else [0] * 4, 4)
    stats = next(iter(p.stats()["tuner"].values()))
    assert stats["d5k1v5" if second == 5 else "off"]["count"] == 1
    # a result that cannot be this choice (more accepted drafts than steps) is not learned from
    p.get_steps_for_batch(4)
    clock.t = 3.0
    before = p.learned
    p._pending.clear()
    p._pending.append((4, 0))
    p.on_verify_complete([3, 0, 0, 0], 4)
    assert p.learned == before


def test_long_pause_between_verifies_is_not_a_step():
    clock = Clock()
    p = AdaptiveTuner(0, {"1": {"candidate_steps": [0]}}, clock=clock)
    for t in (0.0, 0.01, 5.0, 5.01):
        p.get_steps_for_batch(1)
        clock.t = t
        p.on_verify_complete([0], 1)
    assert p.learned == 2  # 0->0.01 and 5.0->5.01; the 5 s gap is idle time


def test_ema_compat_tuner_0512_protocol():
    clock = Clock()
    p = EmaCompatTuner(3, None, clock=clock)
    assert 0 not in p.candidate_steps and 3 in p.candidate_steps
    changed = 0
    for _ in range(300):
        clock.t += 0.01 * (1 + p.current_steps)
        changed += p.update([min(p.current_steps, 1)] * 4)
    assert changed > 0 and p.learned > 250
    assert p.current_steps in p.candidate_steps
    p2 = EmaCompatTuner(4, {"candidate_steps": [1, 3]})  # 0.5.12's flat config; initial step added
    assert p2.candidate_steps == [1, 3, 4]
    with pytest.raises(ValueError, match="holds 0"):
        EmaCompatTuner(1, {"1": {"candidate_steps": [0, 1]}})


@pytest.mark.parametrize("bad, match", [({}, "no batch-size slot"), ({"1": {"candidate_steps": []}}, "non-empty"),
                                        ({"1": {"candidate_steps": [-1]}}, "ints >= 0"),
                                        ({"0": {"candidate_steps": [1]}}, "batch size >= 1")])
def test_bad_slot_configs_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        load_slots(bad)


def test_bucketed_graph_plan_saves_memory():
    m = graph_memory(DEFAULT_SLOTS, SGLANG_SPEC_GRAPH_BS, QWEN25_32B)
    assert m["ratio"] >= 2.8
    every = {str(k): {"candidate_steps": [0, 1, 2, 3, 5, 7]} for k in (1, 4, 12, 32)}
    assert graph_memory(every, SGLANG_SPEC_GRAPH_BS, QWEN25_32B)["ratio"] == pytest.approx(1.0)


def test_guard_rules():
    guard.check_server(algorithm=None, thresholds={"speculative_accept_threshold_single": 0.1},
                       simulate_acc_len=5, force_greedy_ngram=False)  # no speculation: nothing to guard
    ok = dict(algorithm="EAGLE", simulate_acc_len=-1, force_greedy_ngram=False)
    guard.check_server(thresholds={"speculative_accept_threshold_single": 1.0}, **ok)
    for bad in (0.99, float("nan"), "x"):
        with pytest.raises(guard.LossySetting, match="speculative_accept_threshold_acc"):
            guard.check_server(thresholds={"speculative_accept_threshold_acc": bad}, **ok)
    with pytest.raises(guard.LossySetting, match="SIMULATE_ACC_LEN"):
        guard.check_server(thresholds={}, **{**ok, "simulate_acc_len": 2.5})
    with pytest.raises(guard.LossySetting, match="threshold_single=0.5"):
        guard.check_internal_state({"speculative_accept_threshold_single": 0.5})
    guard.check_internal_state({"pp_max_micro_batch_size": 4})
    with pytest.raises(guard.LossySetting, match="min_p=0.05"):
        guard.check_request(speculative=True, min_p=0.05, greedy=False, force_greedy_ngram=False)
    guard.check_request(speculative=False, min_p=0.05, greedy=False, force_greedy_ngram=False)
    with pytest.raises(guard.LossySetting, match="FORCE_GREEDY"):
        guard.check_request(speculative=True, min_p=0, greedy=False, force_greedy_ngram=True)
    guard.check_request(speculative=True, min_p=0, greedy=True, force_greedy_ngram=True)


def test_max_running_warning():
    slots = load_slots(DEFAULT_SLOTS)
    assert guard.max_running_warning(user_value=None, resolved=48, slots=slots)
    assert guard.max_running_warning(user_value=256, resolved=256, slots=slots) is None
    off_at_32 = {1: (0, 1, 3), 32: (0,)}
    assert guard.max_running_warning(user_value=None, resolved=48, slots=off_at_32) is None  # cap above the switch
    assert "elastic threshold (64" in guard.max_running_warning(user_value=None, resolved=48, slots={1: (1,), 64: (0,)})


def test_idle_signal_reports_transitions_only():
    seen, clock = [], Clock()
    sig = IdleSignal(lambda state, step: seen.append((state, step)), clock=clock)
    for running, t in ((3, 0), (2, 1), (0, 2), (0, 3), (1, 5), (0, 6)):
        clock.t = t
        sig.update(running)
    assert seen == [("BUSY", 1), ("IDLE", 1), ("BUSY", 2), ("IDLE", 2)]
    assert sig.idle_s == pytest.approx(3.0)


def test_bench_records_a_trace_then_replays_it(tmp_path, capsys):
    """`tlt bench sglang-tuner --quick --trace F`: records F with the engine (quick grid), then a
    second run replays the same file without recording."""
    import json

    from tlt.cli import main

    trace, record = tmp_path / "trace.json", tmp_path / "bench.json"
    assert main(["-q", "bench", "sglang-tuner", "--quick", "--trace", str(trace), "--json", str(record)]) == 0
    raw = json.loads(trace.read_text())
    assert sorted(raw["trace"]) == ["1", "4"] and sorted(raw["trace"]["4"]) == ["0", "1", "3"]
    assert all(len(acc) == 4 and max(acc) <= 3 for _, acc in raw["trace"]["4"]["3"])
    assert all(acc == [0] for _, acc in raw["trace"]["1"]["0"])
    r = json.loads(record.read_text())
    g = r["goodput_tok_s"]
    assert g["oracle (every step count)"] >= 0.97 * max(v for k, v in g.items() if k.startswith(("static", "AR")))
    assert r["graph_memory"]["ratio"] >= 2.8
    before = trace.stat().st_mtime_ns
    assert main(["-q", "bench", "sglang-tuner", "--quick", "--trace", str(trace)]) == 0
    assert trace.stat().st_mtime_ns == before
    assert "of the per-batch-size oracle" in capsys.readouterr().out


def test_speculation_arguments():
    from tlt.integrations.sglang.launch import speculation_args

    ngram = speculation_args(None, max_running_requests=256)
    assert ngram["speculative_algorithm"] == "NGRAM" and ngram["max_running_requests"] == 256
    eagle = speculation_args("/ckpt/drafter-1", max_running_requests=256)
    assert eagle["speculative_algorithm"] == "EAGLE" and eagle["speculative_draft_model_path"] == "/ckpt/drafter-1"
    assert eagle["speculative_eagle_topk"] == 1 and eagle["speculative_adaptive"] is True
    assert eagle["speculative_num_draft_tokens"] == eagle["speculative_num_steps"] + 1
    with pytest.raises(ValueError, match="max_running_requests"):
        speculation_args(None, max_running_requests=0)


def test_hook_table_per_version():
    from tlt.integrations.sglang import hook_table

    assert hook_table.table_for("0.5.12")[0] == "0.5.12" and hook_table.table_for("0.5.23")[0] == "0.5.23"
    assert hook_table.table_for("0.5.18")[0] == "0.5.12"  # between: the newest supported release not above it
    assert hook_table.table_for("0.6.0")[0] == "0.5.23"
    assert hook_table.table_for("0.5.0")[0] == "0.5.12"  # older than any: the oldest table
    assert {h.target for h in hook_table.TABLE["0.5.23"]()} > {h.target for h in hook_table._common()}


def test_plugin_switched_off_by_environment(monkeypatch):
    """TLT_SGLANG_PLUGIN=0: load() returns before touching SGLang (here SGLang is not even
    importable, so with the plugin on the same call ends the process)."""
    from tlt.integrations.sglang import plugin

    try:
        import sglang  # noqa: F401
        pytest.skip("SGLang is importable in this environment")
    except ImportError:
        pass
    monkeypatch.setenv("TLT_SGLANG_PLUGIN", "0")
    assert plugin.load() is None
    monkeypatch.setenv("TLT_SGLANG_PLUGIN", "1")
    with pytest.raises(SystemExit) as e:
        plugin.load()
    assert e.value.code == 1

