"""Lossless verification of a draft tree against the target.

Owns the acceptance rule. For each request the verifier walks down from the root (the last
committed token): it takes the target's own draw ``y`` at the current node -- the coupled sample of
:mod:`tlt.rollout.sampling` (the argmax when greedy), computed for every node at once on the device --
descends into the child whose draft token equals ``y`` if there is one, and otherwise stops with
``y`` as the bonus token. Every committed token is therefore the draw plain decoding makes at that
position for that seed, given the tokens before it: the drafts only decide how many of those draws
one target pass yields. This is target-only tree verification (as in SGLang with both accept
thresholds at 1.0); drafts are deterministic candidates, so no draft probabilities are needed.

Terms: *accepted* = draft nodes on the walked path; *bonus* = the final draw, always committed;
committed = accepted + 1.
"""

from __future__ import annotations

import dataclasses

import torch

from tlt.rollout.draft_tree import DraftTree
from tlt.rollout.sampling import RowSampling, sample


@dataclasses.dataclass
class VerifyResult:
    tokens: list[list[int]]  # committed tokens per request (accepted drafts then the bonus)
    nodes: list[list[int]]  # tree node index of each accepted draft (-1 excluded)
    logprobs: list[list[float]]  # log_softmax(logits / T) of each committed token
    drafted: int = 0  # valid draft nodes over the batch


def verify(logits: torch.Tensor, tree: DraftTree, sampling: RowSampling, positions: torch.Tensor,
           stop_ids: list[tuple[int, ...]]) -> VerifyResult:
    """Walk each request's tree.

    logits: [B, 1 + N, V] target logits at the root (index 0) and at each draft node (1 + j);
    positions: [B, 1 + N] absolute position of the token each logits row produces (the row's own
    position + 1); stop_ids: per request (a stop ends the walk). One device -> host read: the
    draws, their log-probs and the tree.
    """
    b, n = tree.tokens.shape
    if logits.shape[:2] != (b, 1 + n) or positions.shape != (b, 1 + n):
        raise ValueError(f"logits {tuple(logits.shape)} / positions {tuple(positions.shape)} do not match "
                         f"a tree of {b} x {n} nodes")
    dev = logits.device
    choice, lp = sample(logits, sampling, positions)  # [B, 1 + N] each
    host = torch.cat([choice.double(), lp.double(), tree.tokens.to(dev).double(), tree.parents.to(dev).double(),
                      tree.valid.to(dev).double()], 1).tolist()  # [B, 2 + 5N]
    out_tokens: list[list[int]] = []
    out_nodes: list[list[int]] = []
    out_lps: list[list[float]] = []
    for i in range(b):
        row = host[i]
        draws, lps = row[: 1 + n], row[1 + n: 2 + 2 * n]
        toks, parents, valid = row[2 + 2 * n: 2 + 3 * n], row[2 + 3 * n: 2 + 4 * n], row[2 + 4 * n:]
        children: dict[int, dict[int, int]] = {}
        for j in range(n):
            if valid[j]:
                # First node wins on duplicate tokens under one parent (proposers should not emit them).
                children.setdefault(int(parents[j]), {}).setdefault(int(toks[j]), j)
        cur, committed, nodes, clps = -1, [], [], []
        while True:
            y = int(draws[cur + 1])  # the draw at the current node's logits row
            committed.append(y)
            clps.append(lps[cur + 1])
            nxt = children.get(cur, {}).get(y)
            if nxt is None or y in stop_ids[i]:
                break
            nodes.append(nxt)
            cur = nxt
        out_tokens.append(committed)
        out_nodes.append(nodes)
        out_lps.append(clps)
    return VerifyResult(out_tokens, out_nodes, out_lps, int(sum(sum(r[2 + 4 * n:]) for r in host)))
