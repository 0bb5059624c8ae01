"""Offline accept-length measurement of the suffix drafter on known rollouts (a test helper).

Owns :func:`measure_accept_length` and :class:`AcceptStats`. Given, per GRPO group, the prompt and
the sibling responses the target produced (greedy or sampled), it replays decoding with an
:class:`~tlt.rollout.suffix.SuffixProposer` in the loop and counts the tokens each verify step commits.

Acceptance is greedy against the known response: walk the draft tree from the root, following the
child whose token equals the response's next token; the matched nodes are *accepted*, and the
target's own next token is the *bonus* (absent only when the response ended inside the tree). With a
deterministic draft this is also exact for sampled responses: token-tree verification accepts a
point-mass draft token exactly when the target's sample equals it, and the response is that sample.

Schedules (``interleave``):
    * ``True`` (the realistic GRPO setting): every request of every group advances one verify step
      per round; all drafts of a round are proposed before any token of that round is accepted, so
      siblings only see what the others had generated before the round.
    * ``False`` (the deep-tail bound): the siblings of a group are decoded one after another, each
      seeing the previous siblings' complete responses (groups still run side by side).
Siblings that run in lockstep with identical text cannot help each other (none is ever ahead); the
gain from siblings comes from responses that are ahead in the shared text or already finished.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

import torch

from tlt.rollout.suffix import SuffixConfig, SuffixProposer
from tlt.rollout.strategy import Arm

logger = logging.getLogger(__name__)

__all__ = ["AcceptStats", "greedy_accept", "measure_accept_length"]

Group = tuple[Sequence[int], Sequence[Sequence[int]]]  # (prompt, sibling responses)


@dataclasses.dataclass(frozen=True)
class AcceptStats:
    steps: int  # verify steps (a step with an empty tree is a plain decode step: 1 token)
    tokens: int  # tokens committed = accepted + bonus
    accepted: int  # draft tokens accepted
    drafted_steps: int  # steps whose tree had at least one valid node
    proposed_nodes: int  # valid draft nodes sent to verification
    per_response: tuple[tuple[int, int], ...]  # (steps, tokens) per response, groups in order

    @property
    def mean_accept_length(self) -> float:
        """Tokens committed per verify step (1.0 = no gain over autoregressive decoding)."""
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def draft_precision(self) -> float:
        """Accepted draft tokens per proposed draft node."""
        return self.accepted / self.proposed_nodes if self.proposed_nodes else 0.0

    def response_accept_length(self, i: int) -> float:
        steps, tokens = self.per_response[i]
        return tokens / steps if steps else 0.0


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor,
                  target: Sequence[int]) -> int:
    """Longest root path of one request's tree matching ``target``'s prefix; returns its length.

    tokens, parents, valid: [N] one row of a :class:`~tlt.rollout.draft_tree.DraftTree`.
    """
    children: dict[int, dict[int, int]] = {}
    for j, (t, p, v) in enumerate(zip(tokens.tolist(), parents.tolist(), valid.tolist())):
        if v:
            children.setdefault(p, {}).setdefault(t, j)
    node, accepted = -1, 0
    for want in target:
        nxt = children.get(node, {}).get(want)
        if nxt is None:
            break
        node, accepted = nxt, accepted + 1
    return accepted


def measure_accept_length(groups: Sequence[Group] | Mapping[int, Group], arm: Arm, *,
                          config: SuffixConfig | None = None, interleave: bool = True) -> AcceptStats:
    """Replay every group's responses with the suffix drafter in the loop (see the module docstring).

    ``groups``: per GRPO group, ``(prompt, [response, ...])`` (token id lists), as a sequence or a
    mapping from group id. Returns the totals over all responses.
    """
    items = list(groups.items()) if isinstance(groups, Mapping) else list(enumerate(groups))
    proposer = SuffixProposer(config)
    rids, gids, prompts, targets = [], [], [], []
    for gid, (prompt, responses) in items:
        for resp in responses:
            rids.append(len(rids))
            gids.append(gid)
            prompts.append(list(prompt))
            targets.append([int(t) for t in resp])
    if not rids:
        raise ValueError("measure_accept_length: no responses given")
    proposer.start(rids, gids, prompts)

    pos = [0] * len(rids)  # tokens committed so far per response
    steps = [0] * len(rids)
    done = [False] * len(rids)
    accepted_total = drafted = proposed = 0
    for rid in rids:  # empty responses finish at once
        if not targets[rid]:
            done[rid] = True
            proposer.finish([rid])

    while not all(done):
        if interleave:
            live = [r for r in rids if not done[r]]
        else:  # per group, the first sibling not yet done
            first: dict[int, int] = {}
            for r in rids:
                if not done[r]:
                    first.setdefault(gids[r], r)
            live = list(first.values())
        tree = proposer.draft(live, arm)  # [B, N]
        commits = []
        for i, r in enumerate(live):
            rest = targets[r][pos[r]:]
            acc = greedy_accept(tree.tokens[i], tree.parents[i], tree.valid[i], rest)
            n_valid = int(tree.valid[i].sum())
            drafted += n_valid > 0
            proposed += n_valid
            accepted_total += acc
            commits.append(rest[:min(acc + 1, len(rest))])
        proposer.accept(live, commits)
        for r, c in zip(live, commits):
            pos[r] += len(c)
            steps[r] += 1
            if pos[r] == len(targets[r]):
                done[r] = True
                proposer.finish([r])

    stats = AcceptStats(steps=sum(steps), tokens=sum(pos), accepted=accepted_total, drafted_steps=drafted,
                        proposed_nodes=proposed, per_response=tuple(zip(steps, pos)))
    logger.info("n-gram AL %.3f over %d steps (%s, interleave=%s)", stats.mean_accept_length, stats.steps,
                arm, interleave)
    return stats
