"""One verify pass over the union of two proposers' trees (EAGLE's and the suffix drafter's).

Owns :class:`UnionProposer`, a :class:`~tlt.rollout.draft_tree.Proposer`. For an arm of ``topk`` paths
and ``tokens_to_verify`` nodes, each of the two proposers drafts with half of both (same depth); the
two trees are merged per row into one trie (a node the first tree already has, same parent and
token, is not added twice), so one verify pass checks both sources. Measured by ``python
examples/research/drafters.py``; the engine's arms use one proposer per step, and this stays an
experiment unless it wins.
"""

from __future__ import annotations

import dataclasses

from tlt.rollout.draft_tree import DraftTree, Proposer, ProposerInput
from tlt.rollout.strategy import Arm


class UnionProposer(Proposer):
    def __init__(self, first: Proposer, second: Proposer) -> None:
        if first.feature_layers is not None and second.feature_layers is not None \
                and tuple(first.feature_layers) != tuple(second.feature_layers):
            raise ValueError("UnionProposer: the two proposers read different target features")
        self.first, self.second = first, second
        self.feature_layers = first.feature_layers if first.feature_layers is not None else second.feature_layers

    @property
    def catch_up_s(self) -> float:
        """Both proposers' catch-up of the last proposal (read after the step's sync)."""
        return self.first.catch_up_s + self.second.catch_up_s

    @property
    def capture_s(self) -> float:
        return self.first.capture_s + self.second.capture_s

    @property
    def kv_position_bytes(self) -> int:
        return self.first.kv_position_bytes + self.second.kv_position_bytes

    def forget(self, rids) -> None:
        self.first.forget(rids)
        self.second.forget(rids)

    def close(self) -> None:
        self.first.close()
        self.second.close()

    def propose(self, inp: ProposerInput) -> DraftTree:
        arm = inp.arm
        if arm.is_off:
            return DraftTree.empty(len(inp.rows))
        half = Arm(arm.depth, max(1, arm.topk // 2), max(1, arm.tokens_to_verify // 2))
        a = self.first.propose(dataclasses.replace(inp, arm=half,
                                                   features=inp.features if self.first.feature_layers is not None else None))
        b = self.second.propose(dataclasses.replace(inp, arm=half,
                                                    features=inp.features if self.second.feature_layers is not None else None))
        return merge(a, b, arm.tokens_to_verify)


def merge(a: DraftTree, b: DraftTree, limit: int) -> DraftTree:
    """Per row, ``b``'s valid nodes added to ``a``'s as one trie (at most ``limit`` nodes)."""
    rows = []
    for i in range(a.tokens.shape[0]):
        toks, pars, node = [], [], {}  # node: (parent, token) -> index in the merged row
        for tree in (a, b):
            index = {}  # this tree's node j -> merged index
            for j, (t, p, v) in enumerate(zip(tree.tokens[i].tolist(), tree.parents[i].tolist(), tree.valid[i].tolist())):
                if not v or (p >= 0 and p not in index):  # invalid, or its parent was cut
                    continue
                parent = index[p] if p >= 0 else -1
                key = (parent, t)
                if key not in node:
                    if len(toks) >= limit:
                        continue
                    node[key] = len(toks)
                    toks.append(t)
                    pars.append(parent)
                index[j] = node[key]
        rows.append(list(zip(toks, pars)))
    return DraftTree.from_nodes(rows, device=a.tokens.device)
