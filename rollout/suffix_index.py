"""The suffix drafter's index structures: the n-gram tables and the indexed sequences they point into.

Owns :class:`NgramIndex` (an n-gram -> the positions right after its occurrences), :class:`IndexedSeq`
(a request or a history corpus: its tokens, their stamps, its prompt index), :class:`Group` (a GRPO
group's members and the one table of their outputs) and :class:`HistorySource` (what the proposer
reads earlier responses from). How tokens enter these tables and how a proposal reads them is
:class:`tlt.rollout.suffix.SuffixProposer`'s (its module docstring states the rules);
:mod:`tlt.rollout.history` builds the history corpora.
"""

from __future__ import annotations

from typing import Protocol


class NgramIndex:
    """n-gram (tuple) -> the positions right after each of its occurrences, oldest first."""

    __slots__ = ("table",)

    def __init__(self) -> None:
        self.table: dict[tuple[int, ...], list[int]] = {}


class IndexedSeq:
    """One request (or a history corpus): its tokens, their stamps and its prompt index (its outputs
    are indexed in its group's table)."""

    __slots__ = ("rid", "group", "member", "tokens", "stamps", "prompt_len", "prompt_index", "finished", "history")

    def __init__(self, rid: int, group: "Group | None", prompt_len: int, prompt_index: NgramIndex) -> None:
        self.rid = rid
        self.group = group
        self.member = 0  # its index in group.members
        self.tokens: list[int] = []
        self.stamps: list[int] = []  # stamps[i]: i - prompt_len in the prompt, else the global clock
        self.prompt_len = prompt_len
        self.prompt_index = prompt_index  # positions p < prompt_len (may be shared with siblings)
        self.finished = False
        # its prompt's history corpora and their n-gram tables (looked up when it starts)
        self.history: list[tuple[IndexedSeq, dict[tuple[int, ...], list[int]]]] = []


class HistorySource(Protocol):
    """Earlier responses to draft from: indexed, finished sequences for a prompt (its own history, a
    global pool); :class:`tlt.rollout.history.ResponseHistory` is the implementation."""

    def sources(self, prompt: tuple[int, ...]) -> list[IndexedSeq]: ...


MEMBER_BITS = 16  # a group's members are numbered in the low bits of its output table's entries
MEMBER_MASK = (1 << MEMBER_BITS) - 1


class Group:
    """One GRPO group's requests and the n-gram table of their outputs."""

    __slots__ = ("gid", "members", "running", "prompt_indexes", "outputs")

    def __init__(self, gid: int) -> None:
        self.gid = gid
        self.members: list[IndexedSeq] = []
        self.running = 0
        self.prompt_indexes: dict[tuple[int, ...], NgramIndex] = {}  # equal prompts share one index
        # n-gram -> p << MEMBER_BITS | member for positions p >= prompt_len of every member's outputs,
        # in the order the token at p arrived (= stamp order): one lookup per n covers own output and
        # siblings. Ints, not (member, p) tuples: the tables hold no object the cyclic GC must walk.
        self.outputs: dict[tuple[int, ...], list[int]] = {}
