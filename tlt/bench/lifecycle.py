"""``tlt bench lifecycle``: what the engine's request lifecycle costs and what it pays.

Three measurements on the demo's target (``--quick``: the quick target), one run:

- **Continuous batching.** The demo's per-replica workload (4 prompts x 4 GRPO samples, lognormal
  response lengths up to the demo's 320 tokens, greedy) arrives spread uniformly over ``spread_ms``.
  ``wait``: the old batcher -- an idle engine starts on what arrived within one batch window, and
  later arrivals wait until that generation drains. ``join``: the same start, but later arrivals
  join the running generation at the next step. Both decode the same requests to the same tokens
  (checked); the record has the paired ratios (wait / join, per repeat, order alternating) of the
  makespan and of the mean request latency, with bootstrap 90% intervals.
- **The cost of leaving and joining.** A request that leaves after ``k`` tokens is prefilled again
  over prompt + ``k`` tokens where it joins: that prefill's time (a joining step minus a plain
  step) against moving its keys and values instead (serialised, deserialised and copied into the
  cache, in this process: a lower bound on any transfer between processes).
- **EAGLE's catch-up for a joining request** (needs the warm-up drafter, built once and cached):
  requests moved after ``k`` tokens into an engine with an EAGLE chain; the drafter either prefills
  the whole request (``start_window=None``) or sees only its last 16 pairs. Accept length and the
  first proposal's time for each.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import logging
import random
import statistics
import time

import torch

from tlt.bench import torch_threads
from tlt.bench.fixtures import demo_drafter, demo_target, paired_ci90, show_ci90
from tlt.drafter.eagle import Drafter
from tlt.rollout.eagle_proposer import EagleProposer
from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.generate import SamplingParams
from tlt.rollout.request import RequestState
from tlt.rollout.strategy import Arm
from tlt.rollout.target import TargetModel
from tlt.demo.corpus import CorpusConfig, make_corpus
from tlt.demo.job import DEFAULT
from tlt.sim.workloads import lognormal_lengths
from tlt.tokenizer import TextTokenizer

log = logging.getLogger(__name__)
WINDOW_S = 0.02  # the verl backend's default batch window (tlt.engine.batch_window_ms)


def _workload(tok: TextTokenizer, seed: int, quick: bool) -> list[RequestState]:
    rng = random.Random(seed)
    n_prompts, n_samples, median, cap = (2, 4, 24, 64) if quick else (4, 4, 96, DEFAULT.max_response)
    out, lengths = [], iter(lognormal_lengths(n_prompts * n_samples, rng, median, 1.0, lo=8, hi=cap))
    for g, p in enumerate(make_corpus(n_prompts, CorpusConfig(seed=seed + 4242))):
        ids = tok.chat_prompt([{"role": "user", "content": p.prompt}])
        for i in range(n_samples):
            length = next(lengths)
            out.append(RequestState(tuple(ids), SamplingParams(max_new_tokens=length), seed=1000 * g + i, group=g))
    return out


def drive(engine: RolloutEngine, reqs: list[RequestState], arrivals: list[float], join: bool,
          window_s: float = WINDOW_S) -> tuple[list[float], list[float], list[tuple[int, ...]]]:
    """Serve ``reqs`` arriving at ``arrivals`` (seconds from now, sorted) as the verl backend's
    batcher would, with joining or without. Returns each request's arrival and finish times (s)
    and outputs, in order."""
    t0, i, n = time.perf_counter(), 0, len(reqs)
    finish: dict[int, float] = {}
    outs: dict[int, tuple[int, ...]] = {}
    index: dict[int, int] = {}

    def admit(upto: int) -> None:
        nonlocal i
        for k, rid in zip(range(i, upto), engine.add(reqs[i:upto])):
            index[rid] = k
        i = upto

    def now() -> float:
        return time.perf_counter() - t0

    while len(finish) < n:
        if not engine.active:  # idle: the next arrival, then until none comes for one window
            time.sleep(max(0.0, arrivals[i] - now()))
            j = i + 1
            while j < n and arrivals[j] <= max(now(), arrivals[j - 1]) + window_s:
                time.sleep(max(0.0, arrivals[j] - now()))
                j += 1
            admit(j)
        elif join:
            admit(next((j for j in range(i, n) if arrivals[j] > now()), n))
        for f in engine.step():
            finish[index[f.rid]] = now()
            outs[index[f.rid]] = f.state.output
    return arrivals, [finish[k] for k in range(n)], [outs[k] for k in range(n)]


def continuous_batching(model: TargetModel, reqs: list[RequestState], spread_s: float, repeats: int,
                        seed: int) -> dict:
    max_len = max(len(r.prompt) + r.params.max_new_tokens for r in reqs) + 1
    rng = random.Random(seed)
    arrivals = sorted(rng.uniform(0, spread_s) for _ in reqs)
    order = rng.sample(range(len(reqs)), len(reqs))  # which request arrives when
    reqs = [reqs[k] for k in order]
    engines = {arm: RolloutEngine(model, EngineConfig(max_batch=len(reqs), max_len=max_len)) for arm in ("wait", "join")}
    for e in engines.values():  # warm-up, not timed
        drive(e, reqs, [0.0] * len(reqs), join=True)
    got: dict[str, dict[str, list[float]]] = {a: {"makespan": [], "latency": []} for a in engines}
    ref = None
    for rep in range(repeats):
        for arm in (("wait", "join") if rep % 2 == 0 else ("join", "wait")):
            arr, fin, outs = drive(engines[arm], reqs, arrivals, join=arm == "join")
            if ref is None:
                ref = outs
            elif outs != ref:
                raise AssertionError(f"{arm}: outputs differ between the batching arms")
            got[arm]["makespan"].append(max(fin) - min(arr))
            got[arm]["latency"].append(statistics.fmean(f - a for a, f in zip(arr, fin)))
    rec: dict = {"requests": len(reqs), "spread_ms": 1e3 * spread_s, "window_ms": 1e3 * WINDOW_S, "repeats": repeats,
                 "joined_per_rollout": engines["join"].lifecycle["joined"] / (repeats + 1)}
    for metric in ("makespan", "latency"):
        w, j = got["wait"][metric], got["join"][metric]
        iv = paired_ci90(w, j, seed)
        rec[metric] = {"wait_s": statistics.median(w), "join_s": statistics.median(j),
                       "wait_over_join": statistics.median(a / b for a, b in zip(w, j)),
                       "ci90": None if iv is None else list(iv)}
    return rec


def rejoin_cost(model: TargetModel, prompt: tuple[int, ...], ks: list[int], repeats: int) -> list[dict]:
    """Per k: the re-prefill of prompt + k tokens (a joining step minus a plain step, one request),
    and moving its keys/values instead (serialise, deserialise, copy into the cache)."""
    cfg = model.config
    max_len = len(prompt) + max(ks) + 16
    rows = []
    for k in ks:
        eng = RolloutEngine(model, EngineConfig(max_batch=1, max_len=max_len))
        seed_out = tuple(range(5, 5 + k))  # any tokens: the cost depends on the length only
        join_s, step_s, move_s = [], [], []
        for _ in range(repeats + 1):  # the first: warm-up
            st = RequestState(prompt, SamplingParams(max_new_tokens=k + 8), 0, output=seed_out,
                              logprobs=(0.0,) * k) if k else RequestState(prompt, SamplingParams(max_new_tokens=8), 0)
            eng.add([st])
            t = time.perf_counter()
            eng.step()
            join_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            eng.step()
            step_s.append(time.perf_counter() - t)
            n = len(prompt) + k
            t = time.perf_counter()
            buf = io.BytesIO()
            torch.save((eng.cache.k[:, :1, :, :n].clone(), eng.cache.v[:, :1, :, :n].clone()), buf)
            kk, vv = torch.load(io.BytesIO(buf.getvalue()))
            eng.cache.k[:, :1, :, :n].copy_(kk)
            eng.cache.v[:, :1, :, :n].copy_(vv)
            move_s.append(time.perf_counter() - t)
            eng.abort()
        j, s, m = (statistics.median(x[1:]) for x in (join_s, step_s, move_s))
        kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * (len(prompt) + k) * \
            model.embed_weight.element_size()
        rows.append({"tokens_so_far": k, "context": len(prompt) + k, "reprefill_ms": 1e3 * max(j - s, 0.0),
                     "plain_step_ms": 1e3 * s, "kv_move_ms": 1e3 * m, "kv_bytes": kv_bytes})
    return rows


def eagle_start(model: TargetModel, drafter: Drafter, reqs: list[RequestState], ks: list[int], arm: Arm) -> list[dict]:
    """Requests joining with k tokens so far (k = 0: fresh) into an EAGLE engine: accept length and
    the first proposal's seconds, the drafter prefilling the whole request vs its last 16 pairs."""
    max_len = max(len(r.prompt) + r.params.max_new_tokens for r in reqs) + 1
    plain = RolloutEngine(model, EngineConfig(max_batch=len(reqs), max_len=max_len))
    ref = plain.generate([r.prompt for r in reqs], [r.params for r in reqs], seeds=[r.seed for r in reqs])
    rows = []
    for k in ks:
        states = [dataclasses.replace(r, output=tuple(o[:k]), logprobs=tuple(lp[:k]))
                  for r, o, lp in zip(reqs, ref.outputs, ref.logprobs) if len(o) > k + 8]
        for window in (None, 16):
            prop = EagleProposer(drafter, max_batch=len(reqs), max_len=max_len + 64, start_window=window)
            eng = RolloutEngine(model, EngineConfig(max_batch=len(reqs), max_len=max_len, arm=arm), proposer=prop)
            eng.add(states)
            outs = {}
            while eng.active:
                outs.update((f.rid, f.state.output) for f in eng.step())
            al = eng.accept_lengths_since(0)
            rows.append({"tokens_so_far": k, "start_window": window or "whole request", "requests": len(states),
                         "mean_accept_length": sum(al) / len(al), "first_proposal_ms": 1e3 * eng.steps[0].draft_seconds,
                         "lossless": [outs[r] for r in sorted(outs)] == [
                             tuple(o) for o, r in zip(ref.outputs, reqs) if len(o) > k + 8]})
    return rows


def run(args: argparse.Namespace) -> dict:
    with torch_threads(args.threads):
        return _run(args)


def _run(args: argparse.Namespace) -> dict:
    quick = bool(args.quick)
    target_dir = demo_target(quick)
    model = TargetModel.from_pretrained(target_dir)
    tok = TextTokenizer.from_pretrained(target_dir)
    reqs = _workload(tok, args.seed, quick)
    repeats = args.repeats or (1 if quick else 7)
    spread = 0.1 if quick else 0.3
    cb = continuous_batching(model, reqs, spread, repeats, args.seed)
    ks = [0, 16, 64] if quick else [0, 64, 128, 256, 320]
    cost = rejoin_cost(model, reqs[0].prompt, ks, 2 if quick else 5)
    drafter = Drafter.load(demo_drafter(target_dir, quick=quick), model.embed_weight, model.lm_head.weight)
    start = eagle_start(model, drafter, reqs, [0, 16] if quick else [0, 32, 96], Arm(3, 1, 3))
    summary = [f"continuous batching ({cb['requests']} requests over {cb['spread_ms']:.0f} ms, "
               f"{cb['repeats']} paired repeats): makespan wait/join {cb['makespan']['wait_over_join']:.2f}x "
               f"({show_ci90(cb['makespan']['ci90'])}), mean latency "
               f"{cb['latency']['wait_over_join']:.2f}x ({show_ci90(cb['latency']['ci90'])})"]
    summary += [f"rejoin after {r['tokens_so_far']} tokens: re-prefill {r['reprefill_ms']:.1f} ms "
                f"({r['reprefill_ms'] / r['plain_step_ms']:.1f} plain steps), moving its KV "
                f"({r['kv_bytes'] / 1e6:.2f} MB) {r['kv_move_ms']:.2f} ms" for r in cost]
    summary += [f"EAGLE start, {r['tokens_so_far']} tokens so far, drafter sees {r['start_window']}: accept length "
                f"{r['mean_accept_length']:.2f}, first proposal {r['first_proposal_ms']:.1f} ms"
                + ("" if r["lossless"] else "  NOT LOSSLESS") for r in start]
    if not all(r["lossless"] for r in start):
        raise AssertionError("a joined request's tokens differ from the uninterrupted run")
    return {"bench": "lifecycle", "quick": quick, "threads": torch.get_num_threads(), "seed": args.seed,
            "continuous_batching": cb, "rejoin_cost": cost, "eagle_start": start, "summary": summary}
