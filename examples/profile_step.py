"""Where a decode step's device time goes: the kernels of a few plain and speculative steps of a
model shape (random bf16 weights, CUDA), by total device time.

    python examples/profile_step.py [--shape llama-8b] [--prompt-len 32768] [--batch 8] [--steps 5] [--quick]

The Llama-8B shape at 32K and batch 8 shows where a long-context verify's time goes beyond its
attention; ``--shape demo --prompt-len 128`` at batch 1 and 4, why the demo target's verify at batch
4 costs what it costs at 32.

Graph replays hide their kernels from the profiler, so the engines run with ``cuda_graphs=False``
(the same kernels, launched one by one). --quick: the demo shape on CPU.
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from tlt.bench.step_cost import SHAPES, demo_shape
from tlt.drafter.eagle import Drafter, DrafterConfig
from tlt.drafter.model_config import ModelConfig
from tlt.rollout.eagle_proposer import EagleProposer
from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.generate import SamplingParams
from tlt.rollout.request import RequestState
from tlt.rollout.strategy import Arm
from tlt.rollout.target import TargetModel


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-8b", choices=["demo", *SHAPES])
    ap.add_argument("--prompt-len", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    shape = "demo" if a.quick else a.shape
    fields = demo_shape() if shape == "demo" else SHAPES[shape]
    plen = 128 if a.quick else a.prompt_len
    cfg = ModelConfig(**fields, max_position_embeddings=max(4096, plen + 128))
    torch.manual_seed(0)
    with dev:
        target = TargetModel(cfg).to(dtype).eval()
        drafter = Drafter(DrafterConfig.for_target(cfg), target.embed_weight, target.lm_head.weight).to(dtype).eval()
    gen = torch.Generator().manual_seed(1)
    states = [RequestState(tuple(torch.randint(10, cfg.vocab_size, (plen,), generator=gen).tolist()),
                           SamplingParams(max_new_tokens=64), seed=i) for i in range(a.batch)]
    max_len = plen + 72
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for name, arm in (("plain", None), ("speculative d4k1v4", Arm(4, 1, 4))):
        prop = EagleProposer(drafter, max_batch=a.batch, max_len=max_len + 64, cuda_graphs=False) if arm else None
        eng = RolloutEngine(target, EngineConfig(max_batch=a.batch, max_len=max_len, arm=arm, cuda_graphs=False,
                                                 static_shapes=True), proposer=prop)
        eng.add(states)
        for _ in range(4):  # the prefill, first proposals, compilations
            eng.step()
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for _ in range(a.steps):
                eng.step()
            if cuda:
                torch.cuda.synchronize()
        key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        print(f"== {shape}, {name}, batch {a.batch}, {plen}-token prompts: {a.steps} steps, kernels by device time")
        print(prof.key_averages().table(sort_by=key, row_limit=22, max_name_column_width=70))
        eng.close()
        del eng, prop
        gc.collect()  # the engine's cache goes now, before the next engine allocates its own
        if cuda:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
