"""``tlt bench sglang-tuner``: TLT's SGLang tuner on a recorded verify trace, and its graph plan.

A *verify trace* holds, per batch size and draft step count (SGLang's EAGLE chain: topk 1,
``steps + 1`` verified tokens; 0 = plain decode), the measured steps of the project's own engine:
wall seconds and accepted drafts per request. Recording (``--trace F`` when F does not exist, or no
``--trace``) runs the trained tiny target with the warm-up EAGLE drafter at each (batch, steps),
greedy, every request equally long so the batch stays put.

Replay: long-tail rollouts (lognormal response lengths) step by step; a step at ``bs`` running
requests with ``s`` steps draws a recorded step time and per-request accepted drafts from the
trace at the nearest recorded batch size not above ``bs``. The tuner is driven through SGLang
0.5.23's call sequence with its overlap scheduler: ``set_cuda_graph_bs`` once, then per decode
batch ``get_steps_for_batch`` for the next batch *before* ``on_verify_complete`` of the previous
one, on a virtual clock advanced by the recorded step times. Variants on the same lengths and seeds:

* per-batch-size oracle: at every step the step count with the best expected committed tokens per
  second at that batch size, over every recorded step count (hindsight, no noise);
* the same oracle restricted to the step counts each slot offers (the tuner's ceiling);
* TLT's tuner (BEG-MAB per slot), static step counts, and AR.

Graph plan: SGLang captures, per step count, a draft graph (``s`` steps of one token per request),
a verify graph (``s + 1`` tokens per request) and a draft-extend graph, at each CUDA-graph batch
size. ``cuda_graph_bs_for_step`` captures a step count only where its slot offers it; naive
capture takes every step count at every size. Bytes come from :func:`tlt.bench.graph_memory.estimate_parts`
(a model, not a measurement: the capture needs a GPU) for Qwen2.5-32B dimensions.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from tlt.bench.graph_plan import DraftGraphKey
from tlt.rollout.graphs import TargetGraphKey
from tlt.bench.graph_memory import QWEN25_32B, ModelDims, estimate_parts
from tlt.integrations.sglang.adaptive import DEFAULT_SLOTS, AdaptiveTuner, SlotsConfig, describe
from tlt.sim.workloads import lognormal_lengths

log = logging.getLogger(__name__)

RECORD_BATCHES = (1, 2, 4, 8, 16, 32)
RECORD_STEPS = (0, 1, 2, 3, 5, 7)
# SGLang's CUDA-graph batch sizes in speculative mode (ServerArgs._generate_cuda_graph_batch_sizes)
# up to its default max-running-requests there (48)
SGLANG_SPEC_GRAPH_BS = tuple(range(1, 9)) + tuple(range(10, 33, 2)) + tuple(range(36, 49, 4))
Trace = dict[int, dict[int, list[tuple[float, list[int]]]]]  # bs -> steps -> [(seconds, accepts)]


# --------------------------------------------------------------------------- recording
def record_trace(*, quick: bool, seed: int) -> dict:
    """Measure (seconds, accepted drafts per request) per step at each batch size and step count."""
    import torch

    from tlt.drafter.eagle import Drafter
    from tlt.rollout.eagle_proposer import EagleProposer
    from tlt.rollout.engine import EngineConfig, RolloutEngine
    from tlt.rollout.generate import SamplingParams
    from tlt.rollout.strategy import Arm
    from tlt.rollout.target import TargetModel
    from tlt.bench.fixtures import demo_drafter, demo_target
    from tlt.demo.corpus import CorpusConfig, make_corpus
    from tlt.tokenizer import TextTokenizer

    target_dir = demo_target(quick)
    drafter_dir = demo_drafter(target_dir, quick=quick)
    model = TargetModel.from_pretrained(target_dir)
    tok = TextTokenizer.from_pretrained(target_dir)
    drafter = Drafter.load(drafter_dir, model.embed_weight, model.lm_head.weight)
    batches, steps_grid, new = ((1, 4), (0, 1, 3), 24) if quick else (RECORD_BATCHES, RECORD_STEPS, 160)
    rounds = 1 if quick else 5
    prompts = [tok.chat_prompt([{"role": "user", "content": p.prompt}])
               for p in make_corpus(rounds * max(batches), CorpusConfig(seed=seed + 99))]
    max_len = max(map(len, prompts)) + new + 1
    out: dict[str, dict[str, list]] = {str(b): {str(s): [] for s in steps_grid} for b in batches}
    for r in range(rounds):  # interleaved rounds: machine drift hits every cell alike
        for bs in batches:
            for s in (steps_grid if r % 2 == 0 else steps_grid[::-1]):
                arm = Arm(s, 1, s) if s else None
                eng = RolloutEngine(model, EngineConfig(max_batch=bs, max_len=max_len, arm=arm, elastic_threshold=bs,
                                                        seed=seed),
                                    proposer=EagleProposer(drafter, max_batch=bs, max_len=max_len + 16) if s else None)
                res = eng.generate(prompts[r * bs:(r + 1) * bs], SamplingParams(max_new_tokens=new))
                out[str(bs)][str(s)] += _full_batch_steps(res, bs)
        log.info("recorded round %d/%d", r + 1, rounds)
    return {"trace": out, "target": target_dir.name, "drafter": drafter_dir.name, "greedy": True,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine()}


def _full_batch_steps(res, bs: int) -> list[list]:
    """[seconds, accepted drafts per request] of each step that ran all ``bs`` requests."""
    flat, rows, k = res.accept_lengths, [], 0
    for st in res.steps:
        n = st.batch if st.sd else 0
        if st.batch == bs:  # the last steps may run fewer requests
            acc = [max(0, c - 1) for c in flat[k:k + n]] if st.sd else [0] * bs
            rows.append([round(st.seconds, 7), acc])
        k += n
    return rows


def parse_trace(raw: dict) -> Trace:
    return {int(b): {int(s): [(float(t), list(a)) for t, a in rows] for s, rows in by_s.items() if rows}
            for b, by_s in raw["trace"].items()}


# --------------------------------------------------------------------------- replay
def _nearest(trace: Trace, bs: int) -> int:
    keys = sorted(trace)
    return max((b for b in keys if b <= bs), default=keys[0])


def _expected_rate(trace: Trace, b: int, s: int) -> float:
    """Committed tokens per second per request, expected, from the trace at batch b, s steps."""
    rows = trace[b][s]
    acc = statistics.fmean(a for _, accs in rows for a in accs)
    return (acc + 1) / statistics.fmean(t for t, _ in rows)


class _Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def replay(trace: Trace, choose: Callable[[int], int], observe: Callable[[list[int], int], None] | None,
           lengths: Sequence[int], seed: int, clock: _Clock, overlap: bool = True) -> tuple[float, int]:
    """One rollout; returns (virtual seconds, tokens). With ``overlap`` (SGLang's overlap scheduler)
    ``observe`` gets a batch's result after the next batch was chosen, else right after its step."""
    rng = random.Random(seed)
    remaining, active = list(lengths), list(range(len(lengths)))
    wall, late = 0.0, None
    while active:
        bs = len(active)
        s = choose(bs)
        if late is not None and observe is not None:
            observe(*late)  # the previous batch's result, processed after this batch launched
        b = _nearest(trace, bs)
        rows = trace[b].get(s) or trace[b][min(trace[b], key=lambda k: abs(k - s))]
        seconds, _ = rows[rng.randrange(len(rows))]
        pool = rows[rng.randrange(len(rows))][1]
        accs = [min(s, pool[rng.randrange(len(pool))]) for _ in active]
        wall += seconds
        clock.t += seconds
        for i, a in zip(active, accs):
            remaining[i] -= min(a + 1, remaining[i])
        late = (accs, bs)
        if not overlap and observe is not None:
            observe(*late)
            late = None
        active = [i for i in active if remaining[i] > 0]
    if observe is not None and late is not None:
        observe(*late)
    return wall, sum(lengths)


def graph_memory(slots: SlotsConfig, graph_bs: Sequence[int], dims: ModelDims) -> dict:
    """Modelled bytes of SGLang's adaptive graphs: bucketed (per-slot steps) vs every step everywhere."""
    tuner = AdaptiveTuner(0, slots)
    tuner.set_cuda_graph_bs(list(graph_bs))
    steps = tuner.candidate_steps

    def nbytes(bs: int, s: int) -> int:
        out_d, work_d = estimate_parts(DraftGraphKey(batch=bs, topk=1), dims)
        total = sum(estimate_parts(TargetGraphKey(batch=bs, query_tokens=s + 1), dims))
        total += sum(estimate_parts(DraftGraphKey(batch=bs, topk=s + 1), dims))  # draft extend
        if s:
            total += s * out_d + work_d  # s draft steps in one graph: every step's outputs, one workspace
        return total

    bucketed = {s: tuner.cuda_graph_bs_for_step(s) for s in steps}
    b_bytes = sum(nbytes(b, s) for s, sizes in bucketed.items() for b in sizes)
    n_bytes = sum(nbytes(b, s) for s in steps for b in graph_bs)
    return {"graph_bs": list(graph_bs), "steps": steps, "bucketed_bs_per_step": bucketed,
            "bucketed_graph_sets": sum(map(len, bucketed.values())), "naive_graph_sets": len(steps) * len(graph_bs),
            "bucketed_bytes": b_bytes, "naive_bytes": n_bytes, "ratio": n_bytes / b_bytes}


def evaluate(trace: Trace, slots: SlotsConfig, *, rollouts: int, requests: int, seed: int,
             make_tuner: Callable[[_Clock], object] | None = None, overlap: bool = True) -> dict:
    """Goodput of every variant on the same rollouts; the tuner keeps learning across them."""
    rng = random.Random(seed)
    cap = 1024
    sets = [lognormal_lengths(requests, rng, 150, 1.0, lo=8, hi=cap) for _ in range(rollouts)]
    recorded = sorted({s for v in trace.values() for s in v})
    probe = AdaptiveTuner(0, slots)
    probe.set_cuda_graph_bs(list(SGLANG_SPEC_GRAPH_BS))

    def oracle(restrict: bool) -> Callable[[int], int]:
        def choose(bs: int) -> int:
            b = _nearest(trace, bs)
            cands = [s for s in recorded if s in trace[b] and (not restrict or s in probe.slots[probe.slot_of(bs)])]
            return max(cands, key=lambda s: _expected_rate(trace, b, s))
        return choose

    def run(choose, observe=None, clock=None) -> float:
        clock = clock or _Clock()
        wall = toks = 0
        for i, lengths in enumerate(sets):
            w, n = replay(trace, choose, observe, lengths, seed * 1000 + i, clock, overlap)
            wall, toks = wall + w, toks + n
        return toks / wall

    variants: dict[str, float] = {"oracle (every step count)": run(oracle(False)),
                                  "oracle (slot step counts)": run(oracle(True))}
    clock = _Clock()
    tuner = make_tuner(clock) if make_tuner else AdaptiveTuner(0, slots, clock=clock, seed=seed)
    tuner.set_cuda_graph_bs(list(SGLANG_SPEC_GRAPH_BS))
    variants["TLT tuner (BEG-MAB)"] = run(tuner.get_steps_for_batch, tuner.on_verify_complete, clock)
    for s in recorded:
        variants[f"static {s} steps" if s else "AR (0 steps)"] = run(lambda bs, s=s: s)
    best = variants["oracle (every step count)"]
    return {"goodput_tok_s": variants, "tuner_pct_of_oracle": 100 * variants["TLT tuner (BEG-MAB)"] / best,
            "tuner_pct_of_slot_oracle": 100 * variants["TLT tuner (BEG-MAB)"] / variants["oracle (slot step counts)"],
            "rollouts": rollouts, "requests": requests,
            "tuner": tuner.stats() if hasattr(tuner, "stats") else None}


def run(args: argparse.Namespace) -> dict:
    path = Path(args.trace) if getattr(args, "trace", None) else None
    if path is not None and path.exists():
        raw = json.loads(path.read_text())
    else:
        raw = record_trace(quick=bool(args.quick), seed=args.seed)
        if path is not None:
            path.write_text(json.dumps(raw, separators=(",", ":")))
    trace = parse_trace(raw)
    slots = DEFAULT_SLOTS
    ev = evaluate(trace, slots, rollouts=4 if args.quick else 16, requests=32, seed=args.seed)
    mem = graph_memory(slots, SGLANG_SPEC_GRAPH_BS, QWEN25_32B)
    g = ev["goodput_tok_s"]
    lines = [f"sglang tuner bench: trace of {raw['target']} + {raw['drafter']} (batches {sorted(trace)}, "
             f"steps {sorted({s for v in trace.values() for s in v})}), {ev['rollouts']} rollouts x "
             f"{ev['requests']} requests, overlap-scheduler call order, TLT default slots {describe(slots)}"]
    lines += [f"  {k:28s} {v:8.0f} tok/s  {v / g['AR (0 steps)']:5.2f}x AR" for k, v in g.items()]
    lines.append(f"  TLT tuner: {ev['tuner_pct_of_oracle']:.1f}% of the per-batch-size oracle "
                 f"({ev['tuner_pct_of_slot_oracle']:.1f}% of the oracle over the slots' step counts)")
    lines.append(f"  graph plan (model, Qwen2.5-32B dims, {len(SGLANG_SPEC_GRAPH_BS)} graph batch sizes): bucketed "
                 f"{mem['bucketed_bytes'] / 1e9:.2f} GB ({mem['bucketed_graph_sets']} step x size sets) vs every step "
                 f"at every size {mem['naive_bytes'] / 1e9:.2f} GB ({mem['naive_graph_sets']}): {mem['ratio']:.2f}x less")
    return {"bench": "sglang-tuner", "quick": bool(args.quick), **ev, "graph_memory": mem,
            "trace_meta": {k: v for k, v in raw.items() if k != "trace"}, "summary": lines}
