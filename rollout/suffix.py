"""Model-free suffix drafter: drafts from the request's prompt, its own output and its GRPO siblings.

Owns :class:`SuffixConfig` and :class:`SuffixProposer`, a :class:`~tlt.rollout.draft_tree.Proposer` used
beside the EAGLE drafter (an arm of its own). Matching is plain Python over incremental dict
indexes: every token is indexed once, when it arrives, into one table per GRPO group (its members'
outputs, in arrival order) and one per distinct prompt, so a proposal costs one lookup per match
length and source kind, whatever the group's size; torch is touched only to pack the final
:class:`~tlt.rollout.draft_tree.DraftTree`. Proposers only propose: verification stays lossless whatever
is drafted here.

Matching rules
--------------
Context
    A request's context is ``prompt + output``, output being every token passed to ``accept``.
Occurrence
    A position ``p`` of some source sequence whose preceding ``n`` tokens equal the last ``n``
    tokens of the context. Its *continuation* is ``source[p : p + arm.depth]``; an occurrence with
    an empty continuation (the source ends at ``p``) never counts.
Sources
    * own prompt (``use_prompt``): positions ``p < len(prompt)`` of the request's own sequence;
    * own output (``use_own_output``): positions ``p >= len(prompt)`` of its own sequence. The
      current end ``p == len(context)`` has an empty continuation, so a request never matches
      itself trivially; a continuation may run up to the current end;
    * siblings (``use_siblings``): positions ``p >= len(sibling prompt)`` of any other request of
      the same GRPO group, running or finished. Only continuations starting in a sibling's output
      count (the matched n-gram itself may lie in its prompt): the shared prompt is covered by the
      request's own prompt and is not counted once per sibling. Other groups are never used.
    * history (a :class:`HistorySource` given to the proposer, :mod:`tlt.rollout.history`): the same
      prompt's responses from earlier RL steps and a bounded pool of recent responses across
      prompts, each a corpus (responses joined by a separator no continuation crosses), indexed
      by the proposer on first use (kept while recently used). Its stamps are older than every prompt token;
      the corpora are taken in the order the source gives them (the prompt's own, then the pool).
Match length
    Suffix lengths ``n = min(max_n, len(context))`` down to ``min_n`` are tried. A position found
    at several lengths counts once, at its longest. Occurrences are collected longest ``n`` first,
    most recent first within one ``n``, at most ``max_occurrences`` in all, so shorter matches only
    fill the slots longer ones left (with the default 8 slots a proposal reads few occurrences:
    on the demo's task 32 slots gave 0.5% more accept length at 1.5x the cost). No occurrence at any
    ``n >= min_n``: no draft (an all-invalid row), never a guess.
Ranking
    The collected continuations form a trie whose root is the last verified token. Every trie node
    gets the key ``(match length, frequency, recency)``: the longest ``n`` among the occurrences
    whose continuation passes through the node; how many of those (at that ``n``) pass through it;
    the newest of their stamps. An occurrence's stamp is when its continuation's first token came:
    prompt tokens are older than every output token (the prompt in position order), output tokens
    are ordered by a global counter bumped for every committed token, across all requests. Keys
    compare lexicographically, higher first; two distinct nodes never tie (stamps are unique).
Tree
    Paths are taken greedily. The first descends from the root to the best child at every level;
    each next one starts at the best not-yet-taken child of any node already in the tree (best
    branch point, whatever its depth) and descends greedily again. At most ``arm.topk`` paths
    (distinct continuations, so ``topk == 1`` gives a chain), at most ``arm.depth`` deep, at most
    ``arm.tokens_to_verify`` nodes in all (the last path is cut). Nodes are emitted in the order
    taken, so a parent always precedes its children. ``Arm.off()`` gives an empty tree. A chain
    takes the same greedy path without building the trie (:mod:`tlt.rollout.suffix_tree`).

Lifetime
--------
Inside the engine, :meth:`SuffixProposer.propose` gets a
:class:`~tlt.rollout.draft_tree.ProposerInput` and brings the index up to date from it first: a new
generation starts over, new requests are started, tokens committed since the last proposal are
accepted (so nothing is indexed while speculation is off, and siblings' tokens are stamped per
proposal rather than per step), and requests that left the running rows are finished. Requests that
join a running generation are started at the first proposal that sees them, in their own group
(a request moved here from another engine keeps its group key, so its siblings here are its
siblings, and its prompt's history is this proposer's). The index
API below is public for replays (the tests' ``tests/rollout/suffix_eval.py``): ``start`` indexes the prompt
(siblings with equal prompts share one prompt index); ``accept``
indexes each committed token (``max_n - min_n + 1`` dict appends per token); ``finish`` freezes
a request, whose sequence stays a source for its siblings. When the last running request of a
group finishes, the group's data are dropped (``drop_finished_groups=True``, the default; with
``False`` call :meth:`SuffixProposer.clear_group` or :meth:`SuffixProposer.reset`). A request id
can be reused once its group is dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Iterable, Sequence

import torch

from tlt.rollout.draft_tree import DraftTree, Proposer, ProposerInput, request_ids
from tlt.rollout.suffix_index import MEMBER_BITS, MEMBER_MASK, Group, HistorySource, IndexedSeq, NgramIndex
from tlt.rollout.suffix_tree import SEP, chain, trie_paths
from tlt.rollout.step_upload import StepUpload
from tlt.rollout.strategy import Arm

logger = logging.getLogger(__name__)

__all__ = ["SuffixConfig", "SuffixProposer", "SEP"]  # the index structures: tlt.rollout.suffix_index


@dataclasses.dataclass(frozen=True, kw_only=True)
class SuffixConfig:
    min_n: int = 1  # shortest context suffix that may match
    max_n: int = 4  # longest context suffix tried (longer = more precise, more index entries)
    max_occurrences: int = 8  # occurrences (candidate continuations) gathered per request and step
    use_prompt: bool = True  # the request's own prompt
    use_own_output: bool = True  # the request's own output so far
    use_siblings: bool = True  # outputs of the other requests of its GRPO group
    drop_finished_groups: bool = True  # free a group's data when its last request finishes

    def __post_init__(self) -> None:
        for name in ("min_n", "max_n", "max_occurrences"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"SuffixConfig.{name} must be an int, got {value!r}")
        for name in ("use_prompt", "use_own_output", "use_siblings", "drop_finished_groups"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SuffixConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.min_n < 1:
            raise ValueError(f"SuffixConfig.min_n must be >= 1, got {self.min_n}")
        if self.max_n < self.min_n:
            raise ValueError(f"SuffixConfig.max_n ({self.max_n}) must be >= min_n ({self.min_n})")
        if self.max_n > 32:
            raise ValueError(f"SuffixConfig.max_n must be <= 32 (index cost grows with it), got {self.max_n}")
        if self.max_occurrences < 1:
            raise ValueError(f"SuffixConfig.max_occurrences must be >= 1, got {self.max_occurrences}")
        if not (self.use_prompt or self.use_own_output or self.use_siblings):
            raise ValueError("SuffixConfig: use_prompt, use_own_output and use_siblings are all False; "
                             "enable at least one source (or run with Arm.off())")


def _as_list(tokens: Iterable[int]) -> list[int]:
    return [int(t) for t in (tokens.tolist() if hasattr(tokens, "tolist") else tokens)]


class SuffixProposer(Proposer):
    """The model-free drafter (see the module docstring for the exact rules)."""

    feature_layers = None  # needs no target features
    packs_upload = True  # its trees travel with the step's grown tables
    TABLE_TOKENS = 1 << 15  # history tokens whose n-gram tables are kept (a few MiB)

    def __init__(self, config: SuffixConfig | None = None, history: HistorySource | None = None) -> None:
        self.config = config if config is not None else SuffixConfig()
        self.history = history
        # seconds the last proposal spent taking in what arrived since its last call (a new generation's
        # requests and history corpora, tokens other arms committed): not this arm's drafting cost
        self.catch_up_s = 0.0
        self._reqs: dict[int, IndexedSeq] = {}
        self._groups: dict[int, Group] = {}
        self._clock = 0
        self._generation: int | None = None  # ProposerInput.generation being followed
        self._live: set[int] = set()  # its requests started and not finished
        self._started: set[int] = set()  # its requests ever started (a dropped group's stay dropped)
        # id(history corpus) -> (corpus, its n-gram table), least recently used first; kept across
        # generations (corpora never change; a history step replaces them), at most TABLE_TOKENS
        self._tables: collections.OrderedDict[int, tuple[IndexedSeq, dict]] = collections.OrderedDict()
        self._table_tokens = 0

    # --- lifetime ---------------------------------------------------------------------------

    def start(self, rids: Sequence[int], groups: Sequence[int], prompts: Sequence[Sequence[int]],
              features=None) -> None:
        if not (len(rids) == len(groups) == len(prompts)):
            raise ValueError(f"start: rids, groups and prompts must have one entry per request, got "
                             f"{len(rids)}, {len(groups)}, {len(prompts)}")
        if len(set(rids)) != len(rids):
            raise ValueError(f"start: duplicate request ids in {list(rids)}")
        for rid in rids:
            if rid in self._reqs:
                raise ValueError(f"start: request {rid} is already registered")
        for rid, gid, prompt in zip(rids, groups, prompts):
            prompt = _as_list(prompt)
            group = self._groups.get(gid)
            if group is None:
                group = self._groups[gid] = Group(gid)
            key = tuple(prompt)
            shared = group.prompt_indexes.get(key)
            seq = IndexedSeq(rid, group, len(prompt), shared if shared is not None else NgramIndex())
            if self.history is not None:
                seq.history = [(c, self._corpus_table(c)) for c in self.history.sources(key)]
            self._append(seq, prompt, index_prompt=shared is None)
            if shared is None:
                group.prompt_indexes[key] = seq.prompt_index
            seq.member = len(group.members)
            if seq.member > MEMBER_MASK:
                raise ValueError(f"start: group {gid} has more than {MEMBER_MASK + 1} requests")
            group.members.append(seq)
            group.running += 1
            self._reqs[rid] = seq

    def accept(self, rids: Sequence[int], tokens: Sequence[Sequence[int]],
               features: Sequence[torch.Tensor] | None = None) -> None:
        del features  # model-free
        if len(rids) != len(tokens):
            raise ValueError(f"accept: {len(rids)} request ids but {len(tokens)} token lists")
        for rid, toks in zip(rids, tokens):
            seq = self._running(rid, "accept")
            self._append(seq, _as_list(toks), index_prompt=False)

    def finish(self, rids: Sequence[int]) -> None:
        for rid in rids:
            seq = self._running(rid, "finish")
            seq.finished = True
            group = seq.group
            group.running -= 1
            assert group.running >= 0
            if group.running == 0 and self.config.drop_finished_groups:
                self.clear_group(group.gid)

    def clear_group(self, gid: int) -> None:
        """Forget a group (its requests, running or not, become unknown ids)."""
        group = self._groups.pop(gid, None)
        if group is None:
            raise ValueError(f"clear_group: unknown group {gid}")
        for seq in group.members:
            del self._reqs[seq.rid]
        logger.debug("suffix drafter: dropped group %s (%d requests)", gid, len(group.members))

    def reset(self) -> None:
        """Forget every request (e.g. between RL steps); history corpora stay indexed (they never change)."""
        self._reqs.clear()
        self._groups.clear()
        self._generation, self._live, self._started = None, set(), set()

    @property
    def num_requests(self) -> int:
        """Known requests, running or finished-but-kept."""
        return len(self._reqs)

    # --- proposing --------------------------------------------------------------------------

    def propose(self, inp: ProposerInput) -> DraftTree:
        """The engine's entry point: update the index from ``inp``, then draft for its rows."""
        if inp.arm.is_off:
            return DraftTree.empty(len(inp.rows))
        t0 = time.perf_counter()
        if inp.generation != self._generation:
            self.reset()
            self._generation = inp.generation
        for r in inp.rows:  # left and came back under its id (an engine's eviction): running again
            if r in self._started and r not in self._live:
                seq = self._reqs.get(r)
                if seq is None:  # its group was dropped meanwhile: it starts over
                    self._started.discard(r)
                else:
                    seq.finished = False
                    seq.group.running += 1
                    self._live.add(r)
        new = [r for r in request_ids(inp.tokens) if r not in self._started]  # joined since the last call
        if new:
            self.start(new, [inp.groups[r] for r in new], [inp.tokens[r][: inp.prompt_lens[r]] for r in new])
            self._started.update(new)
            self._live.update(new)
        running = set(inp.rows)
        for r in sorted(self._live):  # running requests and those that finished since the last call
            seq = self._reqs[r]
            if len(inp.tokens[r]) > len(seq.tokens):
                self._append(seq, list(inp.tokens[r][len(seq.tokens):]), index_prompt=False)
            if r not in running:
                self._live.discard(r)
                self.finish([r])
        self.catch_up_s = time.perf_counter() - t0
        return self.draft(inp.rows, inp.arm, inp.device, inp.upload)

    def draft(self, rids: Sequence[int], arm: Arm, device: torch.device | str = "cpu",
              upload: StepUpload | None = None) -> DraftTree:
        """Trees for requests ``rids`` from the index as it stands, on ``device`` (one upload:
        ``upload``'s, with what it holds already)."""
        if arm.is_off:
            return DraftTree.empty(len(rids))
        return DraftTree.from_nodes([self._draft(self._running(rid, "propose"), arm) for rid in rids], device=device,
                                    upload=upload)

    # --- internals --------------------------------------------------------------------------

    def _running(self, rid: int, op: str) -> IndexedSeq:
        seq = self._reqs.get(rid)
        if seq is None:
            raise ValueError(f"{op}: unknown request {rid} (never started, or its group was dropped)")
        if seq.finished:
            raise ValueError(f"{op}: request {rid} has finished")
        return seq

    def _append(self, seq: IndexedSeq, new: list[int], *, index_prompt: bool) -> None:
        """Append tokens; each token at position q makes the n-grams ending at q - 1 occurrences at q
        (an occurrence is indexed once its continuation has a token, so table order is stamp order)."""
        lo, hi = self.config.min_n, self.config.max_n
        toks, plen, stamps = seq.tokens, seq.prompt_len, seq.stamps
        outputs = seq.group.outputs
        for t in new:
            q = len(toks)
            if q < plen:  # prompt token: older than any output, ordered by position
                stamps.append(q - plen)
                toks.append(t)
                if not index_prompt:
                    continue
                table, value = seq.prompt_index.table, q
            else:
                stamps.append(self._clock)
                self._clock += 1
                toks.append(t)
                table, value = outputs, q << MEMBER_BITS | seq.member
            for n in range(lo, min(hi, q) + 1):
                key = tuple(toks[q - n:q])
                bucket = table.get(key)
                if bucket is None:
                    table[key] = [value]
                else:
                    bucket.append(value)

    def _occurrences(self, seq: IndexedSeq) -> list[tuple[int, int, IndexedSeq, int]]:
        """(match length n, stamp, source, position) of the collected occurrences, best first.

        Within one n, newest first: the group's outputs (stamp order), then the request's own prompt
        (older than any output), then its history corpora in the order given (older still)."""
        cfg, ctx = self.config, seq.tokens
        cap, own, sib = cfg.max_occurrences, cfg.use_own_output, cfg.use_siblings
        outputs = seq.group.outputs if (own or sib) else {}
        members = seq.group.members
        prompt = seq.prompt_index.table if cfg.use_prompt else {}
        found: list[tuple[int, int, IndexedSeq, int]] = []
        # each occurrence counted once, at its longest n: output codes (position and member), own
        # prompt positions, (corpus index, position) of history corpora
        seen_out: set[int] = set()
        seen_prompt: set[int] = set()
        seen_hist: set[tuple[int, int]] = set()
        size = len(ctx)
        for n in range(min(cfg.max_n, size), cfg.min_n - 1, -1):
            key = tuple(ctx[size - n:])
            hits = outputs.get(key)
            if hits:
                for code in reversed(hits):
                    src = members[code & MEMBER_MASK]
                    if (not own and src is seq) or (not sib and src is not seq) or code in seen_out:
                        continue
                    seen_out.add(code)
                    p = code >> MEMBER_BITS
                    found.append((n, src.stamps[p], src, p))
                    if len(found) >= cap:
                        return found
            hits = prompt.get(key)
            if hits:
                for p in reversed(hits):
                    if p in seen_prompt:
                        continue
                    seen_prompt.add(p)
                    found.append((n, seq.stamps[p], seq, p))
                    if len(found) >= cap:
                        return found
            for c, (corpus, table) in enumerate(seq.history):
                hits = table.get(key)
                if hits:
                    for p in reversed(hits):
                        if (c, p) in seen_hist:
                            continue
                        seen_hist.add((c, p))
                        found.append((n, corpus.stamps[p], corpus, p))
                        if len(found) >= cap:
                            return found
        return found

    def _corpus_table(self, corpus: IndexedSeq) -> dict[tuple[int, ...], list[int]]:
        """A history corpus's n-grams (positions ascending), indexed on first use and kept while
        it is among the TABLE_TOKENS most recently used history tokens (a replica runs many
        generations per RL step over the same corpora; indexing the 8k-token pool takes ~0.1 s)."""
        hit = self._tables.get(id(corpus))
        if hit is not None:
            self._tables.move_to_end(id(corpus))
            return hit[1]
        table: dict[tuple[int, ...], list[int]] = {}
        toks, get = corpus.tokens, table.get
        for n in range(self.config.min_n, self.config.max_n + 1):
            # the n-grams ending at p - 1, for p = n .. len - 1 (one with an empty continuation never
            # counts); an n-gram holding SEP is indexed too but never looked up (no context has SEP)
            for p, key in enumerate(zip(*[toks[i:len(toks) - n + i] for i in range(n)]), n):
                bucket = get(key)
                if bucket is None:
                    table[key] = [p]
                else:
                    bucket.append(p)
        self._tables[id(corpus)] = (corpus, table)  # the corpus is kept: its id stays unique
        self._table_tokens += len(toks)
        while self._table_tokens > self.TABLE_TOKENS and len(self._tables) > 1:
            _, (old, _) = self._tables.popitem(last=False)
            self._table_tokens -= len(old.tokens)
        return table

    def _draft(self, seq: IndexedSeq, arm: Arm) -> list[tuple[int, int]]:
        """The tree for one request as (token, parent) pairs in topological order."""
        occurrences = self._occurrences(seq)
        if not occurrences:
            return []
        if arm.topk == 1:
            return chain(occurrences, min(arm.depth, arm.tokens_to_verify))
        return trie_paths(occurrences, arm)
