"""README's results table agrees with the JSON records in docs/bench/ it names: every row is mapped to
named keys of its record, and the values the row prints are those keys' values, so neither can
change without the other."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _record(name: str) -> dict:
    return json.loads((ROOT / "docs" / "bench" / name).read_text())


def _spread(rec: dict, key: str) -> str:
    v = rec["across_runs"][key]
    return f"{v['mean']:.2f}x ({v['min']:.2f}-{v['max']:.2f})"


def _runs(rec: dict, key: str) -> str:
    return str(rec["across_runs"][key]["runs"])


def _by_batch(rec: dict, key: str, batches: tuple[str, ...]) -> str:
    return ", ".join(f"{rec['by_batch'][b][key]:.2f}x" for b in batches)


def _identical(rec: dict) -> str:
    shares = [r[k] for r in rec["runs"] for k in ("identical_share_ab", "identical_share_ac")]
    matched = {r["responses_matched"] for r in rec["runs"]}
    assert len(matched) == 1, matched
    return f"{100 * min(shares):.0f}% of {matched.pop()} in every run"


# row label (first cell) -> (record, cells it must show: value, runs)
ROWS = {
    "responses token-identical between arms A, B and C":
        ("demo_runs.json", lambda r: (_identical(r), _runs(r, "identical_share_ac"))),
    "rollout time, plain decoding / TLT (arm A / arm C)":
        ("demo_runs.json", lambda r: (_spread(r, "rollout_time_ratio_ar_over_tlt"),
                                      _runs(r, "rollout_time_ratio_ar_over_tlt"))),
    "RL step time, plain decoding / TLT":
        ("demo_runs.json", lambda r: (_spread(r, "step_time_ratio_ar_over_tlt"),
                                      _runs(r, "step_time_ratio_ar_over_tlt"))),
    "accept length, spot-trained / frozen drafter (arm C / arm B)":
        ("demo_runs.json", lambda r: (_spread(r, "accept_length_ratio_spot_vs_stale"),
                                      _runs(r, "accept_length_ratio_spot_vs_stale"))),
    "arm A's reward, last two steps / first two":
        ("demo_runs.json", lambda r: (_spread(r, "reward_rise_a"), _runs(r, "reward_rise_a"))),
    "spot-training seconds, tail consolidation on / off (arm C / arm E)":
        ("tail_consolidation.json", lambda r: (_spread(r, "spot_training_ratio_c_over_e"),
                                               _runs(r, "spot_training_ratio_c_over_e"))),
    "rollout time without / with tail batching (arm A / arm F, arm C / arm G)":
        ("tail_batching.json", lambda r: (", ".join(f"{r['by_arm'][a]['rollout_time_ratio_default_over_tb']:.2f}x"
                                                    for a in "FG"), "1")),
    "speculative / plain decoding on a GPU, batch 1, 4, 8, 32":
        ("rollout_gpu.json", lambda r: (_by_batch(r, "paired", ("1", "4", "8", "32")), "1")),
    "one draft level / a plain step on a GPU, Llama-8B shape, batch 1, 8, 32":
        ("step_cost_llama8b_gpu.json", lambda r: (_by_batch(r, "draft_level_vs_plain", ("1", "8", "32")), "1")),
    "with all 4 drafts accepted, at most x plain decoding on a GPU, Llama-8B shape, 32K-token context, batch 1 "
    "(before the block-table attention)":
        ("step_cost_llama8b_32768_b1_gpu.json", lambda r: (f"{r['by_batch']['1']['all_accepted_limit']:.2f}x "
                                                           f"({r['by_batch']['1']['baseline_all_accepted_limit']:.2f}x)",
                                                           "1")),
}


def _table() -> dict[str, list[str]]:
    text = (ROOT / "README.md").read_text()
    body = text.split("## Results", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("|") and not line.startswith("|---")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in rows[1:]]  # rows[0]: the header
    return {c[0]: c for c in cells}


def test_every_readme_figure_is_its_records_value():
    table = _table()
    assert set(table) == set(ROWS), "README's results rows and this test's mapping differ"
    for label, (name, expected) in ROWS.items():
        value, runs = expected(_record(name))
        cells = table[label]
        assert cells[1] == value, (label, cells[1], value)
        assert cells[2] == runs, (label, cells[2], runs)
        assert cells[5] == f"`docs/bench/{name}`", (label, cells[5])
        date = _record(name).get("date")
        assert date is None or cells[3].endswith(date), (label, cells[3], date)


def test_the_check_rejects_a_drifted_figure(monkeypatch):
    """A README value that no longer matches its record fails the check."""
    rec = _record("demo_runs.json")
    rec["across_runs"]["rollout_time_ratio_ar_over_tlt"]["mean"] += 0.05
    value, _ = ROWS["rollout time, plain decoding / TLT (arm A / arm C)"][1](rec)
    assert value != _table()["rollout time, plain decoding / TLT (arm A / arm C)"][1]


def test_records_state_their_machine_and_date():
    rec = _record("demo_runs.json")
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", rec["date"]) and rec["machine"]["cpus"] >= 1
    assert _record("rollout_gpu.json")["machine"] and _record("step_cost_llama8b_gpu.json")["machine"]["gpu"]
