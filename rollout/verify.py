"""Lossless verification of a draft tree against the target, walked on the device.

Owns the acceptance rule. For each request the verifier walks down from the root (the last
committed token): it takes the target's own draw ``y`` at the current node -- the coupled sample of
:mod:`tlt.rollout.sampling` (the argmax when greedy), computed for every node at once on the device --
descends into the child whose draft token equals ``y`` if there is one (the first such node when a
proposer emitted duplicates), and otherwise stops with ``y`` as the bonus token; a ``y`` that is a
stop token ends the walk. Every committed token is therefore the draw plain decoding makes at that
position for that seed, given the tokens before it: the drafts only decide how many of those draws
one target pass yields. This is target-only tree verification (as in SGLang with both accept
thresholds at 1.0); drafts are deterministic candidates, so no draft probabilities are needed.

The walk is a fixed number of batched device steps (the tree's depth bound), with no per-node or
per-row host work; the host reads one packed result.

Terms: *accepted* = draft nodes on the walked path; *bonus* = the final draw, always committed;
committed = accepted + 1.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from tlt.rollout.draft_tree import DraftTree
from tlt.rollout.sampling import RowSampling, sample
from tlt.rollout.transfers import intended_sync


@dataclasses.dataclass
class VerifyResult:
    tokens: list[list[int]]  # committed tokens per request (accepted drafts then the bonus)
    nodes: list[list[int]]  # tree node index of each accepted draft (-1 excluded)
    logprobs: list[list[float]]  # log_softmax(logits / T) of each committed token
    drafted: int = 0  # valid draft nodes over the batch
    # The same on the device (the engine updates its state from these without a host round trip):
    path: torch.Tensor | None = None  # [B, D] long: accepted node at each depth, -1 past the last
    committed: torch.Tensor | None = None  # [B, D + 1] long: committed tokens (valid up to count)
    count: torch.Tensor | None = None  # [B] long: committed tokens per request (accepted + 1)
    wait_s: float = 0.0  # seconds the host waited in the read for the device to finish the step


def stop_table(stop_ids: list[tuple[int, ...]], device: torch.device | str) -> torch.Tensor:
    """[B, K] long: each request's stop ids, padded with -1 (K >= 1)."""
    k = max(1, max(map(len, stop_ids), default=0))
    return torch.tensor([list(s) + [-1] * (k - len(s)) for s in stop_ids], dtype=torch.long,
                        device=device).reshape(len(stop_ids), k)


def walk(draws: torch.Tensor, tree: DraftTree, stops: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance walk: a next-row table built in one batched pass, then ``depth`` gathers.

    draws: [B, 1 + N] the target's draw at the root (0) and at each node (1 + j); stops: [B, K]
    stop ids (-1 padding); depth: a bound on the tree's depth (a deeper path is cut there, which
    only commits fewer tokens). Returns path [B, depth] (accepted node per depth, -1 past the last)
    and visit [B, depth + 1] (the logits row of each committed draw; repeats past the bonus)."""
    b, n = tree.tokens.shape
    cur = torch.zeros(b, 1, dtype=torch.long, device=draws.device)  # [B, 1] logits row of the current node
    if depth == 0 or n == 0:
        return torch.zeros(b, 0, dtype=torch.long, device=draws.device), cur
    parents = torch.where(tree.valid, tree.parents + 1, -1)  # [B, N] parent's logits row (root = 0)
    at = torch.arange(1 + n, device=draws.device)
    # [B, 1 + N, N]: node j is a child of logits row i and drafts the draw made at row i
    match = (parents[:, None, :] == at[None, :, None]) & (tree.tokens[:, None, :] == draws[:, :, None])
    stop = (draws[..., None] == stops[:, None, :]).any(-1)  # [B, 1 + N] the draw there is a stop token
    # the logits row the walk moves to from each row: the first matching child's; -1 ends the walk
    nxt = torch.where(match.any(-1) & ~stop, match.long().argmax(-1) + 1, -1)
    path, visit = [], [cur]
    for _ in range(depth):
        step = nxt.gather(1, cur)  # [B, 1]; an ended walk stays where it ended (its row's entry is -1)
        path.append(torch.where(step >= 0, step - 1, -1))
        cur = torch.where(step >= 0, step, cur)
        visit.append(cur)
    return torch.cat(path, 1), torch.cat(visit, 1)


def verify_on_device(logits: torch.Tensor, tree: DraftTree, sampling: RowSampling, positions: torch.Tensor,
                     stops: torch.Tensor, depth: int) -> dict[str, torch.Tensor]:
    """The draws, the walk and the packed verdict, all on the device (no host read: what a CUDA
    graph of the verify step captures). Returns packed [B, 4 + 3D] float64 (count, drafted, the
    committed tokens, their log-probs, the path), path [B, D], committed [B, D + 1], count [B]."""
    draws, lp = sample(logits, sampling, positions)  # [B, 1 + N] each
    path, visit = walk(draws, tree, stops, depth)
    if depth == 0 or tree.num_nodes == 0:  # a plain step (or nothing to walk): the root's draw
        count, committed, clp = torch.ones_like(draws[:, 0]), draws[:, :1], lp[:, :1]
    else:
        count = (path >= 0).sum(1) + 1  # [B]
        committed, clp = draws.gather(1, visit), lp.gather(1, visit)  # [B, D + 1]
    packed = torch.cat([count[:, None].double(), tree.valid.sum(1, keepdim=True).double(), committed.double(),
                        clp.double(), path.double()], 1)
    return {"packed": packed, "path": path, "committed": committed, "count": count}


def read_verdict(out: dict[str, torch.Tensor], b: int | None = None) -> VerifyResult:
    """The step's one device -> host read, of :func:`verify_on_device`'s packed verdict (its first
    ``b`` rows: a padded batch's real ones)."""
    rows = slice(None) if b is None else slice(0, b)
    d = out["path"].shape[1]
    t0 = time.perf_counter()
    with intended_sync(out["packed"].device):
        host = out["packed"][rows].tolist()
    wait_s = time.perf_counter() - t0
    out_tokens, out_nodes, out_lps = [], [], []
    for row in host:
        c = int(row[0])
        out_tokens.append([int(x) for x in row[2: 2 + c]])
        out_lps.append(row[3 + d: 3 + d + c])
        out_nodes.append([int(x) for x in row[4 + 2 * d: 4 + 2 * d + c - 1]])
    return VerifyResult(out_tokens, out_nodes, out_lps, int(sum(r[1] for r in host)), out["path"][rows],
                        out["committed"][rows], out["count"][rows], wait_s)


def verify(logits: torch.Tensor, tree: DraftTree, sampling: RowSampling, positions: torch.Tensor,
           stops: torch.Tensor | list[tuple[int, ...]], depth: int | None = None) -> VerifyResult:
    """Walk each request's tree.

    logits: [B, 1 + N, V] target logits at the root (index 0) and at each draft node (1 + j);
    positions: [B, 1 + N] absolute position of the token each logits row produces (the row's own
    position + 1); stops: [B, K] stop ids (:func:`stop_table`) or a tuple per request (a stop ends
    the walk); depth: a bound on the tree's depth (default: its node count). One device -> host
    read: the committed tokens, their log-probs and the drafted count.
    """
    b, n = tree.tokens.shape
    if logits.shape[:2] != (b, 1 + n) or positions.shape != (b, 1 + n):
        raise ValueError(f"logits {tuple(logits.shape)} / positions {tuple(positions.shape)} do not match "
                         f"a tree of {b} x {n} nodes")
    if not isinstance(stops, torch.Tensor):
        stops = stop_table(stops, logits.device)
    d = n if depth is None else min(depth, n)
    return read_verdict(verify_on_device(logits, tree, sampling, positions, stops, d))
