"""Draft trees from ranked occurrences: the suffix drafter's trie and its chain fast path.

Owns :func:`trie_paths` and :func:`chain` and :data:`SEP`. An occurrence is ``(n, stamp, source,
p)``: a match of length ``n`` whose continuation is ``source.tokens[p:]`` (cut at :data:`SEP`),
stamped by when its first token came. Occurrences arrive sorted by ``(n, stamp)`` descending
(:meth:`tlt.rollout.suffix.SuffixProposer._occurrences`); the ranking rules are in :mod:`tlt.rollout.suffix`'s
docstring. Both functions return ``(token, parent)`` pairs in topological order.
"""

from __future__ import annotations

import heapq

from tlt.rollout.strategy import Arm

__all__ = ["SEP", "chain", "trie_paths"]
SEP = -1  # separates the responses of a history corpus: never a token, so no n-gram matches across it


def trie_paths(occurrences: list, arm: Arm) -> list[tuple[int, int]]:
    """Up to ``arm.topk`` greedy paths through the trie of the occurrences' continuations."""
    # Trie node: [n, count, stamp, children]; (n, count, stamp) is its ranking key. Occurrences
    # arrive sorted by (n, stamp) descending, so the first one through a node sets n and stamp.
    root: list = [0, 0, -1, {}]
    for n, stamp, src, p in occurrences:
        node = root
        for tok in src.tokens[p:p + arm.depth]:
            if tok == SEP:  # a history response ends here
                break
            children = node[3]
            child = children.get(tok)
            if child is None:
                child = children[tok] = [n, 1, stamp, {}]
            elif child[0] == n:
                child[1] += 1
            node = child

    out: list[tuple[int, int]] = []
    heap: list = []  # branch points: (-n, -count, -stamp, token, node, parent index, depth)

    def push_children(node: list, parent: int, depth: int, skip: list | None) -> None:
        for tok, child in node[3].items():  # keys are unique (stamps are), so nodes are never compared
            if child is not skip:
                heapq.heappush(heap, (-child[0], -child[1], -child[2], tok, child, parent, depth))

    push_children(root, -1, 1, None)
    paths = 0
    while heap and paths < arm.topk and len(out) < arm.tokens_to_verify:
        _, _, _, tok, node, parent, depth = heapq.heappop(heap)
        paths += 1
        while True:  # greedy descent from the branch point
            out.append((tok, parent))
            if len(out) >= arm.tokens_to_verify or depth >= arm.depth or not node[3]:
                break
            best_tok, best = max(node[3].items(), key=lambda kv: (kv[1][0], kv[1][1], kv[1][2]))
            parent, depth = len(out) - 1, depth + 1
            push_children(node, parent, depth, best)
            tok, node = best_tok, best
    assert len(out) <= arm.tokens_to_verify
    return out

def chain(occurrences: list, depth: int) -> list[tuple[int, int]]:
    """The trie's greedy path without building the trie. At each level the occurrences still on the
    path vote for their next token. Occurrences come sorted by (n, stamp) descending, so the best
    child's n is the first voter's and only voters at that n decide (count, then the newest stamp,
    which is its first voter's); lower-n voters for the chosen token stay on the path for deeper
    levels, where they decide once no longer match continues."""
    conts = []  # (n, stamp, continuation up to depth, cut at a history separator)
    for n, stamp, src, p in occurrences:
        cont = src.tokens[p:p + depth]
        if SEP in cont:
            cont = cont[:cont.index(SEP)]
        if cont:
            conts.append((n, stamp, cont))
    out: list[tuple[int, int]] = []
    d = 0
    while conts:  # every entry has a token at level d
        top = conts[0][0]
        counts: dict[int, int] = {}
        first: dict[int, int] = {}
        for n, stamp, cont in conts:
            if n != top:
                break  # sorted: the rest have a shorter match
            tok = cont[d]
            if tok in counts:
                counts[tok] += 1
            else:
                counts[tok], first[tok] = 1, stamp
        tok = max(counts, key=lambda t: (counts[t], first[t])) if len(counts) > 1 else next(iter(counts))
        out.append((tok, d - 1))
        d += 1
        if d == depth:
            break
        conts = [c for c in conts if c[2][d - 1] == tok and len(c[2]) > d]
    return out
