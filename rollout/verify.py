"""Lossless verification of a draft tree against the target.

Owns the acceptance rule. For each request the verifier walks down from the root (the last
committed token): it draws the target's next token ``y ~ p(. | path)`` (the argmax when greedy),
descends into the child whose draft token equals ``y`` if there is one, and otherwise stops with
``y`` as the bonus token. Every committed token is therefore a draw from the target's own
(temperature / top-k / top-p processed) distribution given the tokens before it, which is exactly
autoregressive sampling: the drafts only decide how many of those draws one target pass yields.
This is target-only tree verification (as in SGLang with both accept thresholds at 1.0); since the
drafts are deterministic candidates (top-k, n-gram), no draft probabilities are needed.

Terms: *accepted* = draft nodes on the walked path; *bonus* = the final draw, always committed;
committed = accepted + 1.
"""

from __future__ import annotations

import dataclasses

import torch

from rollout.draft_tree import DraftTree
from rollout.generate import SamplingParams, probs_from_logits


@dataclasses.dataclass
class VerifyResult:
    tokens: list[list[int]]  # committed tokens per request (accepted drafts then the bonus)
    nodes: list[list[int]]  # tree node index of each accepted draft (-1 excluded)
    drafted: int = 0  # valid draft nodes over the batch


def verify(logits: torch.Tensor, tree: DraftTree, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> VerifyResult:
    """Walk each request's tree.

    logits: [B, 1 + N, V] target logits at the root (index 0) and at each draft node (1 + j).
    """
    b, n = tree.tokens.shape
    assert logits.shape[:2] == (b, 1 + n), (tuple(logits.shape), b, n)
    # One device -> host transfer for the whole walk: the argmax at every node, and the tree.
    host = torch.cat([logits.argmax(-1), tree.tokens.to(logits.device), tree.parents.to(logits.device),
                      tree.valid.to(logits.device, torch.long)], 1).tolist()  # [B, 1 + 3N]
    greedy_choice = [r[: 1 + n] for r in host]  # [B, 1 + N]
    toks = [r[1 + n: 1 + 2 * n] for r in host]
    parents = [r[1 + 2 * n: 1 + 3 * n] for r in host]
    valid = [r[1 + 3 * n:] for r in host]
    out_tokens: list[list[int]] = []
    out_nodes: list[list[int]] = []
    for i in range(b):
        p = params[i]
        children: dict[int, dict[int, int]] = {}
        for j in range(n):
            if valid[i][j]:
                # First node wins on duplicate tokens under one parent (proposers should not emit them).
                children.setdefault(parents[i][j], {}).setdefault(toks[i][j], j)
        cur, committed, nodes = -1, [], []
        while True:
            row = cur + 1  # logits row of the current node
            if p.temperature == 0:
                y = greedy_choice[i][row]
            else:
                probs = probs_from_logits(logits[i, row], p)
                y = int(torch.multinomial(probs, 1, generator=generators[i]))
            committed.append(y)
            nxt = children.get(cur, {}).get(y)
            if nxt is None or y in p.stop_ids:
                break
            nodes.append(nxt)
            cur = nxt
        out_tokens.append(committed)
        out_nodes.append(nodes)
    return VerifyResult(out_tokens, out_nodes, sum(map(sum, valid)))
