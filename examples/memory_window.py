"""Paged vs static KV memory on one card, side by side: what each engine admits and decodes in a
fixed window (the memory issue's GPU check).

    python examples/memory_window.py [--card-gb 80] [--seconds 60] [--requests 64] [--json FILE] [--quick]

The Llama-8B shape with random bf16 weights (CUDA); ``--requests`` requests of 1K-token prompts and
response lengths drawn lognormal from the reasoning profile under a 32K budget
(:func:`tlt.sim.workloads.reasoning_lengths`), plain greedy decoding, every response forced to its
drawn length. Both engines size their KV as if the card had ``--card-gb`` (80: an H100's, also on
an H200): the weights and a reserve for activations come off first.
- **paged**: blocks of 16 positions, the pool of that many bytes, every request admitted (their
  budgets are not held, only the blocks they fill);
- **static**: one row of the whole budget per request, so it holds as many requests as rows fit
  and the rest wait.
Each runs ``engine.step()`` for ``--seconds`` (one engine alive at a time) and reports tokens per
second, peak device memory, the largest batch it ran, evictions and tokens recomputed.
``--quick``: the demo's shape on the CPU, small sizes (a smoke test).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time

import torch

from tlt.bench.step_cost import SHAPES, demo_shape
from tlt.drafter.model_config import ModelConfig
from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.generate import SamplingParams
from tlt.rollout.request import RequestState
from tlt.rollout.target import TargetModel
from tlt.sim.workloads import reasoning_lengths

log = logging.getLogger("memory_window")
RESERVE = 0.08  # of the card: activations, graphs and the allocator's slack


def window(model: TargetModel, states: list[RequestState], cfg: EngineConfig, seconds: float) -> dict:
    """Step one engine for ``seconds`` (its prefills included); decode tokens are what its steps committed."""
    cuda = next(model.parameters()).is_cuda
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    eng = RolloutEngine(model, cfg)
    eng.add([RequestState(s.prompt, s.params, seed=s.seed) for s in states])
    t0 = time.perf_counter()
    while eng.active and time.perf_counter() - t0 < seconds:
        eng.step()
    elapsed = time.perf_counter() - t0
    steps = eng.steps
    out = {"seconds": elapsed, "steps": len(steps), "tokens": sum(s.committed for s in steps),
           "largest_batch": max((s.batch for s in steps), default=0), "evicted": eng.lifecycle["evicted"],
           "recomputed_tokens": sum(s.recomputed for s in steps), "peak_blocks": eng.pool.peak if eng.pool else None,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
    eng.close()
    del eng
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--card-gb", type=float, default=80.0)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cuda = torch.cuda.is_available() and not a.quick
    dev, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    fields = SHAPES["llama-8b"] if cuda else demo_shape()
    prompt, budget, n = (1024, 32768, a.requests) if cuda else (16, 512, min(a.requests, 16))
    seconds = a.seconds if cuda else min(a.seconds, 5.0)
    lengths = reasoning_lengths(n, budget, seed=0)
    cfg_model = ModelConfig(**fields, max_position_embeddings=prompt + budget + 64)
    torch.manual_seed(0)
    with dev:
        model = TargetModel(cfg_model).to(dtype).eval()
    gen = torch.Generator().manual_seed(1)
    states = [RequestState(tuple(torch.randint(10, cfg_model.vocab_size, (prompt,), generator=gen).tolist()),
                           SamplingParams(max_new_tokens=m), seed=i) for i, m in enumerate(lengths)]
    max_len = prompt + budget + 1
    token_bytes = 2 * cfg_model.num_hidden_layers * cfg_model.num_key_value_heads * cfg_model.head_dim * (
        torch.finfo(dtype).bits // 8)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    card = 64 * 2**20  # (CPU: a pretend 64 MiB card)
    if cuda:  # GB as the card's makers count them, at most what this card has
        card = min(a.card_gb * 1e9, torch.cuda.get_device_properties(dev).total_memory)
    kv = int(card * (1 - RESERVE) - weights)
    if kv <= 0:
        raise ValueError(f"--card-gb {a.card_gb}: the weights ({weights / 2**30:.1f} GiB) leave no room for a KV cache")
    rows = max(1, min(n, kv // (max_len * token_bytes)))  # the static rows that fit
    log.info("%d requests (lengths: median %d, max %d), %s; KV room %.1f GiB: %d static rows", n,
             sorted(lengths)[n // 2], max(lengths), dev, kv / 2**30, rows)
    runs = {"paged": window(model, states, EngineConfig(max_batch=n, max_len=max_len, max_draft_tokens=0,
                                                        block_size=16, kv_bytes=kv), seconds),
            "static": window(model, states, EngineConfig(max_batch=rows, max_len=max_len, max_draft_tokens=0), seconds)}
    lines = [f"memory window: {n} requests of {prompt}-token prompts, reasoning-profile lengths under {budget} "
             f"(median {sorted(lengths)[n // 2]}), plain greedy, {fields['model_type']} "
             f"{cfg_model.num_hidden_layers} layers on {torch.cuda.get_device_name() if cuda else 'CPU'}; the KV sized "
             f"for a {a.card_gb:g} GB card ({kv / 2**30:.1f} GiB after the weights and a {RESERVE:.0%} reserve)"]
    for name, r in runs.items():
        lines.append(f"  {name:6s}: {r['tokens'] / r['seconds']:.0f} tokens/s over {r['seconds']:.0f} s "
                     f"({r['steps']} steps, batch up to {r['largest_batch']}), {r['evicted']} evictions, "
                     f"{r['recomputed_tokens']} tokens recomputed"
                     + (f", peak {r['peak_gib']:.1f} GiB" if r["peak_gib"] is not None else ""))
    lines.append(f"  paged / static tokens per second: "
                 f"{runs['paged']['tokens'] / runs['paged']['seconds'] / (runs['static']['tokens'] / runs['static']['seconds']):.2f}x")
    print("\n".join(lines))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bench": "memory-window", "card_gb": a.card_gb, "kv_bytes": kv, "static_rows": rows,
                       "requests": n, "lengths": lengths, "prompt_len": prompt, "budget": budget, "runs": runs,
                       "summary": lines}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
