"""``tlt bench preempt``: how fast the spot trainer gives its GPU back when rollout needs it.

Runs real spot-trainer sessions (a 1-rank gloo world in this process, a fresh port each session,
each resuming from the previous session's checkpoint) on a small EAGLE drafter with long-tail
packed batches. A :class:`PreemptFlag` is raised from another thread at a random moment during
training (as the worker client does on the coordinator's PREEMPT), twice per draw, side by side:
stop checks once per micro-step (``preempt_s=None``) and once per ~25 ms chunk (the verl
integration's default ``tlt.spot.preempt_s``). Measured per session:

* ``exit``: flag set -> training loop exited (bound: the time between two stop checks, i.e. one
  micro-step or one chunk, plus the optimizer step / checkpoint save after a step's last one);
* ``durable``: flag set -> final checkpoint committed and the process group destroyed.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import random
import tempfile
import threading
import time

import numpy as np
import torch

from tlt.drafter.eagle import DrafterConfig
from tlt.drafter.model_config import ModelConfig
from tlt.drafter.packing import FeatureSample
from tlt.drafter.spot import PreemptFlag, SessionSpec, SpotConfig, run_session
from tlt.drafter.ttt import TTTConfig
from tlt.ports import free_port
from tlt.sim.workloads import lognormal_lengths

log = logging.getLogger(__name__)
CHUNK_S = 0.025  # the verl integration's default tlt.spot.preempt_s


class _LongTailStream:
    """Seeded long-tail samples filling ``token_budget`` per call (the same on every rank)."""

    def __init__(self, hidden: int, vocab: int, seed: int, on_first_call) -> None:
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.hidden, self.vocab, self.on_first_call = hidden, vocab, on_first_call

    def __call__(self, token_budget: int) -> list[FeatureSample]:
        if self.on_first_call is not None:
            self.on_first_call()
            self.on_first_call = None
        out, used = [], 0
        while True:
            (n,) = lognormal_lengths(1, self.rng, 96, 0.8, lo=16, hi=token_budget // 2)
            if used + n > token_budget:
                return out
            used += n
            mask = torch.arange(n) >= n // 4
            out.append(FeatureSample(torch.randint(0, self.vocab, (n,), generator=self.gen), mask,
                                     torch.randn(n, self.hidden, generator=self.gen)))


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def run(args: argparse.Namespace) -> dict:
    sessions, hidden, budget = (4, 128, 512) if args.quick else (40, 256, 1024)
    rng = random.Random(args.seed)
    target = ModelConfig(model_type="llama", vocab_size=2048, hidden_size=hidden,
                         intermediate_size=hidden * 11 // 4, num_hidden_layers=8,
                         num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                         head_dim=64)
    dcfg = DrafterConfig.for_target(target)
    g = torch.Generator().manual_seed(args.seed)
    embed = torch.randn(target.vocab_size, hidden, generator=g)
    head = torch.randn(target.vocab_size, hidden, generator=g) * hidden ** -0.5
    modes = {"micro-step": None, "chunked": CHUNK_S}  # SpotConfig.preempt_s: stop checks per micro-step / chunk
    cfgs = {m: SpotConfig(lr=1e-4, token_budget=budget, interval=4, keep_last=2, ttt=TTTConfig(steps=2),
                          seed=args.seed, preempt_s=p) for m, p in modes.items()}
    got = {m: {"exit": [], "durable": [], "gaps": [], "steps": []} for m in modes}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tlt-bench-preempt-") as root:
        for i in range(sessions):
            delay = rng.uniform(0.2, 1.0)
            for m in modes:  # interleaved, same data and flag time: a noisy host hits both alike
                flag = PreemptFlag()
                stream = _LongTailStream(hidden, target.vocab_size, args.seed * 1000 + i,
                                         lambda d=delay, f=flag: threading.Timer(d, f.set).start())
                r = run_session(spec=SessionSpec(rank=0, world_size=1, master_port=free_port(),
                                                 session_id=f"bench-{m}-{i}"),
                                config=cfgs[m], drafter_config=dcfg, embed_weight=embed, head_weight=head,
                                checkpoint_root=f"{root}/{m}", next_batch=stream, should_stop=flag)
                if r.stop_reason != "preempted" or r.preempt_latency_s is None:
                    raise RuntimeError(f"session {i} ({m}) ended with {r.stop_reason}, not by preemption")
                g = got[m]
                g["exit"].append(r.preempt_latency_s)
                g["durable"].append(r.stop_latency_s)
                g["gaps"].extend(r.check_interval_s)
                g["steps"].append(r.steps)
                log.info("session %d (%s): steps %d..%d, exit %.1f ms, durable %.1f ms", i, m, r.start_step,
                         r.end_step, r.preempt_latency_s * 1e3, r.stop_latency_s * 1e3)
    ms = 1e3
    result = {"bench": "preempt", "quick": bool(args.quick), "seed": args.seed, "sessions": sessions,
              "world_size": 1, "hidden": hidden, "token_budget": budget, "interval": cfgs["chunked"].interval,
              "chunk_s": CHUNK_S,
              "seconds": time.monotonic() - t_start, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "machine": platform.machine(),
              "loadavg_1m_end": os.getloadavg()[0]}  # a busy shared host inflates every number
    for m, g in got.items():
        result[m] = {"exit_s": g["exit"], "durable_s": g["durable"],
                     "exit_p50_s": _pct(g["exit"], 50), "exit_p99_s": _pct(g["exit"], 99),
                     "exit_max_s": max(g["exit"]), "durable_p50_s": _pct(g["durable"], 50),
                     "durable_p99_s": _pct(g["durable"], 99), "check_interval_p50_s": _pct(g["gaps"], 50),
                     "check_interval_p99_s": _pct(g["gaps"], 99),
                     "steps_per_session_mean": sum(g["steps"]) / len(g["steps"])}
    a, b = result["micro-step"], result["chunked"]
    result["exit_p99_ratio_micro_over_chunked"] = a["exit_p99_s"] / b["exit_p99_s"]
    result["summary"] = [
        (f"preempt bench: {sessions} x 2 spot sessions (1-rank gloo, EAGLE H={hidden}, {budget} tokens per "
         f"micro-step, TTT 2, checkpoint every {result['interval']} steps), flag raised at a random time while training;"
         f" stop checks per micro-step vs per ~{CHUNK_S * ms:.0f} ms chunk (tlt.spot.preempt_s)"),
        *(f"  {m:10s} between checks p50 {r['check_interval_p50_s'] * ms:6.1f} ms | flag -> loop exit p50 "
          f"{r['exit_p50_s'] * ms:6.1f} ms p99 {r['exit_p99_s'] * ms:6.1f} ms max {r['exit_max_s'] * ms:6.1f} ms"
          f" | -> durable p50 {r['durable_p50_s'] * ms:6.1f} ms | {r['steps_per_session_mean']:.1f} steps"
          for m, r in ((m, result[m]) for m in modes)),
        (f"  exit p99 micro-step / chunked: {result['exit_p99_ratio_micro_over_chunked']:.1f}x; host load avg "
         f"{result['loadavg_1m_end']:.1f} on {os.cpu_count()} CPUs"),
    ]
    return result
