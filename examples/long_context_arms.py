"""Every speculative path at the tail's length: chain and tree arms, EAGLE and EAGLE-3, greedy and
sampled, on one request of a long prompt (default 32K tokens) of the Llama-8B shape (random bf16
weights on CUDA; a small shape in fp32 on CPU with --quick).

    python examples/long_context_arms.py [--prompt-len 32768] [--new-tokens 16] [--quick] [--json OUT]

Prints, per variant, its median step time, accepted drafts and whether its tokens equal plain
decoding's (random bf16 weights: a near tie between the verify and the plain step's rounding may
part them; the fp32 suites prove token identity), and the peak device memory. Exits 1 if a variant
fails to run, or (fp32) differs from plain decoding.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import statistics
import sys

import torch

from tlt.bench.step_cost import SHAPES, demo_shape
from tlt.drafter.eagle import Drafter, DrafterConfig
from tlt.drafter.model_config import ModelConfig
from tlt.rollout.eagle_proposer import EagleProposer
from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.generate import SamplingParams
from tlt.rollout.strategy import Arm
from tlt.rollout.target import TargetModel

log = logging.getLogger("long_context_arms")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-len", type=int, default=32768)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="the demo shape, 256-token prompts (CPU smoke test)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cuda = torch.cuda.is_available()
    dev, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    fields, plen = (demo_shape(), 256) if a.quick else (SHAPES["llama-8b"], a.prompt_len)
    max_len = plen + a.new_tokens + 8
    torch.manual_seed(0)
    cfg = ModelConfig(**fields, max_position_embeddings=max(4096, max_len + 64))
    with dev:
        target = TargetModel(cfg).to(dtype).eval()
        drafters = {m: Drafter(DrafterConfig.for_target(cfg, m), target.embed_weight, target.lm_head.weight).to(
            dtype).eval() for m in ("eagle", "eagle3")}
    prompt = torch.randint(10, cfg.vocab_size, (plen,), generator=torch.Generator().manual_seed(1)).tolist()
    rows, ok = [], True
    for temp in (0.0, 1.0):
        params = [SamplingParams(max_new_tokens=a.new_tokens, temperature=temp)]
        plain = None
        for method, arm in [(None, None)] + [(m, x) for m in drafters for x in (Arm(4, 1, 4), Arm(4, 2, 8))]:
            name = f"{method or 'plain'} {arm or ''} T={temp:g}".replace("  ", " ")
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            prop = EagleProposer(drafters[method], max_batch=1, max_len=max_len + 64) if method else None
            eng = RolloutEngine(target, EngineConfig(max_batch=1, max_len=max_len, arm=arm), proposer=prop)
            try:
                res = eng.generate([prompt], params, seeds=[7])
            except Exception as e:  # a variant that cannot run at this length is what this script looks for
                log.exception("%s failed", name)
                rows.append({"variant": name, "ran": False, "error": repr(e)})
                ok = False
                continue
            finally:
                eng.close()
            plain = res.outputs if method is None else plain
            row = {"variant": name, "ran": True, "step_ms": 1e3 * statistics.median(s.seconds for s in res.steps[2:]),
                   "accepted": sum(s.accepted for s in res.steps), "same_as_plain": res.outputs == plain,
                   "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
            ok &= row["same_as_plain"] or dtype != torch.float32
            rows.append(row)
            log.info("%-26s step %7.2f ms, %d drafts accepted, same as plain %s%s", name, row["step_ms"],
                     row["accepted"], row["same_as_plain"], f", peak {row['peak_gb']:.1f} GiB" if cuda else "")
            del eng, prop
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"prompt_len": plen, "dtype": str(dtype), "shape": "demo" if a.quick else "llama-8b",
                       "device": torch.cuda.get_device_name() if cuda else "cpu", "rows": rows}, f, indent=2)
    print(f"{sum(r['ran'] for r in rows)} of {len(rows)} variants ran at {plen} tokens" + ("" if ok else ": FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
