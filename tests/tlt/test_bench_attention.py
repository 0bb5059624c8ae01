"""`tlt bench attention --quick` on CPU: every row (decode, verify, draft level; the paged layout's
verify) is timed for both kernels, with its bound, and the record says what it measured."""

from __future__ import annotations

import json

from tlt.cli import main


def test_bench_attention_quick_writes_every_row(tmp_path):
    out = tmp_path / "attention.json"
    assert main(["-q", "bench", "attention", "--quick", "--repeats", "1", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert {(r["context"], r["batch"], r["kind"]) for r in rec["rows"]} == {
        (c, b, k) for c in (256, 1024) for b in (1, 2) for k in ("decode", "verify", "draft level")}
    assert all(r["engine_ms"] > 0 and r["causal_ms"] > 0 and r["sdpa_ms"] > 0 and r["bound_ms"] > 0 for r in rec["rows"])
    assert [(r["batch"], r["block_size"]) for r in rec["paged"]] == [(1, 16), (2, 16)]
    assert all(r["engine_ms"] > 0 for r in rec["paged"]) and rec["bandwidth_tbs"]["used"] > 0
    assert rec["summary"][0].startswith("attention, one layer")


def test_the_masked_and_causal_rows_attend_to_the_same_positions():
    """The bench's tree mask (a chain's) shows each query what a causal tail does, so ``causal_ms``
    against ``engine_ms`` is what the mask costs, nothing else."""
    import torch

    from tlt.bench.attention import chain_tail
    from tlt.rollout.attention import AttnMeta

    ctx = torch.tensor([7, 0, 30])
    for q, w in ((1, 1), (5, 5), (1, 5)):
        masked = AttnMeta.rows(ctx, w, 40, tail=chain_tail(3, q, w, torch.device("cpu")))
        assert torch.equal(masked.visible(q), AttnMeta.rows(ctx, w, 40).visible(q))
