"""``tlt bench checkpoint``: training-loop stall of a selective async save vs a full sync save.

Model: an EAGLE drafter of a Llama-3-8B-shaped target (H=4096, I=14336, 32/8 heads, vocab 128256),
width-scaled to fit this machine (< 6 GB): hidden, intermediate, heads and vocab all scaled by
``s`` (1/2 full, 1/8 quick), so every tensor's bytes scale by ``s**2`` and the proportions between
the drafter, its Adam state and the target's embedding / LM head are exactly the 8B case's.

The stall is the time the training loop is blocked by checkpointing. Variants are interleaved
per round, each writes its own directory, fsync included:

* ``async`` — the spot trainer's CPU setting: selective state (drafter params + AdamW, fp32) with
  :class:`AsyncCheckpointer`; ``save()`` returns once the snapshot is copied into cached staging
  buffers, the write runs in the background.
* ``async_overlap`` — the CUDA setting (``overlap_staging``): the snapshot copy also runs in the
  background, overlapping the forward/backward; the loop blocks in ``save()`` plus
  ``wait_staged()`` before the optimizer step.
* ``full_sync`` — the paper's baseline: the same state plus the target's frozen embedding and LM
  head (bf16) that a full drafter state dict carries, written synchronously with ``dcp.save``.
* ``selective_sync`` — attribution only: selective bytes, synchronous.

The async variants sit in a real training step (packed TTT forward/backward + AdamW step) and
their ``effective`` stall adds how much slower that forward/backward ran than a plain one
(measured every round): on this CPU-only machine the background copy and write share the cores
and memory bandwidth with the compute; on a GPU box they do not (copy engine, idle host cores).
Background writes are waited for before the next variant so they do not disturb its timing (in
training they run during the following steps of the interval). The first async saves allocate
the staging buffers (first-touch page faults); they are reported apart (``cold``).
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tlt.drafter.async_checkpoint import AsyncCheckpointer
from tlt.drafter.checkpoint import (
    TrainState,
    save_sync,
    state_nbytes,
    step_dir,
)
from tlt.drafter.eagle import Drafter, DrafterConfig
from tlt.drafter.model_config import ModelConfig
from tlt.drafter.packing import FeatureSample, pack
from tlt.drafter.ttt import TTTConfig, ttt_forward

log = logging.getLogger(__name__)

LLAMA3_8B = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
             "num_hidden_layers": 32}
VARIANTS = ("async", "async_overlap", "full_sync", "selective_sync", "plain_step")


def scaled_target(scale: float) -> ModelConfig:
    """The 8B target with width, heads and vocab scaled by ``scale`` (head_dim kept)."""
    c = LLAMA3_8B
    heads = max(1, round(c["num_attention_heads"] * scale))
    return ModelConfig(model_type="llama", vocab_size=round(c["vocab_size"] * scale),
                       hidden_size=heads * c["head_dim"],
                       intermediate_size=round(c["intermediate_size"] * scale),
                       num_hidden_layers=c["num_hidden_layers"], num_attention_heads=heads,
                       num_key_value_heads=max(1, round(c["num_key_value_heads"] * scale)),
                       head_dim=c["head_dim"])


class _Loop:
    """A drafter training step on a fixed packed batch (fp32: this CPU has no fast bf16)."""

    def __init__(self, target: ModelConfig, tokens: int, seed: int) -> None:
        torch.manual_seed(seed)
        h, v = target.hidden_size, target.vocab_size
        compute_head = torch.randn(v, h) * h ** -0.5  # fp32 compute copy; embed and head tied
        self.drafter = Drafter(DrafterConfig.for_target(target), compute_head, compute_head)
        # What the target holds (and a full drafter state dict would carry): bf16 embed + head.
        self.frozen = {"embed_tokens.weight": compute_head.to(torch.bfloat16),
                       "lm_head.weight": torch.randn(v, h, dtype=torch.bfloat16)}
        self.opt = torch.optim.AdamW(self.drafter.parameters(), lr=1e-5, fused=True)
        n = tokens // 4
        self.batch = pack([FeatureSample(torch.randint(0, v, (n,)), torch.ones(n, dtype=torch.bool),
                                         torch.randn(n, h)) for _ in range(4)])
        self.ttt = TTTConfig(steps=1)

    def forward_backward(self) -> float:
        t0 = time.monotonic()
        ttt_forward(self.drafter, self.batch, self.ttt).loss(self.ttt).backward()
        return time.monotonic() - t0

    def optimizer_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _measure(loop: _Loop, variant: str, state: TrainState, ckpts: dict, roots: dict, full: dict,
             step: int) -> tuple[float, float]:
    """Returns (stall, forward/backward seconds; 0 for the sync saves, which train no step)."""
    if variant == "plain_step":
        fb = loop.forward_backward()
        loop.optimizer_step()
        return 0.0, fb
    if variant in ckpts:
        ck = ckpts[variant]
        stall = ck.save(step, {"train": state})
        fb = loop.forward_backward()
        stall += ck.wait_staged()
        loop.optimizer_step()
        ck.wait()  # see the module docstring: keep the next variant's timing clean
        return stall, fb
    stall = save_sync(roots[variant], step, full if variant == "full_sync" else {"train": state})
    shutil.rmtree(step_dir(roots[variant], step), ignore_errors=True)
    return stall, 0.0


def run(args: argparse.Namespace) -> dict:
    scale, rounds, tokens = (1 / 8, 2, 64) if args.quick else (1 / 2, 3, 32)
    target = scaled_target(scale)
    loop = _Loop(target, tokens, args.seed)
    loop.forward_backward()
    loop.optimizer_step()  # Adam's moments exist, as in any checkpoint after step 1
    state = TrainState(loop.drafter, loop.opt, frozen=(loop.drafter.embed_weight,))
    full = {"train": state, "frozen": loop.frozen}
    sel_bytes = state_nbytes(state.state_dict())
    full_bytes = sel_bytes + state_nbytes(loop.frozen)
    stall: dict[str, list[float]] = {k: [] for k in VARIANTS}
    fb: dict[str, list[float]] = {k: [] for k in VARIANTS}
    write_s: list[float] = []
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tlt-bench-ckpt-") as tmp:
        roots = {k: Path(tmp) / k for k in VARIANTS}
        ckpts = {"async_overlap": AsyncCheckpointer(roots["async_overlap"], keep_last=1,
                                                    overlap_staging=True),
                 "async": AsyncCheckpointer(roots["async"], keep_last=1)}
        try:
            cold = {k: _measure(loop, k, state, ckpts, roots, full, 0)[0] for k in ckpts}
            for r in range(1, rounds + 1):
                state.step = r
                order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
                for name in order:
                    s, f = _measure(loop, name, state, ckpts, roots, full, r)
                    stall[name].append(s)
                    fb[name].append(f)
                    log.info("round %d %-14s stall %.3fs fwd+bwd %.3fs", r, name, s, f)
                write_s.append(ckpts["async"].stats.write_s[-1])
        finally:
            for ck in ckpts.values():
                ck.close()
    stall.pop("plain_step")
    med = {k: statistics.median(v) for k, v in stall.items()}
    plain_fb = statistics.median(fb["plain_step"])
    slowdown = {k: max(0.0, statistics.median(fb[k]) - plain_fb) for k in ckpts}
    effective = {k: med[k] + slowdown[k] for k in ckpts}
    ratio = {k: med["full_sync"] / v for k, v in med.items()}
    ratio.update({f"{k}_effective": med["full_sync"] / v for k, v in effective.items()})
    gb = 1e9
    result = {
        "bench": "checkpoint", "quick": bool(args.quick), "seed": args.seed, "scale": scale,
        "model": {"hidden": target.hidden_size, "intermediate": target.intermediate_size,
                  "vocab": target.vocab_size, "heads": target.num_attention_heads,
                  "kv_heads": target.num_key_value_heads, "tokens_per_step": tokens,
                  "drafter_params": sum(p.numel() for p in loop.drafter.parameters())},
        "bytes": {"selective": sel_bytes, "full": full_bytes,
                  "selective_at_8b": sel_bytes / scale ** 2, "full_at_8b": full_bytes / scale ** 2},
        "rounds": rounds, "stall_s": stall, "stall_median_s": med, "stall_cold_s": cold,
        "fwd_bwd_s": fb, "fwd_bwd_slowdown_s": slowdown, "effective_stall_s": effective,
        "async_write_median_s": statistics.median(write_s),
        "ratio_full_sync_vs": ratio, "headline_ratio": ratio["async"],
        "goal_ratio": 10.0, "paper_ratio": 9.2, "seconds": time.monotonic() - t_start,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
        "loadavg_1m_end": os.getloadavg()[0],  # a busy shared host inflates every number
    }
    ms = {k: f"{v * 1e3:7.1f} ms" for k, v in med.items()}
    result["summary"] = [
        (f"checkpoint bench: EAGLE drafter of a Llama-3-8B-shaped target at width x{scale:g} "
        f"(H={target.hidden_size}, I={target.intermediate_size}, vocab {target.vocab_size}; "
        f"bytes x{scale ** 2:g} of the 8B case), {rounds} interleaved rounds, fsync on"),
        (f"  selective (drafter + AdamW, fp32) {sel_bytes / gb:.2f} GB; full (+ target embed/LM head, "
        f"bf16) {full_bytes / gb:.2f} GB  [at 8B: {sel_bytes / scale ** 2 / gb:.1f} / "
        f"{full_bytes / scale ** 2 / gb:.1f} GB]"),
        f"  full sync        stall {ms['full_sync']}",
        f"  selective sync   stall {ms['selective_sync']}   ({ratio['selective_sync']:.1f}x: selectivity alone)",
        (f"  selective async  stall {ms['async']}   ({ratio['async']:.1f}x; cold first save "
        f"{cold['async'] * 1e3:.0f} ms)"),
        (f"  async + overlap  stall {ms['async_overlap']}   ({ratio['async_overlap']:.1f}x; cold first save "
        f"{cold['async_overlap'] * 1e3:.0f} ms)"),
        (f"  full sync / selective async = {ratio['async']:.1f}x blocked (goal >= 10x, paper 9.2x); "
        f"background write {result['async_write_median_s']:.2f} s"),
        (f"  CPU contention (fwd/bwd {plain_fb:.2f} s plain): effective stall async "
        f"{effective['async'] * 1e3:.0f} ms = {ratio['async_effective']:.1f}x, overlap "
        f"{effective['async_overlap'] * 1e3:.0f} ms = {ratio['async_overlap_effective']:.1f}x"
        f"; host load avg {result['loadavg_1m_end']:.1f} on {os.cpu_count()} CPUs"),
    ]
    return result
