"""``tlt bench step-cost``: plain vs speculative decode step on a random-weight target of a real shape.

What bounds speculative decoding on a machine is the cost of a speculative step (drafting plus a
verify pass over the draft) against a plain decode step: with every one of ``depth`` drafts
accepted, a step commits ``depth + 1`` tokens, so no rollout beats ``(depth + 1) x plain /
speculative``. Acceptance needs trained weights; step cost does not, so this bench builds a target
of a real model's shape with random weights (bf16 on CUDA, where the engine replays CUDA graphs;
fp32 on CPU) and an untrained EAGLE drafter for it, and times both engines at batch 1 / 8 / 32
(alternating, after a warm-up), checking the speculative tokens equal the plain ones (greedy).
``--shape demo`` is the demo's own target (read from its ``TargetSpec``), timed at batch 1 and 4 on
``--threads`` torch threads (1: what each Ray-hosted replica of ``tlt demo`` gets): whether the
demo is a faithful scale model of a GPU target (a verify costing about one plain step, a drafter
step about 1/L of one) is this figure.

Long context (``--prompt-len`` of 2048 or more, or ``--mixed``): one engine is alive at a time (two
static engines of 32K x 8 rows do not fit 80 GB), each runs one rollout of ``--new-tokens`` steps
after its prefill, and its step times are the median over the steps after the first
:data:`WARM_STEPS` (graph captures). ``--baseline`` also times the engine with ``attention="torch"``
(SDPA under an additive mask over the whole cache: what the engine ran before the block-table
kernel) in the same run, so no ratio improves by slowing the baseline. ``--mixed`` adds a batch of
:data:`MIXED` lengths (1K to 32K) on a 32K cache. ``--block-size N`` runs the engines on a paged KV
cache of N-position blocks. Each row records the peak device memory.
"""

from __future__ import annotations

import argparse
import gc
import logging
import platform
import statistics

import torch

from tlt.bench import torch_threads
from tlt.drafter.eagle import Drafter, DrafterConfig
from tlt.drafter.model_config import ModelConfig
from tlt.rollout.strategy import Arm
from tlt.rollout.target import TargetModel
from tlt.bench.rollout import fixed_batch
from tlt.rollout.attention import TUNINGS
from tlt.rollout.eagle_proposer import EagleProposer
from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.generate import SamplingParams

log = logging.getLogger(__name__)

SHAPES = {  # ModelConfig fields of public configs (no weights); "demo" is read from the demo's TargetSpec
    "qwen2-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                       num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                       qkv_bias=True, tie_word_embeddings=True),
    "llama-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}


def demo_shape() -> dict:
    """ModelConfig fields of ``tlt demo``'s target."""
    from tlt.demo.job import DEFAULT

    cfg = DEFAULT.target.model_config()
    return {k: getattr(cfg, k) for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                                         "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                         "head_dim", "qkv_bias", "qk_norm")}


WARM_STEPS = 4  # a long-context engine's first steps (graph captures) are left out of its medians
LONG = 2048  # prompts of at least this many tokens run one engine at a time
MIXED = (1024, 2048, 4096, 8192, 16384, 32768, 1024, 2048)


def one_engine_at_a_time(model: TargetModel, drafter: Drafter, prompts: list[list[int]], new_tokens: int, chain: Arm,
                         max_len: int, baseline: bool, block_size: int | None = None) -> dict:
    """Plain and speculative engines (and with ``baseline`` the same with ``attention="torch"``), one
    alive at a time, each one rollout: median step times after the warm-up steps, peak memory
    (``block_size``: a paged KV cache of blocks this size)."""
    b, cuda = len(prompts), torch.cuda.is_available()
    pa = [SamplingParams(max_new_tokens=new_tokens)] * b
    runs = {}
    for kernel in ("auto", "torch") if baseline else ("auto",):
        for name in ("AR", "SD"):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            prop = EagleProposer(drafter, max_batch=b, max_len=max_len + 64, attention=kernel) if name == "SD" else None
            eng = RolloutEngine(model, EngineConfig(max_batch=b, max_len=max_len, arm=chain if prop else None,
                                                    attention=kernel, block_size=block_size), proposer=prop)
            res = eng.generate(prompts, pa)
            steps = res.steps[WARM_STEPS:] or res.steps
            runs[(kernel, name)] = {"step_ms": 1e3 * statistics.median(x.seconds for x in steps),
                                    "draft_ms": 1e3 * statistics.median(x.draft_seconds for x in steps),
                                    "host_ms": 1e3 * statistics.median(x.host_seconds for x in steps),
                                    "outputs": res.outputs,
                                    "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
            log.info("%s %s: step %.2f ms", kernel, name, runs[(kernel, name)]["step_ms"])
            eng.close()  # graphs given back before the next engine captures
            del eng, prop
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    ar, sd = runs[("auto", "AR")], runs[("auto", "SD")]
    out = {"ar_step_ms": ar["step_ms"], "sd_step_ms": sd["step_ms"], "draft_ms": sd["draft_ms"],
           "verify_ms": sd["step_ms"] - sd["draft_ms"], "verify_vs_plain": (sd["step_ms"] - sd["draft_ms"]) / ar["step_ms"],
           "all_accepted_limit": (chain.depth + 1) * ar["step_ms"] / sd["step_ms"],
           "lossless": sd["outputs"] == ar["outputs"], "peak_gb": max(r["peak_gb"] or 0 for r in runs.values()) or None,
           "ar_host_ms": ar["host_ms"], "sd_host_ms": sd["host_ms"], "tuning": TUNINGS.as_dict()}
    if baseline:
        bar, bsd = runs[("torch", "AR")], runs[("torch", "SD")]
        out |= {"baseline_ar_step_ms": bar["step_ms"], "baseline_sd_step_ms": bsd["step_ms"],
                "baseline_draft_ms": bsd["draft_ms"], "baseline_verify_ms": bsd["step_ms"] - bsd["draft_ms"],
                "baseline_all_accepted_limit": (chain.depth + 1) * bar["step_ms"] / bsd["step_ms"],
                "plain_vs_baseline": ar["step_ms"] / bar["step_ms"]}
    return out


def run(args: argparse.Namespace) -> dict:
    with torch_threads(getattr(args, "threads", 0)):
        return _run(args)


def _run(args: argparse.Namespace) -> dict:
    quick = bool(args.quick)
    cuda = torch.cuda.is_available()
    shape = getattr(args, "shape", "auto") or "auto"
    if shape == "auto":
        shape = "qwen2-1.5b" if cuda and not quick else "demo"
    if shape != "demo" and shape not in SHAPES:
        raise ValueError(f"--shape {shape!r}: use auto, demo or one of {sorted(SHAPES)}")
    fields = demo_shape() if shape == "demo" else SHAPES[shape]
    dev, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    torch.manual_seed(args.seed)
    mixed = bool(getattr(args, "mixed", False))
    prompt_len, new_tokens, repeats = (16, 16, 2) if quick else (128, 128, 5)  # (--quick: its defaults only)
    prompt_len = getattr(args, "prompt_len", 0) or prompt_len
    new_tokens = getattr(args, "new_tokens", 0) or new_tokens
    repeats = getattr(args, "repeats", 0) or repeats
    longest = max(MIXED) if mixed and not quick else prompt_len
    long = mixed or prompt_len >= LONG
    cfg = ModelConfig(**fields, max_position_embeddings=max(4096, longest + new_tokens + 64))
    log.info("building a random-weight %s target on %s", shape, dev)
    with dev:
        model = TargetModel(cfg).to(dtype).eval()
        drafter = Drafter(DrafterConfig.for_target(cfg), model.embed_weight, model.lm_head.weight).to(dtype).eval()
    chain = Arm(4, 1, 4)
    gen = torch.Generator().manual_seed(args.seed)
    by_batch = {}
    batches = getattr(args, "batches", None) or ((1, 4) if quick or (shape == "demo" and not cuda) else (1, 8, 32))
    baseline = bool(getattr(args, "baseline", False))
    block_size = getattr(args, "block_size", 0) or None
    if block_size is not None and not long:
        raise ValueError(f"--block-size {block_size}: the paged cache is timed in long-context runs "
                         f"(--prompt-len {LONG} or more, or --mixed)")
    for b in batches:
        prompts = torch.randint(10, cfg.vocab_size, (b, prompt_len), generator=gen).tolist()
        log.info("batch %d", b)
        if long:
            by_batch[b] = one_engine_at_a_time(model, drafter, prompts, new_tokens, chain, prompt_len + new_tokens + 8,
                                               baseline, block_size)
        else:
            by_batch[b] = fixed_batch(model, drafter, prompts, new_tokens, chain, prompt_len + new_tokens + 8, repeats)
        by_batch[b]["draft_level_vs_plain"] = by_batch[b]["draft_ms"] / chain.depth / by_batch[b]["ar_step_ms"]
    mixed_row = None
    if mixed:
        lens = [16, 32, 64, 128, 256, 512, 16, 32] if quick else list(MIXED)
        prompts = [torch.randint(10, cfg.vocab_size, (n,), generator=gen).tolist() for n in lens]
        log.info("mixed lengths %s", lens)
        mixed_row = {"lengths": lens, **one_engine_at_a_time(model, drafter, prompts, new_tokens, chain,
                                                              max(lens) + new_tokens + 8, baseline, block_size)}
    how = (f"one engine at a time, medians over steps {WARM_STEPS + 1}+ of one rollout" if long else
           f"medians over {repeats} alternating repeats")
    setup = (f"{prompt_len}-token prompts, {new_tokens} new tokens, chain {chain} by an untrained EAGLE drafter; {how}"
             + (f"; a paged KV cache of {block_size}-position blocks" if block_size else ""))
    lines = _summary(model, shape, dtype, setup, chain, by_batch, mixed_row)
    return {"bench": "step-cost", "quick": quick, "shape": shape, "config": fields, "dtype": str(dtype),
            "device": str(dev), "chain": str(chain), "prompt_len": prompt_len, "new_tokens": new_tokens,
            "block_size": block_size, "by_batch": by_batch, "mixed": mixed_row,
            "machine": {"python": platform.python_version(), "torch": torch.__version__,
                        "gpu": torch.cuda.get_device_name() if cuda else None}, "summary": lines}


def _summary(model: TargetModel, shape: str, dtype: torch.dtype, setup: str, chain: Arm, by_batch: dict,
             mixed_row: dict | None) -> list[str]:
    """The bench's lines; fails in fp32 (not in bf16, where near ties round apart) if a row's
    speculative tokens left plain decoding's."""
    cuda = torch.cuda.is_available()
    n = sum(p.numel() for p in model.parameters())
    size = f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"
    where = torch.cuda.get_device_name() if cuda else platform.processor() or "CPU"
    lines = [f"step cost: random-weight {shape} target ({size} parameters, {dtype}) on {where}, "
             f"{torch.get_num_threads()} torch thread(s); {setup}"]
    rows = [(f"batch {b:2d}", r) for b, r in by_batch.items()]
    rows += [(f"mixed {mixed_row['lengths'][0]}..{max(mixed_row['lengths'])}", mixed_row)] if mixed_row else []
    for label, r in rows:
        lines.append(f"  {label}: plain {r['ar_step_ms']:.2f} ms, speculative {r['sd_step_ms']:.2f} ms "
                     f"(draft {r['draft_ms']:.2f} + verify {r['verify_ms']:.2f}) = "
                     f"{r['sd_step_ms'] / r['ar_step_ms']:.2f}x a plain step; one draft level "
                     f"{r['draft_ms'] / chain.depth:.2f} ms = {r['draft_ms'] / chain.depth / r['ar_step_ms']:.2f}x a "
                     f"plain step; with all {chain.depth} drafts accepted at most {r['all_accepted_limit']:.2f}x AR; "
                     f"lossless {r['lossless']}" + (f"; peak {r['peak_gb']:.1f} GiB" if r.get("peak_gb") else ""))
        if "baseline_ar_step_ms" in r:
            lines.append(f"    before (SDPA over the whole cache): plain {r['baseline_ar_step_ms']:.2f} ms, speculative "
                         f"{r['baseline_sd_step_ms']:.2f} ms (verify {r['baseline_verify_ms']:.2f}), at most "
                         f"{r['baseline_all_accepted_limit']:.2f}x AR; plain now / before "
                         f"{r['plain_vs_baseline']:.2f}")
    if not all(r["lossless"] for _, r in rows):
        if dtype == torch.float32:
            raise AssertionError("speculative output differs from plain decoding: not lossless")
        # bf16 random weights: near-tied logits round differently in a verify pass (Q tokens) than in a
        # plain step (1 token); the timings stand, token identity is the fp32 suites' to prove
        lines.append(f"  {dtype}: tokens differ from plain decoding at a near tie (the step's shapes round "
                     "differently); the fp32 runs and the losslessness suites prove token identity")
    return lines
