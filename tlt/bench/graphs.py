"""``tlt bench graphs``: CUDA-graph counts and memory, bucketed vs naive vs single strategy.

Always: the planner's graph counts and the memory model (tlt.bench.graph_memory.estimate_parts) for
Qwen2.5-32B dims and the default buckets (TLT Table 3: 10.69 GB bucketed vs 30.39 GB naive, single
7.81 GB), with the engine's draft graphs (a whole EAGLE proposal per batch and arm). With a CUDA
device: captures both schemes for a small random-weight target and its EAGLE proposer's draft
loops and reports the measured graph-pool bytes next to the model's figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import platform
import time

import torch

from tlt.rollout.graph_pool import CudaGraphPool
from tlt.bench.graph_plan import GraphPlan, GraphPlanConfig, plan_graphs
from tlt.rollout.graphs import DraftLoopGraphKey, TargetGraphKey
from tlt.bench.graph_memory import QWEN25_32B, ModelDims, estimate_bytes, memory_report

log = logging.getLogger(__name__)
GB = 1e9


def _counts(plan: GraphPlan) -> dict:
    return {p: {"target": len(plan.graphs(p).target), "draft": len(plan.graphs(p).draft)}
            for p in ("bucketed", "naive")}


def _measure_cuda(plan: GraphPlan, *, quick: bool, seed: int) -> dict:
    """Capture both schemes for a small bf16 target; measured pool bytes vs the model's."""
    from tlt.drafter.eagle import Drafter, DrafterConfig
    from tlt.drafter.model_config import ModelConfig
    from tlt.rollout.eagle_proposer import EagleProposer
    from tlt.rollout.attention import AttnMeta
    from tlt.rollout.kv_cache import StaticKVCache
    from tlt.rollout.target import TargetModel

    torch.manual_seed(seed)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    layers, span = (4, 128) if quick else (8, 256)
    cfg = ModelConfig(model_type="qwen2", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                      head_dim=128, qkv_bias=True)
    target = TargetModel(cfg).to(dev, dtype).eval()
    drafter = TargetModel(dataclasses.replace(cfg, num_hidden_layers=1)).to(dev, dtype).eval()
    top = plan.config.capture_batch_sizes[-1]
    caches = {id(m): StaticKVCache(m.config.num_hidden_layers, top, cfg.num_key_value_heads, span,
                                   cfg.head_dim, dtype=dtype, device=dev) for m in (target, drafter)}
    eagle = Drafter(DrafterConfig.for_target(cfg), target.embed_weight, target.lm_head.weight).to(dev, dtype).eval()
    loop = EagleProposer(eagle, max_batch=top, max_len=span, static_shapes=True, cuda_graphs=False)
    features = torch.zeros(top, span, cfg.hidden_size, dtype=dtype, device=dev)

    def make_step(key):
        if isinstance(key, DraftLoopGraphKey):  # the engine's whole-proposal graph
            return loop.loop_graph_step(key, features)
        is_target = isinstance(key, TargetGraphKey)
        model, q = (target, key.query_tokens) if is_target else (drafter, key.topk)
        b, cache = key.batch, caches[id(model)]
        # [b, q] ids/positions, [b] cached tokens before them: all inputs are static buffers
        inputs = {"ids": torch.zeros(b, q, dtype=torch.long, device=dev),
                  "pos": torch.zeros(b, q, dtype=torch.long, device=dev),
                  "ctx": torch.zeros(b, dtype=torch.long, device=dev)}

        def fn(x):  # a chain of q tokens after ctx cached ones
            out = model(x["ids"], x["pos"], cache.backend(AttnMeta.rows(x["ctx"], q, span)))
            if is_target:
                return {"logits": out.logits.float(), "hidden": out.hidden}
            p, ids = out.logits.float().softmax(-1).topk(key.topk, dim=-1)
            return {"hidden": out.hidden, "p": p, "ids": ids}
        return inputs, fn

    pool = CudaGraphPool(make_step)
    seconds = {}
    try:
        for scheme in ("bucketed", "naive"):
            t0 = time.perf_counter()
            pool.capture(plan.graphs(scheme).keys, scheme=scheme)
            seconds[scheme] = time.perf_counter() - t0
        measured = pool.memory_report()
    finally:
        pool.close()
    model = memory_report(plan, ModelDims.from_config(cfg, dtype_bytes=2, logits_bytes=4))
    return {"device": torch.cuda.get_device_name(dev), "layers": layers, "hidden": cfg.hidden_size,
            "vocab": cfg.vocab_size, "kv_span": span, "capture_seconds": seconds, "measured": measured,
            "model": model.as_dict()}


def run(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    cfg = GraphPlanConfig()
    plan = plan_graphs(cfg)
    rep = memory_report(plan, QWEN25_32B)
    counts = _counts(plan)
    d = QWEN25_32B
    sizes = cfg.capture_batch_sizes
    lines = [f"graphs bench: Qwen2.5-32B dims (H{d.hidden_size} I{d.intermediate_size} "
             f"V{d.vocab_size}, {d.num_layers} layers, {d.num_heads}/{d.num_kv_heads} heads, bf16, "
             f"fp32 logits), {len(sizes)} captured sizes {sizes[0]}..{sizes[-1]}, "
             f"{len(cfg.buckets)} buckets, {len(cfg.all_arms)} arms",
             f"  graphs: bucketed {len(plan.bucketed)} ({counts['bucketed']['target']} target + "
             f"{counts['bucketed']['draft']} draft), naive {len(plan.naive)} "
             f"({counts['naive']['target']} + {counts['naive']['draft']}), single {rep.single_graphs}"]
    lines += rep.lines()
    by_size = {c: sum(estimate_bytes(k, d) for k in plan.bucketed.keys if k.batch == c) for c in sizes}
    lines.append("  bucketed GB by captured size: " + ", ".join(f"{c}:{b / GB:.2f}" for c, b in by_size.items()))
    threshold = 32  # an engine capped by EngineConfig(elastic_threshold=32) (default: no cap, learned)
    elastic = memory_report(plan_graphs(dataclasses.replace(cfg, speculate_max_batch=threshold)), d)
    lines.append(f"  SD graphs only up to a fixed elastic cap of {threshold}: naive {elastic.naive_bytes / GB:.2f}"
                 f" GB, bucketed {elastic.bucketed_bytes / GB:.2f} GB, single {elastic.single_bytes / GB:.2f} GB"
                 f" = {elastic.ratio:.2f}x")
    result = {"bench": "graphs", "quick": bool(args.quick), "capture_batch_sizes": list(sizes),
              "buckets": [[top, [str(a) for a in arms]] for top, arms in cfg.buckets],
              "arms_by_batch": {str(c): [str(a) for a in arms] for c, arms in plan.arms_by_batch},
              "counts": counts, "model_32b": rep.as_dict(),
              "bucketed_bytes_by_size": {str(c): b for c, b in by_size.items()},
              "elastic_threshold": threshold, "model_32b_elastic": elastic.as_dict(), "torch": torch.__version__,
              "machine": platform.machine()}
    if CudaGraphPool.available():
        small = plan if not args.quick else plan_graphs(
            dataclasses.replace(cfg, capture_batch_sizes=tuple(c for c in sizes if c <= 16)))
        m = _measure_cuda(small, quick=bool(args.quick), seed=args.seed)
        result["cuda"] = m
        meas, model = m["measured"], m["model"]
        lines.append(f"  measured on {m['device']} (H{m['hidden']}, {m['layers']} layers, V{m['vocab']}, "
                     f"random bf16): pool naive {meas['naive']['pool_bytes'] / GB:.2f} GB vs bucketed "
                     f"{meas['bucketed']['pool_bytes'] / GB:.2f} GB = {meas['ratio_pool_bytes']:.2f}x "
                     f"(device {meas['ratio_device_bytes']:.2f}x)")
        lines.append(f"  model for that target: private {model['naive_bytes'] / GB:.2f} / "
                     f"{model['bucketed_bytes'] / GB:.2f} GB = {model['ratio']:.2f}x, shared pool "
                     f"{model['naive_shared_bytes'] / GB:.2f} / {model['bucketed_shared_bytes'] / GB:.2f} GB "
                     f"= {model['shared_ratio']:.2f}x")
    else:
        lines.append("  measured: skipped (no CUDA device; the model figures above need none)")
    result["seconds"] = time.perf_counter() - t0
    result["summary"] = lines
    log.info("graphs bench done in %.2fs", result["seconds"])
    return result
