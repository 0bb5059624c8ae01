"""`tlt rollout` (n-gram, EAGLE, AR), its record, `tlt report`, and `tlt bench rollout --quick`."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from tlt.cli import main


def _rollout(target, data, tmp_path, *extra):
    out, rec = tmp_path / "out.jsonl", tmp_path / "rec.json"
    code = main(["-q", "rollout", "--target", str(target), "--data", str(data), "--max-prompts", "4",
                 "--n", "3", "--max-new-tokens", "24", "--temperature", "0", "--out", str(out),
                 "--record", str(rec), *extra])
    assert code == 0
    return [json.loads(x) for x in out.read_text().splitlines()], json.loads(rec.read_text())


def test_rollout_variants_agree_and_record(trained_target, chat_prompts, warm_drafters, tmp_path):
    ar, ar_rec = _rollout(trained_target, chat_prompts, tmp_path / "a", "--no-sd")
    ng, ng_rec = _rollout(trained_target, chat_prompts, tmp_path / "b")
    ea, ea_rec = _rollout(trained_target, chat_prompts, tmp_path / "c", "--drafter", str(warm_drafters["eagle"]),
                          "--arm", "4,1,4")
    assert [r["response"] for r in ar] == [r["response"] for r in ng] == [r["response"] for r in ea]
    assert [r["group"] for r in ar] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert ar_rec["sd_steps"] == 0 and ea_rec["sd_steps"] > 0 and ng_rec["sd_steps"] > 0
    assert ea_rec["mean_accept_length"] > 1
    for rec in (ar_rec, ng_rec, ea_rec):
        assert rec["tokens"] == sum(rec["output_lengths"])
        # + 1 per request: the first token comes from the prefill
        assert sum(s["committed"] for s in rec["timeline"]) + rec["requests"] >= rec["tokens"]
        assert [s["batch"] for s in rec["timeline"]] == sorted((s["batch"] for s in rec["timeline"]), reverse=True)
    assert ng_rec["tuner"]  # BEG-MAB statistics are in the record
    png = tmp_path / "r.png"
    assert main(["report", str(tmp_path / "c" / "rec.json"), "--out", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, message", [
    (["--arm", "4,1"], "DEPTH,TOPK,TOKENS_TO_VERIFY"),
    (["--arm", "2,1,5"], "at most"),
    (["--n", "0"], "--n must be"),
])
def test_rollout_bad_arguments(trained_target, chat_prompts, tmp_path, capsys, args, message):
    code = main(["rollout", "--target", str(trained_target), "--data", str(chat_prompts), *args])
    assert code == 2
    assert message in capsys.readouterr().err


def test_report_errors(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "is a directory; pass a file in it" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["report", str(bad)]) == 2
    assert "timeline" in capsys.readouterr().err


def test_bench_rollout_quick(tmp_path, capsys):
    rec = tmp_path / "r.json"
    threads = torch.get_num_threads()
    assert main(["-q", "bench", "rollout", "--quick", "--repeats", "2", "--json", str(rec)]) == 0
    assert torch.get_num_threads() == threads  # the bench's one thread does not outlive it
    r = json.loads(rec.read_text())
    assert r["repeats"] == 2 and r["threads"] == 1
    others = [v for k, v in r["variants"].items() if k != "AR"]
    assert all(len(v["seconds_all"]) == 2 for v in others)
    # every variant's rollout sits between two AR rollouts: one more AR rollout than variants per repeat
    assert len(r["variants"]["AR"]["seconds_all"]) == 2 * (len(others) + 1)
    # The ratios, recomputed from the raw timings the record keeps: each variant's paired ratio is
    # over the mean of the two AR rollouts around it (order reversed on odd repeats).
    variants = r["variants"]
    names, ar = [k for k in variants if k != "AR"], variants["AR"]["seconds_all"]
    flank, i = {k: [] for k in names}, 0
    for rep in range(2):
        before, i = ar[i], i + 1
        for name in (names if rep % 2 == 0 else names[::-1]):
            flank[name].append((before + ar[i]) / 2)
            before, i = ar[i], i + 1
    ar_rate = variants["AR"]["tokens"] / statistics.median(ar)
    for name in names:
        v = variants[name]
        paired = statistics.median(a / t for a, t in zip(flank[name], v["seconds_all"]))
        assert math.isclose(v["paired_vs_ar"], paired), name
        assert math.isclose(v["speedup_vs_ar"], v["tokens"] / statistics.median(v["seconds_all"]) / ar_rate), name
    assert math.isclose(r["control_paired_vs_ar"], variants["AR again (control)"]["paired_vs_ar"])
    # memory: the paged variants reproduced AR's tokens (checked by the bench); the roomy one held what
    # plain decoding held, in blocks; the one at half its peak stayed inside its pool, so it ran longer
    paged, half = variants["AR, paged"], variants["AR, paged, half its peak"]
    assert paged["evicted"] == 0 and paged["kv_peak_positions"] == variants["AR"]["kv_peak_positions"]
    assert paged["kv_peak_positions"] <= 16 * paged["kv_peak_blocks"] and variants["AR"]["kv_peak_blocks"] == 0
    assert half["kv_peak_blocks"] <= r["kv"]["half_blocks"] < paged["kv_peak_blocks"]
    assert half["steps"] > variants["AR"]["steps"] and (half["evicted"] > 0) == (half["recomputed"] > 0)
    assert any(line.startswith("  KV memory:") for line in r["summary"])
    assert variants["AR again (control)"]["sd_steps"] == 0
    for v in variants.values():  # the last rollout's time split: captures and compiles (none on a CPU), slow steps
        assert v["capture_s"] == 0.0 and (v["compiles"], v["compile_s"]) == (0, 0.0)
        assert 0.0 <= v["slow_steps_s"] <= v["seconds_all"][-1]
        assert v["slow_steps_s"] > 5 * v["median_step_s"] * v["slow_steps"] or v["slow_steps"] == 0
    for w in r["workloads"].values():
        assert w["adaptive_vs_ar_paired"] == variants[w["variant"]]["paired_vs_ar"]
        assert w["adaptive_vs_ar_paired_ci90"] == variants[w["variant"]]["paired_vs_ar_ci90"]
    assert all(v["lossless"] for v in r["by_batch"].values())
    assert set(r["workloads"]) == {"long_tail", "ngram_siblings", "random_drafter"}
    assert all(w["adaptive_vs_ar"] > 0 for w in r["workloads"].values())
    t = r["transfers_per_step_max"]  # plain: the one packed read; speculative: + a drafter's compaction
    assert t["ar"] == 1 and max(t.values()) <= 2, t
    assert "reproduced the AR tokens exactly" in capsys.readouterr().out
    assert main(["-q", "bench", "rollout", "--repeats", "-1"]) == 2
    assert "--repeats=-1: must be >= 0" in capsys.readouterr().err
    assert main(["-q", "bench", "rollout", "--threads", "-1"]) == 2
    assert "--threads=-1: must be >= 0" in capsys.readouterr().err


def test_report_plots_verl_step_records(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="tlt report needs matplotlib")
    rec = tmp_path / "tlt_steps.jsonl"
    rec.write_text("".join(json.dumps({"step": s, "rollout/spec_accept_length": 1.5 + s / 10 if s != 2 else math.nan,
                                       "tlt/drafter_version": s - 1,
                                       "tlt/rollout_s": 2.0, "timing_s/step": 5.0, "tlt/idle_replica_s": 0.5,
                                       "tlt/spot_train_steps": 1}) + "\n" for s in (1, 2, 3)))
    png = tmp_path / "steps.png"
    assert main(["report", str(rec), "--out", str(png)]) == 0
    assert png.stat().st_size > 10_000 and f"wrote {png}" in capsys.readouterr().out
    assert main(["report", str(rec), "--out", str(tmp_path / "plots" / "steps")]) == 0  # no suffix: .png
    assert f"wrote {tmp_path / 'plots' / 'steps.png'}" in capsys.readouterr().out
    assert (tmp_path / "plots" / "steps.png").is_file()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"accept": 1}) + "\n")
    assert main(["report", str(bad), "--out", str(png)]) == 2
    assert "not a TLT step record" in capsys.readouterr().err


def test_the_cli_runs_its_benches_without_pyzmq(tmp_path):
    """The GPU check installs with --no-deps on a machine with no package index: `tlt bench` must not need
    pyzmq, and `tlt coordinator` must say what is missing."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['zmq'] = None\n"
            "from tlt.cli import build_parser\n"
            "p = build_parser()\n"
            "assert p.parse_args(['bench', 'graphs', '--quick']).fn.__name__ == '_cmd_bench'\n"
            "p.parse_args(['coordinator']).fn(None)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "tlt coordinator needs pyzmq" in r.stderr and "pip install pyzmq" in r.stderr


def test_a_json_path_that_cannot_be_written_is_refused_before_the_bench_runs(tmp_path, capsys):
    from tlt.cli import _file_out

    (tmp_path / "d.json").mkdir()
    assert main(["bench", "step-cost", "--quick", "--json", str(tmp_path / "d.json")]) == 2
    assert "is a directory" in capsys.readouterr().err
    _file_out("--json", str(tmp_path / "new" / "sub" / "r.json"))  # its folder is made before the work
    assert (tmp_path / "new" / "sub").is_dir()


@pytest.mark.parametrize("args,message", [
    (["--no-sd", "--arm", "5,1,5"], "would be ignored"),
    (["--max-prompts", "-1"], "--max-prompts must be >= 0"),
    (["--out", "."], "is a directory"),
    (["--record", f"{__file__}/r.json"], "r.json: cannot create its folder"),  # a file where its folder goes
])
def test_rollout_refuses_what_it_would_ignore_or_lose_before_it_runs(args, message, capsys):
    assert main(["rollout", "--target", "no-target", "--data", "no-data", *args]) == 2
    assert message in capsys.readouterr().err


def test_step_cost_quick_keeps_the_lengths_given(tmp_path):
    rec = tmp_path / "r.json"
    assert main(["-q", "bench", "step-cost", "--quick", "--batches", "1", "--new-tokens", "4", "--prompt-len", "24",
                 "--repeats", "3", "--json", str(rec)]) == 0
    r = json.loads(rec.read_text())
    assert r["prompt_len"] == 24 and "over 3 alternating repeats" in "\n".join(r["summary"])


def test_verbosity_flags_go_before_or_after_the_command():
    from tlt.cli import build_parser

    p = build_parser()
    for argv, quiet, verbose in ((["demo"], False, False), (["-q", "demo"], True, False),
                                 (["demo", "-q"], True, False), (["-v", "demo", "--quick", "-q"], True, True),
                                 (["make-target", "--out", "t", "-v"], False, True)):
        a = p.parse_args(argv)
        assert (a.quiet, a.verbose) == (quiet, verbose), argv


def test_help_names_each_default(capsys):
    with pytest.raises(SystemExit):
        main(["rollout", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--max-new-tokens MAX_NEW_TOKENS response length cap (default 256)", "--seed SEED random seed (default 0)",
                 "--temperature TEMPERATURE 0 = greedy (default 1.0)"):
        assert flag in text, flag
    assert "--no-sd plain autoregressive decoding --elastic" in text  # a switch has no default to name
