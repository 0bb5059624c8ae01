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
"""

from __future__ import annotations

import argparse
import logging
import platform

import torch

from tlt.bench import torch_threads
from tlt.drafter.eagle import Drafter, DrafterConfig
from tlt.drafter.model_config import ModelConfig
from tlt.rollout.strategy import Arm
from tlt.rollout.target import TargetModel
from tlt.bench.rollout import fixed_batch

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
    prompt_len, new_tokens, repeats = (16, 16, 2) if quick else (
        getattr(args, "prompt_len", 0) or 128, 128, getattr(args, "repeats", 0) or 5)
    cfg = ModelConfig(**fields, max_position_embeddings=max(4096, prompt_len + new_tokens + 64))
    log.info("building a random-weight %s target on %s", shape, dev)
    with dev:
        model = TargetModel(cfg).to(dtype).eval()
        drafter = Drafter(DrafterConfig.for_target(cfg), model.embed_weight, model.lm_head.weight).to(dtype).eval()
    chain = Arm(4, 1, 4)
    gen = torch.Generator().manual_seed(args.seed)
    by_batch = {}
    batches = getattr(args, "batches", None) or ((1, 4) if quick or (shape == "demo" and not cuda) else (1, 8, 32))
    for b in batches:
        prompts = torch.randint(10, cfg.vocab_size, (b, prompt_len), generator=gen).tolist()
        log.info("batch %d", b)
        by_batch[b] = fixed_batch(model, drafter, prompts, new_tokens, chain, prompt_len + new_tokens + 8, repeats)
        by_batch[b]["draft_level_vs_plain"] = by_batch[b]["draft_ms"] / chain.depth / by_batch[b]["ar_step_ms"]
    n = sum(p.numel() for p in model.parameters())
    size = f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"
    where = torch.cuda.get_device_name() if cuda else platform.processor() or "CPU"
    lines = [f"step cost: random-weight {shape} target ({size} parameters, {dtype}) on {where}, "
             f"{torch.get_num_threads()} torch thread(s); {prompt_len}-token prompts, {new_tokens} new tokens, "
             f"chain {chain} by an untrained EAGLE drafter; medians over {repeats} alternating repeats"]
    for b, r in by_batch.items():
        lines.append(f"  batch {b:2d}: plain {r['ar_step_ms']:.2f} ms, speculative {r['sd_step_ms']:.2f} ms "
                     f"(draft {r['draft_ms']:.2f} + verify {r['verify_ms']:.2f}) = "
                     f"{r['sd_step_ms'] / r['ar_step_ms']:.2f}x a plain step; one draft level "
                     f"{r['draft_ms'] / chain.depth:.2f} ms = {r['draft_level_vs_plain']:.2f}x a plain step; "
                     f"with all {chain.depth} drafts accepted at most {r['all_accepted_limit']:.2f}x AR; "
                     f"lossless {r['lossless']}")
    if not all(r["lossless"] for r in by_batch.values()):
        if dtype == torch.float32:
            raise AssertionError("speculative output differs from plain decoding: not lossless")
        # bf16 random weights: near-tied logits round differently in a verify pass (Q tokens) than in a
        # plain step (1 token); the timings stand, token identity is the fp32 suites' to prove
        lines.append(f"  {dtype}: tokens differ from plain decoding at a near tie (the step's shapes round "
                     "differently); the fp32 runs and the losslessness suites prove token identity")
    return {"bench": "step-cost", "quick": quick, "shape": shape, "config": fields, "dtype": str(dtype),
            "device": str(dev), "chain": str(chain), "prompt_len": prompt_len, "by_batch": by_batch,
            "machine": {"python": platform.python_version(), "torch": torch.__version__,
                        "gpu": torch.cuda.get_device_name() if cuda else None}, "summary": lines}
