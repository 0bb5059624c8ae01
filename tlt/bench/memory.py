"""``tlt bench memory``: the paged KV cache at RL scale, through the engine's own allocator and scheduler.

Owns the memory bench. 256 requests (``--quick``: 32) of the demo target's shape (random weights,
plain greedy decoding, every response forced to its drawn length) with response lengths drawn
lognormal from the reasoning profile of :func:`tlt.sim.workloads.reasoning_lengths` under a 32K
budget, run at 1/16 of their lengths (``--quick``: 1/64) with 1-position blocks, each standing for
a 16-position (``--quick``: 64) block at full scale, so block counts carry over. Runs:
- the pool large enough for every request at once: the blocks the rollout really holds at peak;
- the pool at half that peak, once per victim rule of :mod:`tlt.rollout.eviction`: evictions,
  tokens recomputed, engine steps and seconds (the rule is chosen by these).
Blocks convert to bytes at the Llama-8B shape (128 KiB of keys and values per token, so 2 MiB per
16-position block), against a static cache of the same batch (every row holding the 32K budget),
and each gives the largest batch it holds in 80 GB less the weights (16.1 GB).
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from tlt.bench import torch_threads
from tlt.bench.step_cost import demo_shape
from tlt.drafter.model_config import ModelConfig
from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.eviction import RULES
from tlt.rollout.generate import SamplingParams
from tlt.rollout.target import TargetModel
from tlt.sim.workloads import reasoning_lengths

log = logging.getLogger(__name__)

BUDGET = 32768  # full-scale response budget
BLOCK = 16  # full-scale block size
PROMPT = 1024  # full-scale prompt length (TLT's example: 1K prompts, 32K responses)
LLAMA8B_TOKEN_BYTES = 32 * 2 * 8 * 128 * 2  # keys and values, every layer, bf16
CARD_BYTES, WEIGHT_BYTES = 80e9, 16.1e9


def rollout(model: TargetModel, lengths: list[int], prompt_len: int, budget: int, block: int, kv_blocks: int,
            rule: str, seed: int) -> dict:
    """One plain rollout of ``lengths`` on a paged engine of ``kv_blocks`` blocks."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(10, model.config.vocab_size, (len(lengths), prompt_len), generator=gen).tolist()
    cfg = EngineConfig(max_batch=len(lengths), max_len=prompt_len + budget + 1, max_draft_tokens=0, block_size=block,
                       kv_blocks=kv_blocks, eviction=rule)
    eng = RolloutEngine(model, cfg)
    t0 = time.perf_counter()
    res = eng.generate(prompts, [SamplingParams(max_new_tokens=n) for n in lengths])
    seconds = time.perf_counter() - t0
    assert [len(o) for o in res.outputs] == lengths
    return {"kv_blocks": kv_blocks, "peak_blocks": eng.pool.peak, "evictions": eng.lifecycle["evicted"],
            "recomputed_tokens": sum(s.recomputed for s in res.steps), "steps": len(res.steps), "seconds": seconds,
            "peak_batch": max(s.batch for s in res.steps), "outputs": res.outputs}


def run(args: argparse.Namespace) -> dict:
    with torch_threads(getattr(args, "threads", 0)):
        return _run(args)


def _run(args: argparse.Namespace) -> dict:
    quick = bool(args.quick)
    scale = 64 if quick else 16
    n = 32 if quick else 256
    budget, block, prompt_len = BUDGET // scale, max(1, BLOCK // scale), PROMPT // scale
    full_block = block * scale  # what one block here stands for
    lengths = reasoning_lengths(n, budget, seed=args.seed)
    fields = demo_shape()
    torch.manual_seed(args.seed)
    model = TargetModel(ModelConfig(**fields, max_position_embeddings=prompt_len + budget + 64)).eval()
    roomy = -(-(prompt_len + budget + 1) // block) * n  # every request's budget at once: never evicts
    log.info("%d requests, lengths up to %d (1/%d scale), blocks of %d", n, budget, scale, block)
    free = rollout(model, lengths, prompt_len, budget, block, roomy, RULES[0], args.seed)
    half = max(free["peak_blocks"] // 2, -(-(prompt_len + budget + 1) // block))
    by_rule = {}
    for rule in RULES:
        log.info("pool of %d blocks (half the peak), victims by %s", half, rule)
        r = rollout(model, lengths, prompt_len, budget, block, half, rule, args.seed)
        if r.pop("outputs") != free["outputs"]:
            raise AssertionError(f"evictions by {rule} changed the tokens: not lossless")
        by_rule[rule] = r
    free.pop("outputs")
    block_bytes = full_block * LLAMA8B_TOKEN_BYTES
    paged_peak = free["peak_blocks"] * block_bytes
    static_bytes = n * (PROMPT + BUDGET) * LLAMA8B_TOKEN_BYTES
    room = CARD_BYTES - WEIGHT_BYTES
    mem = {"block_bytes_llama8b": block_bytes, "paged_peak_bytes": paged_peak, "static_bytes": static_bytes,
           "static_over_paged": static_bytes / paged_peak,
           "largest_batch_static": int(room // ((PROMPT + BUDGET) * LLAMA8B_TOKEN_BYTES)),
           "largest_batch_paged": int(room // (paged_peak / n))}
    lines = [f"memory: {n} requests, reasoning-profile lengths (median {sorted(lengths)[n // 2] * scale}, max "
             f"{max(lengths) * scale} tokens at full scale) + {PROMPT}-token prompts, run at 1/{scale} scale, plain "
             f"decoding; Llama-8B bytes ({block_bytes / 2**20:.0f} MiB per {full_block}-token block)",
             f"  paged, room for all: peak {free['peak_blocks']} blocks = {paged_peak / 1e9:.1f} GB against "
             f"{static_bytes / 1e9:.0f} GB for a static cache of the same batch ({mem['static_over_paged']:.1f}x); "
             f"in {room / 1e9:.1f} GB: a static cache holds {mem['largest_batch_static']} such requests, the paged "
             f"one about {mem['largest_batch_paged']}; {free['steps']} steps, {free['seconds']:.1f} s"]
    for rule, r in by_rule.items():
        lines.append(f"  pool at half the peak ({half} blocks), victims {rule}: {r['evictions']} evictions, "
                     f"{r['recomputed_tokens'] * scale} tokens recomputed (full scale), {r['steps']} steps "
                     f"({r['steps'] / free['steps']:.2f}x), {r['seconds']:.1f} s; token-identical")
    return {"bench": "memory", "quick": quick, "scale": scale, "requests": n, "lengths": lengths,
            "prompt_len": prompt_len, "budget": budget, "block_size": block, "room_for_all": free,
            "half_pool": half, "by_rule": by_rule, "llama8b": mem, "summary": lines}
