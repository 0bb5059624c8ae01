"""Responses of earlier RL steps, as draft sources for the model-free drafter.

Owns :class:`ResponseHistory`: RL feeds the same prompts back every epoch, so a prompt's earlier
responses are the cheapest strong draft source there is (DAS, HistoSpec, SPEC-RL). It keeps, per
prompt, the responses of the prompt's last ``visits`` rollouts (RL steps that sampled it), however
many steps ago: a prompt returns once per epoch, so a window counted in RL steps shorter than an
epoch would never hold a returning prompt's responses; the newest visits are kept because the policy
moves. Beside them, a bounded pool of the most recent responses across prompts. Each is one corpus
(:func:`corpus`: each response preceded by the last ``max_n`` tokens of its prompt, so a request that
has generated nothing yet matches its prompt's end and drafts the response's start; joined by
:data:`tlt.rollout.suffix.SEP`), which :class:`tlt.rollout.suffix.SuffixProposer` matches like a sibling's
output. Corpora are kept as tokens only (built when a request of the prompt first asks, dropped
when the prompt's history changes); the proposer indexes the ones its requests use and keeps
the recently used tables (:attr:`tlt.rollout.suffix.SuffixProposer.TABLE_TOKENS`). Memory is bounded by
``max_prompts`` (the least recently visited prompt goes first) x ``per_prompt`` responses and by
``global_tokens``; :meth:`ResponseHistory.stats` reports it.

Ordering: ``add`` replaces corpora, never mutates one a proposer holds, so a request that started
before an ``add`` keeps drafting from the corpora it looked up (a step's responses arrive between
steps anyway). Not thread-safe: its owner serialises ``add`` with proposals.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence

from tlt.rollout.suffix import SuffixConfig
from tlt.rollout.suffix_index import IndexedSeq, NgramIndex
from tlt.rollout.suffix_tree import SEP

_HISTORY_STAMP = -(1 << 40)  # history stamps count up from here: older than every prompt token


@dataclasses.dataclass(frozen=True, kw_only=True)
class HistoryConfig:
    visits: int = 2  # a prompt's responses from its last this many rollouts (the policy moves: older mislead); 0: none
    per_prompt: int = 32  # at most this many of a prompt's responses, newest kept
    max_prompts: int = 4096  # prompts kept; the least recently visited goes first
    global_tokens: int = 8192  # recent responses across prompts (0: no global pool)

    def __post_init__(self) -> None:
        for name in ("per_prompt", "max_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"HistoryConfig.{name}={getattr(self, name)}: use >= 1")
        if self.visits < 0:
            raise ValueError(f"HistoryConfig.visits={self.visits}: use >= 0 (0: no per-prompt history)")
        if self.global_tokens < 0:
            raise ValueError(f"HistoryConfig.global_tokens={self.global_tokens}: use >= 0 (0: no global pool)")


def corpus(responses: Iterable[Sequence[int]]) -> IndexedSeq:
    """A finished sequence of ``responses`` (oldest first) joined by SEP."""
    seq = IndexedSeq(-1, None, 0, NgramIndex())
    for resp in responses:
        seq.tokens += [int(t) for t in resp] + [SEP]
    seq.stamps = range(_HISTORY_STAMP, _HISTORY_STAMP + len(seq.tokens))  # indexable, no per-token int
    seq.finished = True
    return seq


class ResponseHistory:
    """Per-prompt visits of earlier responses and a global pool (see the module docstring)."""

    def __init__(self, config: HistoryConfig = HistoryConfig(), suffix: SuffixConfig | None = None) -> None:
        self.config, self.suffix = config, suffix or SuffixConfig()
        # prompt -> deque[(step, prompt tail + response)]; the global pool holds the same entries
        self._by_prompt: dict[tuple[int, ...], collections.deque] = {}
        self._recent: collections.deque = collections.deque()  # (step, prompt tail + response), oldest first
        self._corpora: dict[tuple[int, ...], IndexedSeq] = {}
        self._global: IndexedSeq | None = None
        self.step: int | None = None  # newest step added

    def add(self, step: int, pairs: Iterable[tuple[Sequence[int], Sequence[int]]]) -> int:
        """Step ``step``'s (prompt, response) pairs; drops what falls out of the bounds. Returns how many."""
        cfg, added, touched = self.config, 0, set()
        for prompt, response in pairs:
            key, resp = tuple(int(t) for t in prompt), [int(t) for t in response]
            if not resp:
                continue
            resp = list(key[-self.suffix.max_n:]) + resp
            if cfg.visits:
                q = self._by_prompt.pop(key, None) or collections.deque()  # re-inserted: last visited last
                q.append((step, resp))
                visits = sorted({s for s, _ in q})[-cfg.visits:]
                while len(q) > cfg.per_prompt or q[0][0] < visits[0]:
                    q.popleft()
                self._by_prompt[key] = q
                touched.add(key)
            self._recent.append((step, resp))
            added += 1
        while len(self._by_prompt) > cfg.max_prompts:
            touched.add(next(iter(self._by_prompt)))
            del self._by_prompt[next(iter(self._by_prompt))]
        self.step = step if self.step is None else max(self.step, step)
        tokens = sum(len(r) + 1 for _, r in self._recent)
        while self._recent and tokens > cfg.global_tokens:
            tokens -= len(self._recent.popleft()[1]) + 1
        for key in touched:  # rebuilt, not mutated: proposals in flight keep their corpora
            self._corpora.pop(key, None)
        if added:
            self._global = None
        return added

    def sources(self, prompt: tuple[int, ...]) -> list[IndexedSeq]:
        """The prompt's own history corpus and the global pool (either may be absent)."""
        out = []
        q = self._by_prompt.get(tuple(prompt))
        if q:
            if prompt not in self._corpora:
                self._corpora[prompt] = corpus(r for _, r in q)
            out.append(self._corpora[prompt])
        if self.config.global_tokens and self._recent:
            if self._global is None:
                self._global = corpus(r for _, r in self._recent)
            out.append(self._global)
        return out

    def pairs(self) -> list[tuple[int, list[int], list[int]]]:
        """Everything kept per prompt, as (step, prompt, response) in step order: what a restarted
        replica needs to rebuild this history (``add`` them back step by step, in this order). The
        global pool is rebuilt from them too; with ``visits=0`` there are none, and a restarted
        replica's pool refills from the next step's responses."""
        cut = self.suffix.max_n
        return sorted(((s, list(k), r[min(cut, len(k)):]) for k, q in self._by_prompt.items() for s, r in q),
                      key=lambda x: x[0])

    def stats(self) -> dict:
        responses = sum(len(q) for q in self._by_prompt.values())
        tokens = sum(len(r) for q in self._by_prompt.values() for _, r in q)  # prompt tails included
        return {"prompts": len(self._by_prompt), "responses": responses, "tokens": tokens,
                "global_tokens": sum(len(r) for _, r in self._recent), "step": self.step}
