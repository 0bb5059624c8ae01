"""``python examples/research/headroom.py``: how much an adapted drafter can buy on the demo's target, under sampling.

The demo's goal is accept length spot-trained over stale; this bench measures what bounds that
ratio, outside verl. On held-out prompts of the demo's task, sampled at temperature 1 (GRPO's
rollouts), it measures accept length per verify (committed tokens, the bonus token included) of
fixed chains at several depths for:

- ``stale``: the demo's warm-up drafter (greedy rollouts of the training prompts, as ``tlt demo``);
- ``on-policy N``: drafters trained N steps on sampled (T = 1) rollouts of the same prompts, what
  spot training converges toward when it gets N optimizer steps;
- ``oracle``: the target's own greedy continuation as the draft — the most a *deterministic* chain
  drafter of this target can reach (its tokens are fixed, so a draft token is accepted with the
  target's probability of it, and no token is likelier than the argmax).

Each EAGLE drafter drafts twice: deterministically (``log q``) and with the target's own noise
(``shared noise``, coupled sampling: the draft is the drafter's guess of the target's *sample*).
Shared noise lifts the deterministic ceiling: a drafter equal to the target would always be
accepted (depth + 1 tokens per verify). Coupled sampling makes every variant sample the same
tokens, so the accept lengths compare the same responses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import platform
import tempfile
from pathlib import Path

import torch

from tlt.drafter.eagle import Drafter
from tlt.drafter.offline_train import TrainConfig
from tlt.rollout.draft_tree import DraftTree, Proposer, ProposerInput
from tlt.rollout.eagle_proposer import EagleProposer
from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.generate import SamplingParams
from tlt.rollout.strategy import Arm
from tlt.rollout.target import TargetModel
from tlt.demo.corpus import make_corpus
from tlt.demo.job import DEFAULT, QUICK
from tlt.demo.target_factory import ensure_target
from tlt.tokenizer import TextTokenizer
from tlt.warmup import WarmupConfig, run_warmup

log = logging.getLogger(__name__)


class OracleProposer(Proposer):
    """Drafts the target's own greedy continuation (a full forward per level): the chain ceiling."""

    feature_layers = None

    def __init__(self, model: TargetModel) -> None:
        self.model = model

    @torch.no_grad()
    def propose(self, inp: ProposerInput) -> DraftTree:
        # All rows in one forward per level: right padding leaves a causal model's logits at each
        # row's real positions unchanged, so row r's next token is read at its own last position.
        seqs = [list(inp.tokens[r]) for r in inp.rows]
        lens = torch.tensor([len(x) for x in seqs])  # [B]
        ids = torch.zeros(len(seqs), int(lens.max()) + inp.arm.depth, dtype=torch.long)  # [B, T + depth]
        for i, x in enumerate(seqs):
            ids[i, :len(x)] = torch.tensor(x)
        rows = torch.arange(len(seqs))
        for j in range(inp.arm.depth):
            logits = self.model(ids[:, :int(lens.max()) + j]).logits  # [B, T + j, V]
            ids[rows, lens + j] = logits[rows, lens + j - 1].argmax(-1)
        tokens = torch.stack([ids[i, lens[i]:lens[i] + inp.arm.depth] for i in range(len(seqs))])  # [B, depth]
        parents = torch.arange(-1, inp.arm.depth - 1).expand_as(tokens)
        return DraftTree(tokens, parents.contiguous(), torch.ones_like(tokens, dtype=torch.bool))


def _accept_length(model: TargetModel, proposer: Proposer, prompts: list[list[int]], params: SamplingParams,
                   depth: int, max_len: int) -> float:
    eng = RolloutEngine(model, EngineConfig(max_batch=len(prompts), max_len=max_len, arm=Arm(depth, 1, depth),
                                            max_draft_tokens=max(depth, 8)), proposer=proposer)
    res = eng.generate(prompts, params)
    return sum(res.accept_lengths) / len(res.accept_lengths)


@torch.no_grad()
def _top1_mass(model: TargetModel, prompts: list[list[int]], params: SamplingParams, max_len: int) -> float:
    """Mean probability of the target's argmax over its own sampled responses: per-token acceptance
    of the oracle's first draft, the sharpness that bounds every chain drafter."""
    res = RolloutEngine(model, EngineConfig(max_batch=len(prompts), max_len=max_len)).generate(prompts, params)
    mass = []
    for p, out in zip(prompts, res.outputs):
        logits = model(torch.tensor([p + out])).logits[0, len(p) - 1: len(p) + len(out) - 1]  # [len(out), V]
        mass += torch.softmax(logits / params.temperature, -1).max(-1).values.tolist()
    return sum(mass) / len(mass)


def run(args: argparse.Namespace) -> dict:
    quick = bool(args.quick)
    size = QUICK if quick else DEFAULT
    if getattr(args, "target_steps", 0):
        size = dataclasses.replace(size, target=dataclasses.replace(size.target, train_steps=args.target_steps))
    target = ensure_target(size.target, progress=False)
    model = TargetModel.from_pretrained(target).eval()
    tok = TextTokenizer.from_pretrained(target)
    seed = size.target.seed + 1000  # the demo's training prompts; held-out ones for evaluation
    shape = size.target.corpus
    train_msgs = [{"messages": [{"role": "user", "content": p.prompt}]}
                  for p in make_corpus(size.prompts, dataclasses.replace(shape, seed=seed))]
    n_eval = 8 if quick else 32
    evals = [tok.chat_prompt([{"role": "user", "content": p.prompt}])
             for p in make_corpus(n_eval, dataclasses.replace(shape, seed=seed + 7))]
    stop = tuple(model.config.eos_ids or ((tok.eos_id,) if tok.eos_id is not None else ()))
    params = SamplingParams(temperature=1.0, max_new_tokens=size.max_response, stop_ids=stop)
    max_len = max(map(len, evals)) + size.max_response + 1
    depths = (1, 3) if quick else (1, 3, 5)
    on_policy_steps = (5, 20) if quick else (size.warmup_steps, 5 * size.warmup_steps)

    drafters: dict[str, Drafter] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "prompts.jsonl"
        data.write_text("".join(json.dumps(m) + "\n" for m in train_msgs))
        runs = [("stale", 0.0, 1, size.warmup_steps)] + [(f"on-policy {n}", 1.0, 4, n) for n in on_policy_steps]
        for name, temp, samples, steps in runs:
            log.info("training the %s drafter (%d steps, rollouts at temperature %.1f)", name, steps, temp)
            out = Path(tmp) / name.replace(" ", "-")
            run_warmup(WarmupConfig(target=target, data=data, out=out, max_new_tokens=size.max_response,
                                    temperature=temp, samples_per_prompt=samples,
                                    train=TrainConfig(max_steps=steps, save_every=steps)), progress=False)
            drafters[name] = Drafter.load(out, model.embed_weight, model.lm_head.weight).eval()
    proposers = {}  # one per engine
    for name, d in drafters.items():
        proposers[name] = lambda d=d: EagleProposer(d, max_batch=n_eval, max_len=max_len + 64, shared_noise=False)
        proposers[f"{name}, shared noise"] = lambda d=d: EagleProposer(d, max_batch=n_eval, max_len=max_len + 64)
    proposers["oracle"] = lambda: OracleProposer(model)
    table: dict[str, dict[int, float]] = {}
    for name, make in proposers.items():
        log.info("accept lengths of %s at depths %s", name, depths)
        table[name] = {d: _accept_length(model, make(), evals, params, d, max_len) for d in depths}
    top1 = _top1_mass(model, evals, params, max_len)
    over_stale = {name: {d: al / table["stale"][d] for d, al in row.items()} for name, row in table.items()}

    lines = [f"drafter headroom: {n_eval} held-out prompts of the demo's task, sampled at temperature 1 "
             f"(<= {size.max_response} tokens), target {target.name}; accept length per verify of a fixed "
             f"chain (committed tokens incl. the bonus token) at depth {', '.join(map(str, depths))}"]
    for name, row in table.items():
        cells = "  ".join(f"d{d} {al:4.2f} ({over_stale[name][d]:4.2f}x stale)" for d, al in row.items())
        lines.append(f"  {name:18s} {cells}")
    lines.append(f"  the target's argmax holds {top1:.2f} of its probability on average over its sampled responses")
    best = max(depths, key=lambda d: over_stale["oracle"][d])
    noise_gain = {name: {d: table[f"{name}, shared noise"][d] / al for d, al in table[name].items()}
                  for name in drafters}
    lines.append(f"  deterministic drafts reach at most {over_stale['oracle'][best]:.2f}x stale (oracle, depth {best}); "
                 f"shared noise has no such ceiling (a drafter equal to the target: {depths[-1] + 1} per verify)")
    lines.append("  shared noise over deterministic drafts, same drafter: " + "; ".join(
        f"{name} " + ", ".join(f"d{d} {g:.2f}x" for d, g in row.items()) for name, row in noise_gain.items()))
    return {"bench": "headroom", "quick": quick, "target": str(target), "eval_prompts": n_eval,
            "temperature": 1.0, "depths": list(depths), "accept_length": table, "over_stale": over_stale,
            "on_policy_steps": list(on_policy_steps), "stale_steps": size.warmup_steps,
            "ceiling_over_stale": over_stale["oracle"][best], "target_top1_mass": top1,
            "shared_noise_gain": noise_gain,
            "machine": {"python": platform.python_version(), "torch": torch.__version__,
                        "threads": torch.get_num_threads()}, "summary": lines}


if __name__ == "__main__":
    import sys

    from _run import main

    sys.exit(main(run, __doc__))
