"""The ``tlt`` command line: one sub-command per capability.

Owns argument parsing, turning user errors (ValueError) into one clear line and exit code 2,
and printing results. The work itself lives in the modules each sub-command calls.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from collections.abc import Callable
from pathlib import Path


def _cmd_make_target(a: argparse.Namespace) -> None:
    from tlt.demo.target_factory import TargetSpec, ensure_target

    spec = TargetSpec(family=a.family, train_steps=a.train_steps, seed=a.seed)
    out = Path(a.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} is {'a file' if not out.is_dir() else 'not empty'}; choose a new directory")
    if a.cache and Path(a.cache).exists() and not Path(a.cache).is_dir():
        raise ValueError(f"--cache {a.cache} is a file; give a directory")
    cached = ensure_target(spec, Path(a.cache) if a.cache else None, progress=not a.quiet)
    shutil.copytree(cached, out, dirs_exist_ok=True)
    meta = json.loads((out / "tlt_target.json").read_text())
    print(f"target {a.family} written to {out} (cache {cached}); train steps {meta['train_steps']}"
          + (f", final loss {meta['final_loss']:.3f}" if meta.get("final_loss") else ""))


def _cmd_warmup(a: argparse.Namespace) -> None:
    from tlt.drafter.offline_train import TrainConfig
    from tlt.drafter.ttt import TTTConfig
    from tlt.warmup import WarmupConfig, run_warmup

    train = TrainConfig(max_steps=a.max_steps, lr=a.lr, token_budget=a.token_budget,
                        save_every=a.save_every, seed=a.seed,
                        ttt=TTTConfig(steps=a.ttt_steps, decay=a.ttt_decay, loss=a.loss))
    cfg = WarmupConfig(target=Path(a.target), data=Path(a.data), out=Path(a.out), method=a.method,
                       responses=a.responses, max_prompts=a.max_prompts, max_new_tokens=a.max_new_tokens,
                       temperature=a.temperature, samples_per_prompt=a.samples_per_prompt,
                       draft_vocab_size=a.draft_vocab_size, resume=a.resume, train=train)
    r = run_warmup(cfg, progress=not a.quiet)
    b, t = r["untrained"], r["trained"]
    loss = ("no step trained" if r["first_loss"] is None
            else f"loss {r['first_loss']:.3f} -> {r['final_loss']:.3f}")  # (--max-steps 0, or a finished run resumed)
    print(f"warm-up {r['method']}: {r['train_samples']} train / {r['heldout_samples']} held-out samples, "
          f"{r['train_tokens']} tokens, {r['steps']} steps, {loss}")
    print(f"held-out top-1 {b['top1']:.3f} -> {t['top1']:.3f}, top-3 {b['top3']:.3f} -> {t['top3']:.3f}, "
          f"est. accept length ({r['ttt_steps']}-token chain) {b['accept_length']:.2f} -> {t['accept_length']:.2f}")
    print(f"drafter saved to {cfg.out} ({r['seconds']:.0f}s)")


def _cmd_export(a: argparse.Namespace) -> None:
    from tlt.drafter.export import export_drafter

    r = export_drafter(Path(a.drafter), Path(a.target), a.format, Path(a.out), dtype=a.dtype,
                       overwrite=a.overwrite)
    print(json.dumps(r, indent=2, default=str))


def _parse_arm(text: str | None):
    from tlt.rollout.strategy import Arm

    if text is None:
        return None
    try:
        depth, topk, ttv = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--arm {text!r}: expected DEPTH,TOPK,TOKENS_TO_VERIFY, e.g. 5,1,5") from None
    return Arm(depth, topk, ttv)


def _cmd_rollout(a: argparse.Namespace) -> None:
    from tlt.rollout_job import RolloutJob, run_rollout

    job = RolloutJob(target=Path(a.target), data=Path(a.data), drafter=Path(a.drafter) if a.drafter else None,
                     n=a.n, max_prompts=a.max_prompts, max_new_tokens=a.max_new_tokens,
                     temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, arm=_parse_arm(a.arm),
                     no_sd=a.no_sd, elastic_threshold=a.elastic_threshold, seed=a.seed)
    for flag, name in (("--out", a.out), ("--record", a.record)):  # before the rollout, not after it
        _file_out(flag, name)
    r = run_rollout(job, Path(a.out) if a.out else None, Path(a.record) if a.record else None)
    al = f", mean accept length {r['mean_accept_length']:.2f}" if r["mean_accept_length"] else ""
    print(f"rollout: {r['requests']} responses, {r['tokens']} tokens in {r['seconds']:.1f}s "
          f"({r['tokens_per_s']:.0f} tok/s), {r['sd_steps']}/{r['steps']} steps speculative{al}")
    for name in (a.out, a.record):
        if name:
            print(f"wrote {name}")


def _cmd_report(a: argparse.Namespace) -> None:
    from tlt.rollout_job import plot_record, plot_steps

    record, out = Path(a.record), Path(a.out)
    if record.is_dir():
        raise ValueError(f"record {record} is a directory; pass a file in it (a verl run's tlt_steps.jsonl, "
                         "or the JSON of `tlt rollout --record`)")
    if not record.is_file():
        raise ValueError(f"record {record} does not exist")
    if not out.suffix:  # (matplotlib would add .png itself, and the name printed would be wrong)
        out = out.with_name(out.name + ".png")
    _file_out("--out", str(out))
    try:
        if record.suffix == ".jsonl":  # a verl run's per-step records (tlt_steps.jsonl)
            plot_steps([json.loads(x) for x in record.read_text().splitlines() if x.strip()], out)
        else:
            plot_record(json.loads(record.read_text()), out)
    except json.JSONDecodeError as err:
        raise ValueError(f"{record} is not JSON: {err.msg}") from None
    print(f"wrote {out}")


def _cmd_coordinator(a: argparse.Namespace) -> None:
    from tlt.coordinator.cli import serve_args

    serve_args(a)


def _batches(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give batch sizes as comma-separated integers, e.g. 1,8,32")
    if not out or min(out) < 1 or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"{text!r}: distinct batch sizes >= 1, e.g. 1,8,32")
    return out


def _file_out(flag: str, path: str | None) -> None:
    """Refuse a path of a file the command writes (``flag``'s) that cannot be written, before the
    work, not after it; make its folder."""
    if not path:
        return
    if Path(path).is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file name")
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot create its folder ({e.strerror})") from None


def _write_json(path: str, record: dict) -> None:
    """The record, whole or not at all (written beside it, then renamed)."""
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(path)
    print(f"wrote {path}")


def _cmd_bench(a: argparse.Namespace) -> None:
    from tlt import bench

    run = bench.get(a.which)  # (a research experiment moved out is refused first, with where it went)
    if a.target_steps:
        raise ValueError("--target-steps: only the research experiments took it; they are in examples/research/ "
                         "(python examples/research/headroom.py --help)")
    if a.repeats < 0:
        raise ValueError(f"--repeats={a.repeats}: must be >= 0 (0: the bench's default)")
    if a.threads < 0:
        raise ValueError(f"--threads={a.threads}: must be >= 0 (0: torch's default, 1: a Ray-hosted replica's)")
    if a.prompt_len < 0:
        raise ValueError(f"--prompt-len={a.prompt_len}: must be >= 0 (0: the bench's 128 tokens)")
    if a.new_tokens < 0:
        raise ValueError(f"--new-tokens={a.new_tokens}: must be >= 0 (0: the bench's default)")
    if a.block_size < 0:
        raise ValueError(f"--block-size={a.block_size}: must be >= 0 (0: no paged cache)")
    _file_out("--json", a.json)
    result = run(a)
    print("\n".join(result["summary"]))
    if a.json:
        _write_json(a.json, result)


def _cmd_doctor(a: argparse.Namespace) -> None:
    from tlt.integrations.sglang import doctor

    _file_out("--json", a.json)
    r = doctor.report()
    print("\n".join(doctor.lines(r)))
    if a.json:
        _write_json(a.json, r)
    if r["hooks_missing"] or r["errors"]:
        sys.exit(1)


def _cmd_demo(a: argparse.Namespace) -> None:
    from tlt.demo.job import ARMS, run_demo
    from tlt.demo.summary import summary_lines

    if not set(a.arms) <= set(ARMS) or not a.arms or len(set(a.arms)) != len(a.arms):
        raise ValueError(f"--arms {a.arms!r}: use distinct letters from {''.join(ARMS)} (A no speculation, B stale "
                         "drafter, C full TLT, D full TLT with EAGLE only, E full TLT without tail consolidation, "
                         "F, G, H: A, C, B with tail batching)")
    if a.steps is not None and a.steps < 1:
        raise ValueError(f"--steps {a.steps}: use at least 1 RL step per arm")
    out = Path(a.out).resolve()
    print("\n".join(summary_lines(run_demo(out, quick=a.quick, progress=not a.quiet, arms=a.arms, steps=a.steps))))
    print(f"wrote {out / 'summary.json'} and {out / 'demo.png'}")


class _Help(argparse.HelpFormatter):
    """A flag's help ends with its default, unless the help names one or there is none to name."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text or "%(default)" in text
                or action.default is None or action.default is False or action.default == argparse.SUPPRESS):
            return text
        return f"{text} (default %(default)s)" if text else "default %(default)s"


def _add_make_target(add: Callable[..., argparse.ArgumentParser]) -> None:
    """`tlt make-target` and its arguments."""
    s = add("make-target", help="build the small embedded target model (HF format)",
            description="Build a small Llama/Qwen2/Qwen3 target with a tokenizer trained "
            "here; with --train-steps, train it on the synthetic arithmetic corpus. "
            "Cached by content under $TLT_CACHE (default ~/.cache/tlt).")
    s.add_argument("--family", choices=("llama", "qwen2", "qwen3"), default="llama", help="architecture")
    s.add_argument("--out", required=True, help="directory to write (must be new or empty)")
    s.add_argument("--train-steps", type=int, default=0, help="training steps (0 = random weights)")
    s.add_argument("--seed", type=int, default=0, help="random seed")
    s.add_argument("--cache", help="cache directory (default $TLT_CACHE or ~/.cache/tlt)")
    s.set_defaults(fn=_cmd_make_target)


def _add_warmup(add: Callable[..., argparse.ArgumentParser]) -> None:
    """`tlt warmup` and its arguments."""
    s = add("warmup", help="train a first drafter on the target's own rollouts",
            description="Prompts -> target responses -> hidden states -> drafter. Prints "
            "held-out top-1/top-3 accuracy and estimated accept length before and after.")
    s.add_argument("--target", required=True, help="HF model directory (config.json, safetensors, tokenizer.json)")
    s.add_argument("--data", required=True, help="prompts: .json/.jsonl/.parquet, text or chat messages")
    s.add_argument("--out", required=True, help="drafter checkpoint directory")
    s.add_argument("--method", choices=("eagle", "eagle3"), default="eagle", help="drafter architecture")
    s.add_argument("--max-steps", type=int, default=300, help="optimizer steps (default 300)")
    s.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    s.add_argument("--responses", choices=("auto", "generate", "file"), default="auto",
                   help="auto: use the file's responses when every row has one, else generate")
    s.add_argument("--max-prompts", type=int, default=0, help="use only the first N prompts (0 = all)")
    s.add_argument("--max-new-tokens", type=int, default=256, help="response length cap when generating")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy responses")
    s.add_argument("--samples-per-prompt", type=int, default=1, help="responses generated per prompt")
    s.add_argument("--draft-vocab-size", type=int, default=0, help="EAGLE-3 draft vocab (0 = full)")
    s.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (cosine schedule)")
    s.add_argument("--token-budget", type=int, default=4096, help="tokens per packed batch")
    s.add_argument("--ttt-steps", type=int, default=3, help="training-time-test steps")
    s.add_argument("--ttt-decay", type=float, default=0.8, help="loss weight decay per training-time-test step")
    s.add_argument("--loss", choices=("feature+ce", "ce"), default="feature+ce",
                   help="EAGLE loss (EAGLE-3 always uses ce)")
    s.add_argument("--save-every", type=int, default=100,
                   help="optimizer steps between training-state checkpoints (what --resume continues); "
                        "the drafter weights are written when training ends")
    s.add_argument("--seed", type=int, default=0, help="random seed")
    s.set_defaults(fn=_cmd_warmup)


def _add_export(add: Callable[..., argparse.ArgumentParser]) -> None:
    """`tlt export` and its arguments."""
    s = add("export", help="write a drafter as an SGLang or vLLM serving checkpoint",
            description="Write a drafter from `tlt warmup` as the draft-model checkpoint SGLang's "
            "or vLLM's EAGLE loader reads: OUT/config.json and OUT/model.safetensors.")
    s.add_argument("--drafter", required=True, help="drafter directory (tlt_drafter.json, model.safetensors)")
    s.add_argument("--target", required=True, help="the target model directory the drafter was trained on")
    s.add_argument("--format", choices=("sglang", "vllm"), required=True, help="the serving engine's loader")
    s.add_argument("--out", required=True, help="directory to write (new or empty)")
    s.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="weights' dtype (default bfloat16)")
    s.add_argument("--overwrite", action="store_true", help="replace --out if it holds an earlier export")
    s.set_defaults(fn=_cmd_export)


def _add_rollout(add: Callable[..., argparse.ArgumentParser]) -> None:
    """`tlt rollout` and its arguments."""
    s = add("rollout", help="generate responses with elastic, tuned speculative decoding",
            description="GRPO-style rollout: --n samples per prompt (a group), drafted by the "
            "EAGLE drafter in --drafter or, without one, by the suffix drafter over the "
            "prompt, the request's own output and its group siblings. Lossless: outputs are "
            "distributed exactly as plain sampling from the target.")
    s.add_argument("--target", required=True, help="HF model directory")
    s.add_argument("--data", required=True, help="prompts: .json/.jsonl/.parquet")
    s.add_argument("--drafter", help="drafter directory from `tlt warmup` (default: suffix drafter)")
    s.add_argument("--n", type=int, default=1, help="samples per prompt (GRPO group size)")
    s.add_argument("--out", help="responses as JSONL")
    s.add_argument("--record", help="per-rollout record (JSON) for `tlt report`")
    s.add_argument("--max-prompts", type=int, default=0, help="use only the first N prompts (0 = all)")
    s.add_argument("--max-new-tokens", type=int, default=256, help="response length cap")
    s.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1 = off)")
    s.add_argument("--top-k", type=int, default=0, help="top-k sampling (0 = off)")
    s.add_argument("--arm", help="fixed strategy DEPTH,TOPK,TOKENS_TO_VERIFY (default: BEG-MAB tuner)")
    s.add_argument("--no-sd", action="store_true", help="plain autoregressive decoding")
    s.add_argument("--elastic-threshold", type=int, default=None,
                   help="speculate only while at most this many requests run (default: no cap, the "
                        "tuner learns per batch size where speculation stops paying)")
    s.add_argument("--seed", type=int, default=0, help="random seed")
    s.set_defaults(fn=_cmd_rollout)


def _add_report(add: Callable[..., argparse.ArgumentParser]) -> None:
    """`tlt report` and its arguments."""
    s = add("report", help="plot a rollout record (JSON) or a verl run's step records (tlt_steps.jsonl)")
    s.add_argument("record", help="a verl run's tlt_steps.jsonl, or the JSON of `tlt rollout --record`")
    s.add_argument("--out", default="rollout.png", help="image to write (default rollout.png; no suffix: .png)")
    s.set_defaults(fn=_cmd_report)


def _add_coordinator(add: Callable[..., argparse.ArgumentParser]) -> None:
    """`tlt coordinator` and its arguments."""
    try:  # pyzmq is a dependency, but a machine without a package index (the GPU check's) may lack it
        from tlt.coordinator.cli import DESCRIPTION, add_arguments
    except ImportError as e:
        s = add("coordinator", help=f"(unavailable here: {e})")
        s.set_defaults(fn=lambda a, e=e: sys.exit(f"tlt coordinator needs pyzmq ({e}): pip install pyzmq"))
    else:
        s = add("coordinator", help="run the ZeroMQ worker coordinator standalone", description=DESCRIPTION)
        add_arguments(s)
        s.set_defaults(fn=_cmd_coordinator)


def _add_doctor(add: Callable[..., argparse.ArgumentParser]) -> None:
    """`tlt doctor` and its arguments."""
    s = add("doctor", help="check an integration here: `tlt doctor sglang`",
            description="Apply TLT's SGLang hooks in this environment, as every SGLang process "
            "does at start, and report the SGLang version and each hook: applied or missing. "
            "Exit 1 if any is missing.")
    s.add_argument("what", choices=["sglang"])
    s.add_argument("--json", help="also write the report here (keys sglang_version, hooks_applied, hooks_missing)")
    s.set_defaults(fn=_cmd_doctor)


def _add_bench(add: Callable[..., argparse.ArgumentParser]) -> None:
    """`tlt bench` and its arguments."""
    s = add("bench", help="benchmarks that print side-by-side ratios and write JSON")
    from tlt.bench import BENCHES, MOVED, RENAMED

    s.add_argument("which", choices=sorted(BENCHES) + sorted(RENAMED) + sorted(MOVED),
                   metavar="{" + ",".join(sorted(BENCHES)) + "}",
                   help="the benchmark (old names still run: " + ", ".join(f"{o} -> {n}" for o, n in RENAMED.items())
                   + "; " + ", ".join(MOVED) + ": research experiments in examples/research/)")
    s.add_argument("--json", help="write the result record here")
    s.add_argument("--quick", action="store_true", help="smaller workload (for smoke tests)")
    s.add_argument("--seed", type=int, default=0, help="random seed")
    s.add_argument("--repeats", type=int, default=0,
                   help="rollout: timed repeats per variant (0: 5, or 1 with --quick); the paired ratios "
                   "to AR get a bootstrap 90%% interval; step-cost: alternating repeats (0: 5, or 2 with --quick)")
    s.add_argument("--threads", type=int, default=1,
                   help="rollout: torch threads (default 1: what each Ray-hosted replica of `tlt demo` gets, "
                   "and it leaves a core to the rest of the machine, which keeps the timing noise low; "
                   "0: torch's default)")
    s.add_argument("--target-steps", type=int, default=0, help=argparse.SUPPRESS)  # research's: refused
    s.add_argument("--shape", default="auto",
                   help="step-cost: target shape with random weights: demo, qwen2-1.5b or llama-8b (auto: "
                   "qwen2-1.5b on CUDA, demo on CPU)")
    s.add_argument("--batches", type=_batches, default=None,
                   help="step-cost: batch sizes to measure, comma-separated (default 1,8,32; 1,4 on a CPU); "
                   "larger ones extend the step-cost curve the cluster simulator reads")
    s.add_argument("--prompt-len", type=int, default=0,
                   help="step-cost: prompt tokens per request (0: 128, 16 with --quick; a value given is kept "
                   "with --quick too); 2048 or more: one engine at a time, "
                   "e.g. 32768 for the tail's length")
    s.add_argument("--new-tokens", type=int, default=0,
                   help="step-cost: tokens generated per request (0: 128, 16 with --quick)")
    s.add_argument("--baseline", action="store_true",
                   help="step-cost (long context): also time the engine with attention=torch (SDPA over the "
                   "whole cache, the engine before its block-table kernel) in the same run")
    s.add_argument("--block-size", type=int, default=0,
                   help="step-cost (long context): the engines keep a paged KV cache of blocks of this many "
                   "positions (0: one row of max_len slots per request)")
    s.add_argument("--sweep", action="store_true",
                   help="attention (CUDA): also time candidate launch shapes of the Triton kernel, best first "
                   "(TLT_ATTENTION_TUNING takes one as JSON)")
    s.add_argument("--mixed", action="store_true",
                   help="step-cost: add a batch of mixed lengths (1K to 32K) on a 32K cache")
    s.add_argument("--from", dest="runs_from", nargs="+", metavar="DIR",
                   help="demo: summarize these `tlt demo` output directories, each view where every run holds "
                   "its arms (ABC the main job, BCE tail consolidation, A and F tail batching) instead of running "
                   "the demo --repeats times (default 3); consolidation: that view alone (`--arms BCE` runs); "
                   "tail-batching: the one `tlt demo --arms ABCFGH` directory to read")
    s.add_argument("--add-to", metavar="RECORD",
                   help="demo: keep the runs of this earlier record (a main-job record of `tlt bench demo`, "
                   "e.g. docs/bench/demo_runs.json) before the new ones and read the figures across all; "
                   "--json RECORD writes the grown record back")
    s.add_argument("--validate", action="store_true",
                   help="cluster: predict a demo run's per-step rollout time (--from FIT_RUN PREDICT_RUN: step costs "
                   "from the first, lengths and measured times from the second) and report the error")
    s.add_argument("--measure-cpu", action="store_true",
                   help="cluster: measure this machine's step-cost curve first (tlt bench rollout, one repeat) and "
                   "simulate the CPU row on it instead of the recorded docs/bench/rollout.json")
    s.add_argument("--cpu-curve", metavar="JSON",
                   help="cluster: simulate the CPU row on a curve measured earlier (the *_cpu_curve.json that "
                   "--measure-cpu wrote), so a rerun changes nothing but what the simulator does")
    s.add_argument("--trace", help="sglang-tuner: verify trace to replay (recorded here first if the file "
                   "does not exist; without --trace a fresh one is recorded and not kept)")
    s.set_defaults(fn=_cmd_bench)


def _add_demo(add: Callable[..., argparse.ArgumentParser]) -> None:
    """`tlt demo` and its arguments."""
    s = add("demo", help="the main job: real verl GRPO on CPU, with and without TLT",
            description="Build and train the demo's deep, narrow target (cached), warm up an "
            "EAGLE drafter on its rollouts, export it for SGLang, then run verl 0.9.1's GRPO loop "
            "(2 rollout replicas, FSDP2 on gloo) three times on the same seeds, sampling the same "
            "tokens (coupled sampling): A) no speculation, B) TLT with the warm-up drafter "
            "frozen, C) full TLT with spot training. Writes OUT/summary.json and OUT/demo.png; "
            "each arm's verl log is in OUT/arm-X/verl.log. No network, no GPU; about 20 minutes "
            "on 2 cores the first time (--quick: a few minutes).")
    s.add_argument("--out", "--workdir", dest="out", default="runs/demo",
                   help="output directory (default runs/demo): new, empty, or an earlier demo's, which it replaces")
    s.add_argument("--quick", action="store_true", help="tiny sizes and 4 RL steps per arm, for tests")
    s.add_argument("--arms", default="ABC", help="which arms to run (default ABC; D: full TLT with the EAGLE "
                   "drafter only, no model-free drafter: `--arms ACD` measures what the model-free drafter adds; "
                   "E: full TLT without tail consolidation: `--arms BCE` measures what consolidation adds, on the "
                   "same seeds; "
                   "F, G, H: A, C, B with RollPacker's tail batching: `--arms ABCFGH`, then `tlt bench tail-batching "
                   "--from OUT`)")
    s.add_argument("--steps", type=int, default=None,
                   help="RL steps per arm (default 8: two epochs of the 32 prompts); more steps, more epochs")
    s.set_defaults(fn=_cmd_demo)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tlt", description="TLT: lossless speculative decoding for RL rollouts, with a drafter "
        "trained on idle rollout workers. Start with `tlt demo`.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    # the same two after the command (`tlt demo -q`); SUPPRESS: one given before it is kept
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging")
    common.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help="no progress bars")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def add(name: str, **kw) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], formatter_class=_Help, **kw)

    for add_command in (_add_make_target, _add_warmup, _add_export, _add_rollout, _add_report, _add_coordinator,
                        _add_doctor, _add_bench, _add_demo):  # (the order of `tlt --help`)
        add_command(add)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        args.fn(args)
    except ValueError as err:
        print(f"tlt {args.cmd}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a path the user gave that cannot be read or written
        where = f"{err.filename}: " if err.filename else ""
        print(f"tlt {args.cmd}: error: {where}{err.strerror or err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tlt {args.cmd}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
