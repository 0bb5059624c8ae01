"""``tlt bench packing``: drafter training tokens/s, packed vs padded, on long-tail lengths."""

from __future__ import annotations

import argparse
import logging
import platform
import random
import statistics
import time

import torch

from tlt.drafter.eagle import Drafter, DrafterConfig
from tlt.drafter.model_config import ModelConfig
from tlt.drafter.packing import FeatureSample, pack, pack_by_budget, pad
from tlt.drafter.ttt import TTTConfig, ttt_forward
from tlt.sim.workloads import lognormal_lengths

log = logging.getLogger(__name__)


def _train_pass(drafter: Drafter, batches, ttt: TTTConfig, opt: torch.optim.Optimizer) -> None:
    for batch in batches:
        loss = ttt_forward(drafter, batch, ttt).loss(ttt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def run(args: argparse.Namespace) -> dict:
    """Drafter training tokens/s: packed (token budget) vs padded (same samples, same order)."""
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    n, budget, repeats = (48, 4096, 2) if args.quick else (160, 16384, 3)
    hi = 1024 if args.quick else 4096
    h = 128
    target = ModelConfig(model_type="llama", vocab_size=512, hidden_size=h, intermediate_size=352,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    lengths = lognormal_lengths(n, rng, 256, 1.0, lo=64, hi=hi)
    samples = [FeatureSample(torch.randint(0, 512, (L,)), torch.arange(L) >= L // 4, torch.randn(L, h))
               for L in lengths]
    real_tokens = sum(lengths)
    batch_size = max(1, round(budget / statistics.mean(lengths)))  # same mean real tokens per step
    ttt = TTTConfig(steps=1)
    packed = [pack(g) for g in pack_by_budget(samples, budget)]
    padded = [pad(samples[i: i + batch_size]) for i in range(0, n, batch_size)]
    by_len = sorted(samples, key=len)
    bucketed = [pad(by_len[i: i + batch_size]) for i in range(0, n, batch_size)]
    variants: dict[str, list] = {"packed": packed, "padded": padded, "padded_sorted": bucketed}
    times: dict[str, list[float]] = {k: [] for k in variants}
    embed = torch.randn(512, h) * 0.02
    drafter = Drafter(DrafterConfig.for_target(target), embed, embed)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    _train_pass(drafter, packed[:1], ttt, opt)  # warm-up allocations
    for r in range(repeats):
        names = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in names:
            t0 = time.perf_counter()
            _train_pass(drafter, variants[name], ttt, opt)
            times[name].append(time.perf_counter() - t0)
            log.info("repeat %d %s: %.2fs", r, name, times[name][-1])
    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: real_tokens / med[k] for k in med}
    slots = {"packed": sum(b.input_ids.numel() for b in packed),
             "padded": sum(b.input_ids.numel() for b in padded),
             "padded_sorted": sum(b.input_ids.numel() for b in bucketed)}
    result = {
        "bench": "packing", "quick": bool(args.quick), "samples": n, "real_tokens": real_tokens,
        "length_min": min(lengths), "length_median": statistics.median(lengths), "length_max": max(lengths),
        "token_budget": budget, "padded_batch_size": batch_size, "repeats": repeats,
        "ttt_steps": ttt.steps, "seconds_median": med, "tokens_per_s": tps,
        "pad_fraction": {k: 1 - real_tokens / v for k, v in slots.items()},
        "ratio_packed_vs_padded": tps["packed"] / tps["padded"],
        "ratio_packed_vs_padded_sorted": tps["packed"] / tps["padded_sorted"],
        "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
    }
    lines = [f"packing bench: {n} samples, lengths {min(lengths)}..{max(lengths)} (median "
             f"{statistics.median(lengths):.0f}), {real_tokens} tokens, budget {budget}, "
             f"padded batch {batch_size}"]
    lines += [f"  {k:14s} {tps[k]:9.0f} tok/s  (pad {result['pad_fraction'][k]:.0%}, "
              f"median {med[k]:.2f}s)" for k in variants]
    lines.append(f"  packed / padded = {result['ratio_packed_vs_padded']:.2f}x   "
                 f"packed / padded-sorted = {result['ratio_packed_vs_padded_sorted']:.2f}x")
    result["summary"] = lines
    return result

