"""Sampled speculative outputs have the target's distribution: per-position chi-square tests.

A small-vocabulary random target (V = 12) makes the exact marginal distribution of the first
three generated tokens computable by enumeration. Thousands of seeded speculative samples (tree
drafts that are often, but not always, accepted) must fit it; the same samples against a wrong
distribution must not (the test has power).
"""

from __future__ import annotations

import math

import pytest
import torch

from tlt.drafter.model_config import ModelConfig
from tlt.rollout.draft_tree import DraftTree, Proposer
from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.generate import SamplingParams
from tlt.rollout.strategy import Arm
from tlt.rollout.target import TargetModel

V, POSITIONS, BATCH, ROUNDS = 12, 3, 64, 40


def _target() -> TargetModel:
    torch.manual_seed(0)
    cfg = ModelConfig(model_type="llama", vocab_size=V, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = TargetModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.4)
    return model


def probs_from_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The target's sampling distribution [..., V] after temperature, top-k and top-p: the reference
    definition the samples are tested against (independent of rollout.sampling's implementation)."""
    logits = logits.float() / p.temperature
    if p.top_k:
        kth = logits.topk(min(p.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if p.top_p < 1:
        sorted_p, idx = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= p.top_p  # keep the smallest prefix reaching top_p
        probs = probs.masked_fill(drop.scatter(-1, idx, drop), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


class TopTree(Proposer):
    """Drafts the target's two likeliest next tokens, each with its likeliest child (test-only)."""

    feature_layers = None

    def __init__(self, model):
        self.model, self.memo = model, {}

    @torch.no_grad()
    def _draft(self, ctx: tuple) -> list[int]:
        if ctx not in self.memo:
            p1 = self.model(torch.tensor([ctx])).logits[0, -1].topk(2).indices.tolist()
            kids = [int(self.model(torch.tensor([ctx + (a,)])).logits[0, -1].argmax()) for a in p1]
            self.memo[ctx] = [p1[0], kids[0], p1[1], kids[1]]
        return self.memo[ctx]

    def propose(self, inp):
        rows = [self._draft(tuple(inp.tokens[r])) for r in inp.rows]
        tree = DraftTree.chains(rows)
        tree.parents[:] = torch.tensor([-1, 0, -1, 2])
        return tree


@torch.no_grad()
def exact_marginals(model, prompt, params) -> list[torch.Tensor]:
    """P(token at generated position i) for i < POSITIONS, by enumerating all prefixes."""
    margs, prefixes, weights = [], [[]], torch.ones(1)
    for _ in range(POSITIONS):
        seqs = torch.tensor([prompt + s for s in prefixes])
        probs = probs_from_logits(model(seqs).logits[:, -1], params)  # [P, V]
        joint = weights[:, None] * probs
        margs.append(joint.sum(0))
        prefixes = [s + [v] for s in prefixes for v in range(V)]
        weights = joint.flatten()
    return margs


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Statistic and degrees of freedom, cells with expected < 5 merged into one."""
    n = counts.sum()
    exp = probs * n
    small = exp < 5
    obs_c = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    exp_c = torch.cat([exp[~small], exp[small].sum()[None]]) if small.any() else exp
    keep = exp_c > 0
    stat = float(((obs_c[keep] - exp_c[keep]) ** 2 / exp_c[keep]).sum())
    return stat, int(keep.sum()) - 1


def chi2_critical(df: int, z: float = 3.29) -> float:
    """Upper quantile (z = 3.29: p = 0.0005) by the Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, max_new_tokens=POSITIONS),
                                    SamplingParams(temperature=0.7, top_k=6, top_p=0.9, max_new_tokens=POSITIONS)],
                         ids=["t1", "t0.7-k6-p0.9"])
def test_speculative_sampling_matches_target_distribution(params):
    model = _target()
    prompt = [3, 1, 4, 1, 5]
    counts = torch.zeros(POSITIONS, V)
    accepted = 0
    proposer = TopTree(model)
    for rnd in range(ROUNDS):
        eng = RolloutEngine(model, EngineConfig(max_batch=BATCH, max_len=32, arm=Arm(2, 2, 4), seed=rnd,
                                                 elastic_threshold=BATCH),
                            proposer=proposer)
        res = eng.generate([prompt] * BATCH, params)
        accepted += sum(s.accepted for s in res.steps)
        for out in res.outputs:
            for i, t in enumerate(out[:POSITIONS]):
                counts[i, t] += 1
    assert accepted > ROUNDS * BATCH * 0.3  # drafts were accepted often
    exact = exact_marginals(model, prompt, params)
    wrong = exact_marginals(model, prompt, SamplingParams(temperature=params.temperature * 1.6,
                                                          max_new_tokens=POSITIONS))
    for i in range(POSITIONS):
        stat, df = chi_square(counts[i], exact[i])
        print(f"{params.temperature} position {i}: chi2 {stat:.1f} (df {df}, critical {chi2_critical(df):.1f})")
        assert stat < chi2_critical(df), (i, stat, df)
        bad, bdf = chi_square(counts[i], wrong[i])
        assert bad > chi2_critical(bdf), ("the test cannot tell a wrong distribution", i, bad)
