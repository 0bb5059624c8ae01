"""``tlt bench rollout``: a long-tail rollout under AR, static strategies, the suffix drafter and BEG-MAB.

The workload: 64 requests (16 arithmetic prompts x 4 GRPO samples) on the trained tiny target,
with lognormal response lengths (the long tail), greedy so every variant must reproduce the AR
tokens exactly (checked: a mismatch fails the bench). A drafter is warmed up on the target's own
rollouts first (cached). Also measures SD speedup vs AR at batch 1 / 8 / 32 with a fixed chain,
and host <-> device transfers (:mod:`tlt.bench.transfer_count`) per plain and per speculative step.
Every variant runs between two AR rollouts, and its paired ratio is their mean time over its own
(the machine's speed drifts by tens of percent within a minute); a second, identical AR engine runs
as a control: its paired ratio is the run's noise floor.

Each variant's row also records where its last timed rollout's time went beyond its steady steps:
graph captures, Triton's kernel compiles (:mod:`tlt.bench.compiles`), and the steps that took over
``SLOW_STEP`` times the rollout's median step (a capture, a compile, a shape's first eager use; the
three overlap): where a tuner that cannot win loses its time.

``workloads.<name>.adaptive_vs_ar`` (tokens/s of the adaptive engine over AR's, same run):
``long_tail`` — EAGLE + BEG-MAB; ``ngram_siblings`` — the suffix drafter over the GRPO siblings +
BEG-MAB; ``random_drafter`` — an untrained EAGLE drafter + BEG-MAB, the worst case (it almost never
drafts the right token, so the tuner must learn to turn speculation off). Each BEG-MAB variant keeps
one tuner across its rollouts (an untimed warm-up rollout, then the timed repeats), and every
variant one engine, as a replica keeps its engine and tuner across RL steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import platform
import random
import statistics
from pathlib import Path

import torch

from tlt.bench import torch_threads
from tlt.bench.compiles import count_compiles
from tlt.bench.fixtures import demo_drafter, demo_target, paired_ci90, show_ci90
from tlt.drafter.eagle import Drafter
from tlt.rollout.eagle_proposer import EagleProposer
from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.generate import SamplingParams
from tlt.bench.transfer_count import count_per_call
from tlt.rollout.suffix import SuffixProposer
from tlt.rollout.strategy import Arm
from tlt.rollout.target import TargetModel
from tlt.rollout.tuner import BegMab, TunerConfig
from tlt.demo.corpus import CorpusConfig, make_corpus
from tlt.sim.workloads import lognormal_lengths
from tlt.tokenizer import TextTokenizer

log = logging.getLogger(__name__)
ENGINE_DEFAULT = Arm(5, 4, 7)  # SGLang-like: 5 steps, topk 4, 8 draft tokens incl. the root
STATIC_ARMS = (Arm(2, 1, 2), Arm(3, 1, 3), Arm(5, 1, 5), Arm(4, 2, 8), ENGINE_DEFAULT)


BLOCK = 16  # positions per block of the paged variants
SLOW_STEP = 5  # a step over this many times its rollout's median step: a capture, a compile, a first use


def paged_peak(prompt_lens: list[int], lengths: list[int], block: int) -> int:
    """Blocks a paged cache holds at plain decoding's peak when every request, started together,
    generates exactly ``lengths`` tokens: at step t, the requests still running hold their prompt,
    t tokens and the pending one."""
    return max(sum(-(-(p + t + 1) // block) for p, n in zip(prompt_lens, lengths) if n > t) for t in range(max(lengths)))


def fixed_batch(model: TargetModel, drafter: Drafter, prompts: list[list[int]], new_tokens: int, chain: Arm,
                max_len: int, repeats: int) -> dict:
    """A fixed chain vs AR at one batch size (no finishing requests): whole-rollout ratios, and the
    per-step components that bound the speedup on this machine: with accept length AL, a speculative
    step commits AL tokens per request where a plain one commits 1, so no rollout beats
    ``AL x plain step / speculative step``."""
    b = len(prompts)
    pa = [SamplingParams(max_new_tokens=new_tokens)] * b
    engines = {"AR": RolloutEngine(model, EngineConfig(max_batch=b, max_len=max_len)),
               "SD": RolloutEngine(model, EngineConfig(max_batch=b, max_len=max_len, arm=chain),
                                   proposer=EagleProposer(drafter, max_batch=b, max_len=max_len + 64))}
    for e in engines.values():  # warm-up, not timed
        e.generate(prompts, pa)
    times: dict[str, list[float]] = {"AR": [], "SD": []}
    step_s: dict[str, list[float]] = {"AR": [], "SD": [], "draft": [], "AR host": [], "SD host": []}
    outs = {}
    for rep in range(repeats):
        for name in (("AR", "SD") if rep % 2 == 0 else ("SD", "AR")):
            res = outs[name] = engines[name].generate(prompts, pa)
            times[name].append(res.seconds)
            step_s[name] += [s.seconds for s in res.steps]
            step_s[f"{name} host"] += [s.host_seconds for s in res.steps]
            if name == "SD":
                step_s["draft"] += [s.draft_seconds for s in res.steps]
    ar_step, sd_step, draft = (statistics.median(step_s[k]) for k in ("AR", "SD", "draft"))
    al = sum(outs["SD"].accept_lengths) / len(outs["SD"].accept_lengths)
    return {"ar_s": statistics.median(times["AR"]), "sd_s": statistics.median(times["SD"]),
            "speedup": statistics.median(times["AR"]) / statistics.median(times["SD"]),
            "paired": statistics.median(a / t for a, t in zip(times["AR"], times["SD"])),
            "mean_accept_length": al, "ar_step_ms": 1e3 * ar_step, "sd_step_ms": 1e3 * sd_step,
            "draft_ms": 1e3 * draft, "verify_ms": 1e3 * (sd_step - draft), "step_limit": al * ar_step / sd_step,
            "all_accepted_limit": (chain.depth + 1) * ar_step / sd_step,
            # host time per step: all but the wait in the step's one read (the rest is the device's)
            "ar_host_ms": 1e3 * statistics.median(step_s["AR host"]), "sd_host_ms": 1e3 * statistics.median(step_s["SD host"]),
            "lossless": outs["SD"].outputs == outs["AR"].outputs}


def run(args: argparse.Namespace) -> dict:
    with torch_threads(args.threads):
        return _run(args)


@dataclasses.dataclass(frozen=True)
class Workload:
    """The rollout every variant runs: the trained target, its warm-up drafter, and 64 requests (16
    prompts x 4 samples) with lognormal lengths (4 x 4, shorter, with --quick)."""

    model: TargetModel
    drafter: Drafter
    target_dir: Path
    drafter_dir: Path
    prompts: list[list[int]]
    groups: list[int]
    params: list[SamplingParams]
    n_prompts: int
    n_samples: int
    cap: int  # the longest response a request may get

    @property
    def max_len(self) -> int:
        return max(len(p) for p in self.prompts) + self.cap + 1


def _workload(quick: bool, seed: int) -> Workload:
    target_dir = demo_target(quick)
    drafter_dir = demo_drafter(target_dir, quick=quick)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CUDA: static shapes + graphs by default
    model = TargetModel.from_pretrained(target_dir, device=device)
    tok = TextTokenizer.from_pretrained(target_dir)
    drafter = Drafter.load(drafter_dir, model.embed_weight, model.lm_head.weight)
    rng = random.Random(seed)
    n_prompts, n_samples, median, cap = (4, 4, 24, 64) if quick else (16, 4, 96, 512)
    corpus = make_corpus(n_prompts, CorpusConfig(seed=seed + 4242))
    prompts, groups, params = [], [], []
    lengths = iter(lognormal_lengths(n_prompts * n_samples, rng, median, 1.0, lo=8, hi=cap))
    for g, p in enumerate(corpus):
        ids = tok.chat_prompt([{"role": "user", "content": p.prompt}])
        for _ in range(n_samples):
            prompts.append(ids)
            groups.append(g)
            params.append(SamplingParams(max_new_tokens=next(lengths)))  # no stop id: lengths are the tail
    return Workload(model, drafter, target_dir, drafter_dir, prompts, groups, params, n_prompts, n_samples, cap)


def _variants(w: Workload, seed: int) -> tuple[dict[str, RolloutEngine], int]:
    """One engine (and tuner) per variant, built once and reused by every rollout, as a replica keeps
    its engine and tuner across RL steps: buffers are allocated and first touched outside the timed
    runs. A second, identical AR engine: its paired ratio to AR is the run's noise floor. Also the
    blocks of the paged variant kept at half of plain decoding's peak."""
    model, bs, max_len = w.model, len(w.prompts), w.max_len

    def engine(arm=None, proposer=None, tuner=None, threshold=None, **paged):
        return RolloutEngine(model, EngineConfig(max_batch=bs, max_len=max_len, arm=arm,
                                                 elastic_threshold=threshold, seed=seed, **paged),
                             proposer=proposer, tuner=tuner)

    def eagle(drafter=w.drafter):
        return EagleProposer(drafter, max_batch=bs, max_len=max_len + 64)

    def mab() -> BegMab:
        return BegMab(TunerConfig.for_device(model.embed_weight.device.type, seed=seed))

    engines = {"AR": engine(), "AR again (control)": engine()}
    for arm in STATIC_ARMS:
        engines[f"EAGLE static {arm}"] = engine(arm=arm, proposer=eagle())
    engines["n-gram + BEG-MAB"] = engine(proposer=SuffixProposer(), tuner=mab())
    engines["EAGLE + BEG-MAB"] = engine(proposer=eagle(), tuner=mab())
    # the cost of the drafter being there at all: attached, speculation never on
    engines["EAGLE proposer, SD off"] = engine(arm=Arm.off(), proposer=eagle())
    torch.manual_seed(seed)
    untrained = Drafter(w.drafter.config, model.embed_weight, model.lm_head.weight).to(model.embed_weight.device)
    engines["random drafter + BEG-MAB"] = engine(proposer=eagle(untrained), tuner=mab())
    engines["EAGLE + BEG-MAB, fixed elastic 32"] = engine(proposer=eagle(), tuner=mab(), threshold=32)
    # memory: a paged cache of 16-position blocks, roomy, and at half of plain decoding's peak (every
    # length is its budget here, so the peak is known before the run), where requests are evicted
    peak = paged_peak([len(p) for p in w.prompts], [p.max_new_tokens for p in w.params], BLOCK)
    engines["AR, paged"] = engine(block_size=BLOCK)
    half = max(peak // 2, -(-(max_len + EngineConfig().max_draft_tokens) // BLOCK))
    engines["AR, paged, half its peak"] = engine(block_size=BLOCK, kv_blocks=half)
    return engines, half


def _timed_rollouts(w: Workload, engines: dict[str, RolloutEngine], repeats: int, seed: int) -> dict[str, dict]:
    """Every variant's rollouts, each between two AR rollouts and paired with their mean (the
    machine's speed drifts by tens of percent over tens of seconds, and the flanks cancel a linear
    drift within ~4 s), after an untimed warm-up of every variant; a row per variant."""
    for e in engines.values():  # warm-up, not timed: allocator and caches; each tuner's first rollout
        e.generate(w.prompts, w.params, w.groups)
    rows: dict[str, dict] = {}
    times: dict[str, list[float]] = {name: [] for name in engines}
    flank: dict[str, list[float]] = {name: [] for name in engines}  # per repeat: AR just before + after
    ref = None

    def timed(name: str) -> float:  # one rollout, checked against AR's tokens; its seconds
        nonlocal ref
        with count_compiles() as compiles:
            res = engines[name].generate(w.prompts, w.params, w.groups)
        if ref is None:
            ref = res.outputs
        elif res.outputs != ref:
            raise AssertionError(f"{name}: output differs from AR - speculative decoding was not lossless")
        times[name].append(res.seconds)
        al = res.accept_lengths
        med = statistics.median(s.seconds for s in res.steps)
        slow = [s.seconds for s in res.steps if s.seconds > SLOW_STEP * med]  # captures, compiles, first uses
        rows[name] = {"tokens": res.tokens, "sd_steps": sum(s.sd for s in res.steps),
                      "capture_s": sum(s.capture_seconds for s in res.steps), "slow_steps": len(slow),
                      "compiles": compiles.count, "compile_s": compiles.seconds,
                      "slow_steps_s": sum(slow), "median_step_s": med,
                      "steps": len(res.steps), "mean_accept_length": sum(al) / len(al) if al else None,
                      "kv_peak_positions": max(s.positions for s in res.steps),
                      "kv_peak_blocks": max(s.blocks for s in res.steps),
                      "evicted": sum(s.evicted for s in res.steps), "recomputed": sum(s.recomputed for s in res.steps)}
        log.info("%s: %.1fs", name, res.seconds)
        return res.seconds

    others = [name for name in engines if name != "AR"]
    for rep in range(repeats):
        before = timed("AR")
        for name in (others if rep % 2 == 0 else others[::-1]):
            timed(name)
            after = timed("AR")
            flank[name].append((before + after) / 2)
            before = after
    flank["AR"] = times["AR"]
    for name, r in rows.items():
        r["seconds_all"] = times[name]
        r["seconds"] = statistics.median(times[name])
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
    ar = rows["AR"]["tokens_per_s"]
    for name, r in rows.items():
        r["speedup_vs_ar"] = r["tokens_per_s"] / ar
        # per repeat, over the flanking AR rollouts (paired: slow phases of the machine cancel)
        r["paired_vs_ar"] = statistics.median(a / t for a, t in zip(flank[name], times[name]))
        r["paired_vs_ar_ci90"] = paired_ci90(flank[name], times[name], seed)
    return rows


def _transfers(w: Workload) -> dict[str, int]:
    """Host <-> device transfers, the most any step made (prefill excluded): batch 8, 64 new tokens,
    log-probs included, plain, greedy speculative and sampled speculative."""
    out = {}
    for name, arm, temp in (("ar", None, 0.0), ("sd", Arm(3, 1, 3), 0.0), ("sampled", Arm(3, 1, 3), 1.0)):
        eng = RolloutEngine(w.model, EngineConfig(max_batch=8, max_len=w.max_len, arm=arm, elastic_threshold=8),
                            proposer=EagleProposer(w.drafter, max_batch=8, max_len=w.max_len + 64) if arm else None)
        params = [SamplingParams(max_new_tokens=64, temperature=temp)] * 8
        eng.generate(w.prompts[:8], params)  # CUDA: captures
        with count_per_call(eng, "_step", eng.device) as calls:  # the steady state: graphs replayed
            eng.generate(w.prompts[:8], params)
        out[name] = max(c.total for c in calls)
    return out


def _run(args: argparse.Namespace) -> dict:
    quick = bool(args.quick)
    w = _workload(quick, args.seed)
    repeats = args.repeats or (1 if quick else 5)
    engines, half = _variants(w, args.seed)
    rows = _timed_rollouts(w, engines, repeats, args.seed)
    best_static = max((k for k in rows if k.startswith("EAGLE static")), key=lambda k: rows[k]["paired_vs_ar"])
    chain, bs = Arm(5, 1, 5), len(w.prompts)
    by_batch = {b: fixed_batch(w.model, w.drafter, [w.prompts[(i * w.n_samples) % bs] for i in range(b)],
                                32 if quick else 128, chain, w.max_len, repeats)
                for b in ((1, 4) if quick else (1, 4, 8, 32))}
    transfers = _transfers(w)
    workloads = {"long_tail": "EAGLE + BEG-MAB", "ngram_siblings": "n-gram + BEG-MAB",
                 "random_drafter": "random drafter + BEG-MAB"}
    workloads = {k: {"variant": v, "adaptive_vs_ar": rows[v]["speedup_vs_ar"],
                     "adaptive_vs_ar_paired": rows[v]["paired_vs_ar"],
                     "adaptive_vs_ar_paired_ci90": rows[v]["paired_vs_ar_ci90"]} for k, v in workloads.items()}
    workloads["long_tail"]["adaptive_vs_best_static"] = (rows["EAGLE + BEG-MAB"]["paired_vs_ar"]
                                                         / rows[best_static]["paired_vs_ar"])
    static = bs * engines["AR"].cfg.slots
    ctl = rows["AR again (control)"]
    return {"bench": "rollout", "quick": quick, "requests": bs, "repeats": repeats, "variants": rows, "best_static": best_static,
            "by_batch": by_batch, "workloads": workloads, "control_paired_vs_ar": ctl["paired_vs_ar"],
            "control_paired_vs_ar_ci90": ctl["paired_vs_ar_ci90"],
            "transfers_per_step_max": transfers, "kv": {"block_size": BLOCK, "static_positions": static,
                                                        "half_blocks": half}, "target": str(w.target_dir), "drafter": str(w.drafter_dir),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
            "summary": _summary(w, rows, best_static, by_batch, workloads, transfers, chain, static, half, repeats)}


def _summary(w: Workload, rows: dict, best_static: str, by_batch: dict, workloads: dict, transfers: dict,
             chain: Arm, static: int, half: int, repeats: int) -> list[str]:
    def vs(a: str, b: str) -> float:  # variant a over variant b, each relative to its flanking AR rollouts
        return rows[a]["paired_vs_ar"] / rows[b]["paired_vs_ar"]

    tuned = "EAGLE + BEG-MAB"
    lines = [f"rollout bench ({repeats} repeats after an untimed warm-up of every variant, each variant between "
             "two AR rollouts and paired with their mean, medians; "
             f"each variant keeps its engine and tuner across rollouts, as across RL steps): {len(w.prompts)} requests "
             f"({w.n_prompts} prompts x {w.n_samples}), response lengths "
             f"{min(p.max_new_tokens for p in w.params)}..{max(p.max_new_tokens for p in w.params)} (lognormal), "
             f"greedy, {torch.get_num_threads()} torch thread(s), target {w.target_dir.name}; every variant "
             "reproduced the AR tokens exactly"]
    for k, r in rows.items():
        al = f"AL {r['mean_accept_length']:.2f}" if r["mean_accept_length"] else "        "
        lines.append(f"  {k:34s} {r['tokens_per_s']:7.0f} tok/s  {r['speedup_vs_ar']:5.2f}x AR "
                     f"(paired {r['paired_vs_ar']:4.2f}x)  {al}  "
                     f"SD steps {r['sd_steps']}/{r['steps']}; captures {r['capture_s']:.2f} s, "
                     f"{r['compiles']} kernel compiles {r['compile_s']:.2f} s, "
                     f"{r['slow_steps']} steps over {SLOW_STEP}x the median {r['slow_steps_s']:.2f} s")
    lines.append(f"  EAGLE+BEG-MAB (paired ratios) vs best static ({best_static}): {vs(tuned, best_static):.2f}x, "
                 f"vs default static {ENGINE_DEFAULT}: {vs(tuned, f'EAGLE static {ENGINE_DEFAULT}'):.2f}x, "
                 f"vs a fixed elastic switch at 32: {vs(tuned, 'EAGLE + BEG-MAB, fixed elastic 32'):.2f}x, "
                 f"vs AR: {rows[tuned]['paired_vs_ar']:.2f}x")
    ctl = rows["AR again (control)"]
    lines.append(f"  noise floor: an identical AR engine measured {ctl['paired_vs_ar']:.2f}x paired "
                 f"({show_ci90(ctl['paired_vs_ar_ci90'])})")
    lines.append("  adaptive vs AR: " + ", ".join(
        f"{k} {r['adaptive_vs_ar']:.2f}x (paired {r['adaptive_vs_ar_paired']:.2f}x, "
        f"{show_ci90(r['adaptive_vs_ar_paired_ci90'])})" for k, r in workloads.items())
                 + f"; host<->device transfers per step (most): plain {transfers['ar']}, speculative "
                 f"{transfers['sd']} (greedy), sampled speculative {transfers['sampled']} (T=1, shared-noise drafts)")
    pg, hf = rows["AR, paged"], rows["AR, paged, half its peak"]
    lines.append(f"  KV memory: a static cache of {len(w.prompts)} rows holds {static:,} positions; plain decoding's peak held "
                 f"{rows['AR']['kv_peak_positions']:,} ({100 * rows['AR']['kv_peak_positions'] / static:.0f}%); paged "
                 f"({BLOCK}-position blocks): peak {pg['kv_peak_blocks']:,} blocks = "
                 f"{100 * pg['kv_peak_blocks'] * BLOCK / static:.0f}% of the static cache, paired "
                 f"{pg['paired_vs_ar']:.2f}x AR; at {half:,} blocks: {hf['evicted']} evictions, "
                 f"{hf['recomputed']:,} tokens recomputed, {hf['steps']} steps (AR {rows['AR']['steps']}), "
                 f"paired {hf['paired_vs_ar']:.2f}x AR")
    for b, r in by_batch.items():
        lines.append(f"  batch {b:2d}: SD {chain} vs AR {r['speedup']:.2f}x (paired {r['paired']:.2f}x; AL "
                     f"{r['mean_accept_length']:.2f}; step: plain {r['ar_step_ms']:.2f} ms, speculative "
                     f"{r['sd_step_ms']:.2f} ms = draft {r['draft_ms']:.2f} + verify {r['verify_ms']:.2f}, host "
                     f"{r['ar_host_ms']:.2f} / {r['sd_host_ms']:.2f} ms; "
                     f"step-level limit AL x plain / speculative = {r['step_limit']:.2f}x; lossless {r['lossless']})")
    return lines
