"""``python examples/research/drafters.py``: accept length and cost of each draft source on recurring GRPO prompts.

The workload is RL's: the demo's task, the same prompts every epoch (GRPO groups of ``n`` samples,
temperature 1), sampled from the demo target by the real engine with coupled sampling, so every
variant commits exactly the same tokens and only accept lengths and drafting cost differ. Between
epochs each history-aware variant receives the previous epochs' responses, as a replica does from
the trainer between RL steps (the target does not change between epochs here: the bench isolates
the draft sources; ``tlt demo`` measures them under a moving policy). Per variant, chain and tree:
accept length (tokens committed per verify, bonus included) over the epochs after the first, and
microseconds per proposal per request. Variants: the suffix drafter over the live siblings only
(the suffix drafter as it was), with the prompt's history, with the global pool too, the warm-up
EAGLE drafter, BEG-MAB choosing between EAGLE and the history suffix drafter per step, and (tree
arm only) one verify over the union of EAGLE's and the suffix drafter's trees, each half the arm's
paths and nodes (``union.py`` beside it). Last, the task's text ceiling (:func:`structure_ceiling`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import platform
import time

import torch

from tlt.drafter.seeds import derive
from tlt.drafter.eagle import Drafter
from tlt.rollout.draft_tree import Proposer
from tlt.rollout.eagle_proposer import EagleProposer
from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.generate import SamplingParams
from tlt.rollout.history import HistoryConfig, ResponseHistory
from tlt.rollout.suffix import SuffixProposer
from tlt.rollout.strategy import Arm
from tlt.rollout.target import TargetModel
from tlt.rollout.tuner import BegMab, TunerConfig
from union import UnionProposer  # (this folder)
from tlt.bench.fixtures import demo_drafter
from tlt.demo.corpus import make_corpus
from tlt.demo.job import DEFAULT, QUICK
from tlt.demo.target_factory import ensure_target
from tlt.tokenizer import TextTokenizer

log = logging.getLogger(__name__)
UNION = "union: EAGLE + suffix"  # one verify pass over EAGLE's half-size tree and the suffix drafter's


class _Timed(Proposer):
    """Wraps a proposer: wall time and requests per proposal (the draft's cost)."""

    def __init__(self, inner) -> None:
        self.inner, self.seconds, self.catch_up, self.requests = inner, 0.0, 0.0, 0
        self.feature_layers = inner.feature_layers

    def propose(self, inp):
        t0 = time.perf_counter()
        tree = self.inner.propose(inp)
        self.seconds += time.perf_counter() - t0
        self.catch_up += self.catch_up_s  # what arrived since its last call, taken in first (the switch's cost)
        self.requests += len(inp.rows)
        return tree

    @property
    def catch_up_s(self) -> float:
        return self.inner.catch_up_s

    @property
    def capture_s(self) -> float:
        return self.inner.capture_s

    @property
    def kv_position_bytes(self) -> int:
        return self.inner.kv_position_bytes

    def forget(self, rids) -> None:
        self.inner.forget(rids)

    def close(self) -> None:
        self.inner.close()


def structure_ceiling(outputs: list[list[int]], digits: set[int], depth: int) -> float:
    """Accept length of a drafter that drafts every token outside ``digits`` right and every digit
    wrong, drafting up to ``depth`` tokens per verify (the bonus token included, as measured)."""
    committed = verifies = 0
    for out in outputs:
        i = 0
        while i < len(out):
            k = 0
            while k < depth and i + k < len(out) and out[i + k] not in digits:
                k += 1
            step = min(k + 1, len(out) - i)
            i, committed, verifies = i + step, committed + step, verifies + 1
    return committed / verifies if verifies else 1.0


def _proposers(name: str, drafter: Drafter, batch: int, max_len: int) -> tuple[dict, ResponseHistory | None]:
    """Fresh proposers (by engine name) of variant ``name`` and the history they read."""
    def suffix(history: bool, global_pool: bool) -> tuple[SuffixProposer, ResponseHistory | None]:
        hist = ResponseHistory(HistoryConfig(global_tokens=8192 if global_pool else 0)) if history else None
        return SuffixProposer(history=hist), hist

    def eagle() -> EagleProposer:
        return EagleProposer(drafter, max_batch=batch, max_len=max_len + 32)

    if name == "EAGLE (warm-up)":
        return {"": eagle()}, None
    if name == "BEG-MAB: EAGLE + suffix":
        prop, hist = suffix(True, True)
        return {"": eagle(), "suffix": prop}, hist
    if name == UNION:
        prop, hist = suffix(True, True)
        return {"": UnionProposer(eagle(), prop)}, hist
    prop, hist = suffix("history" in name, "global" in name)
    return {"": prop}, hist


def _measure(name: str, eng: RolloutEngine, props: dict, hist: ResponseHistory | None, reqs: list[list[int]],
             groups: list[int], params: SamplingParams, epochs: int, seed: int, ref: list) -> dict:
    """``epochs`` rollouts of the same requests (new seeds each), the history fed after each; every
    epoch's outputs checked against the first variant's (``ref``, filled by it)."""
    committed = verifies = 0
    for epoch in range(epochs):
        seeds = [derive(seed, epoch * 10_007 + i) for i in range(len(reqs))]
        res = eng.generate(reqs, params, groups, seeds)
        if len(ref) == epoch:
            ref.append(res.outputs)
        if res.outputs != ref[epoch]:
            raise AssertionError(f"{name}: epoch {epoch}'s outputs differ from the other variants' (not lossless)")
        if epoch > 0:  # epoch 0 has no history: the figures are over the recurring epochs
            committed += sum(res.accept_lengths)
            verifies += len(res.accept_lengths)
        if hist is not None:
            hist.add(epoch, list(zip(reqs, res.outputs)))
    us = {k or "main": 1e6 * p.seconds / max(1, p.requests) for k, p in props.items()}
    catch_up = {k or "main": 1e6 * p.catch_up / max(1, p.requests) for k, p in props.items()}
    return {"accept_length": committed / verifies if verifies else None, "verifies": verifies,
            "us_per_propose_per_request": us, "us_catch_up_per_request": catch_up,
            "history": hist.stats() if hist is not None else None}


def run(args: argparse.Namespace) -> dict:
    quick = bool(args.quick)
    size = QUICK if quick else DEFAULT
    if getattr(args, "target_steps", 0):  # a sharper policy: its samples of one prompt agree more
        size = dataclasses.replace(size, target=dataclasses.replace(size.target, train_steps=args.target_steps))
    torch.set_num_threads(args.threads or torch.get_num_threads())
    target = ensure_target(size.target, progress=False)
    model = TargetModel.from_pretrained(target).eval()
    tok = TextTokenizer.from_pretrained(target)
    drafter = Drafter.load(demo_drafter(target, 20 if quick else 60, quick), model.embed_weight,
                           model.lm_head.weight).eval()
    gc.collect()
    gc.freeze()  # what a replica does once loaded (tlt.integrations.verl.server): full GC passes skip it
    n_prompts, n, epochs = (4, 2, 3) if quick else (16, 4, 3)
    shape = dataclasses.replace(size.target.corpus, seed=size.target.seed + 1000)
    prompts = [tok.chat_prompt([{"role": "user", "content": p.prompt}]) for p in make_corpus(n_prompts, shape)]
    reqs = [p for p in prompts for _ in range(n)]
    groups = [i // n for i in range(len(reqs))]
    params = SamplingParams(temperature=1.0, max_new_tokens=size.max_response,
                            stop_ids=tuple(model.config.eos_ids or (tok.eos_id,)))
    max_len = max(map(len, reqs)) + size.max_response + 1
    cfg = EngineConfig(max_batch=len(reqs), max_len=max_len, max_draft_tokens=16)
    names = ("suffix, siblings only", "suffix + history", "suffix + history + global", "EAGLE (warm-up)",
             "BEG-MAB: EAGLE + suffix", UNION)
    arms = {"chain": Arm(6, 1, 6), "tree": Arm(6, 2, 12)}
    table: dict[str, dict[str, dict]] = {}
    ref: list[list[list[int]]] = []  # outputs per epoch: every variant must commit the same tokens
    for name in names:
        for shape_name, arm in arms.items():
            if name == UNION and arm.topk < 2:
                continue  # a union has two paths at least
            inner, hist = _proposers(name, drafter, len(reqs), max_len)
            props = {k: _Timed(p) for k, p in inner.items()}
            tuned = len(props) > 1
            tuner = BegMab(TunerConfig.for_device("cpu", proposers=("", "suffix"), seed=args.seed)) if tuned else None
            eng = RolloutEngine(model, dataclasses.replace(cfg, arm=None if tuned else arm), proposers=props,
                                tuner=tuner)
            row = table.setdefault(name, {})[shape_name] = _measure(name, eng, props, hist, reqs, groups, params,
                                                                    epochs, args.seed, ref)
            log.info("%s %s: AL %.2f", name, shape_name, row["accept_length"] or 0.0)
    base = table["suffix, siblings only"]
    digits = {t for t in range(tok.vocab_size) if any(c.isdigit() for c in tok.decode([t]))}
    ceiling = {s: structure_ceiling([o for outs in ref[1:] for o in outs], digits, arms[s].depth) for s in arms}
    lines = [f"drafters: {n_prompts} prompts x {n} samples of the demo's task at temperature 1, {epochs} epochs "
             f"(the same prompts each epoch, new seeds), target {target.name}, {torch.get_num_threads()} thread(s); "
             f"accept length over epochs 2..{epochs} (tokens per verify, bonus included); chain {arms['chain']}, "
             f"tree {arms['tree']} (BEG-MAB picks its own arms)"] + _table_lines(table, ceiling)
    return {"bench": "drafters", "quick": quick, "target": str(target), "prompts": n_prompts, "samples": n,
            "epochs": epochs, "arms": {k: str(v) for k, v in arms.items()}, "variants": table,
            "history_over_siblings": {s: table["suffix + history"][s]["accept_length"] / base[s]["accept_length"]
                                      for s in arms},
            "text_ceiling": ceiling,
            "machine": {"python": platform.python_version(), "torch": torch.__version__,
                        "threads": torch.get_num_threads()}, "summary": lines}


def _table_lines(table: dict[str, dict[str, dict]], ceiling: dict[str, float]) -> list[str]:
    base = table["suffix, siblings only"]
    lines = []
    for name, row in table.items():
        cells = []
        for shape_name, r in row.items():
            al, b = r["accept_length"], base[shape_name]["accept_length"]
            cost = ", ".join(f"{k} {v:.0f} us" + (f" (catch-up {c:.0f})" if len(r["us_catch_up_per_request"]) > 1 else "")
                             for (k, v), c in zip(r["us_per_propose_per_request"].items(), r["us_catch_up_per_request"].values()))
            cells.append(f"{shape_name} AL {al:.2f} ({al / b:.2f}x siblings-only; {cost}/request)")
        lines.append(f"  {name:28s} " + " | ".join(cells))
    lines.append("  ceiling of drafting text    " + " | ".join(
        f"{s} AL {c:.2f} ({c / base[s]['accept_length']:.2f}x siblings-only)" for s, c in ceiling.items())
        + ": every token without a digit drafted right, every digit wrong (the task's operands and results "
        "are digits the policy samples afresh)")
    try:
        import arctic_inference  # noqa: F401
        lines.append("  arctic-inference is installed: its SuffixDecodingCache is not wired into this bench yet")
    except ImportError:
        lines.append("  arctic-inference is not installed here (its sdist needs --no-build-isolation): no comparison line")
    return lines


if __name__ == "__main__":
    import sys

    from _run import main

    sys.exit(main(run, __doc__))
