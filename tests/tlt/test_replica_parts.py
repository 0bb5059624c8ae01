"""The replica's parts without Ray: the request batcher, the policy copy, the drift probe and the step statistics."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from tlt.drafter.model_config import ModelConfig
from tlt.rollout.generate import SamplingParams
from tlt.rollout.target import TargetModel
from tlt.integrations.verl.batcher import RequestBatcher
from tlt.integrations.verl.weight_sync import DriftProbe, copy_policy

P = SamplingParams(temperature=0.0, max_new_tokens=4)


def _target(seed: int = 0) -> TargetModel:
    torch.manual_seed(seed)
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return TargetModel(cfg).eval()


def test_batcher_groups_close_requests_isolates_failures_and_reports_idle():
    batches, idle = [], []

    def run(batch):
        batches.append([r.prompt[0] for r in batch])
        if any(r.prompt[0] == 99 for r in batch):
            raise RuntimeError("bad batch")
        return [(r.prompt, r.seed) for r in batch]

    async def main():
        b = RequestBatcher(run, lambda: idle.append(len(batches)), window_s=0.05, max_batch=3)
        first = await asyncio.gather(*(b.submit([i], P, seed=i) for i in range(5)))
        assert first == [([i], i) for i in range(5)] and b.idle
        with pytest.raises(RuntimeError, match="bad batch"):
            await b.submit([99], P, seed=9)
        assert await b.submit([7], P, seed=7) == ([7], 7)  # the loop survived the failure

    asyncio.run(main())
    assert batches[:2] == [[0, 1, 2], [3, 4]]  # arrived together: max_batch, then the rest
    assert idle == [2, 3, 4]  # once per drain, after the last batch of it


def test_policy_copy_checks_every_tensor_before_writing():
    model, new = _target(0), _target(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = dict(new.state_dict())
    bad = {**state, "model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}
    with pytest.raises(ValueError, match="up_proj.weight.*shape"):
        copy_policy(model, bad)
    with pytest.raises(ValueError, match="not a tensor of the rollout target"):
        copy_policy(model, {**state, "model.extra.weight": torch.zeros(1)})
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing written
    ptr = model.embed_weight.data_ptr()
    assert copy_policy(model, state) == len(state)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items()) and model.embed_weight.data_ptr() == ptr


def test_drift_probe_compares_the_policies_around_a_push():
    model, lock = _target(0), threading.Lock()
    probe = DriftProbe(model, lock)
    probe.record([[1, 2, 3, 4, 5, 6], [7, 8, 9]])
    probe.before()
    probe.after()  # same weights
    assert probe.top1 == 1.0
    probe.before()
    copy_policy(model, _target(1).state_dict())
    probe.after()
    assert probe.top1 < 0.9
    probe.after()  # no idle forward since the last push: nothing to compare, the figure stays
    assert probe.top1 < 0.9


def test_step_stats_count_eagle_verifies_apart_and_keep_heldout_figures():
    """The push guard's inputs: verifies drafted by the EAGLE proposer (suffix arms excluded) and
    each spot session's held-out accept length with its checkpoint step."""
    import types

    from tlt.drafter.session import SessionResult
    from tlt.rollout.engine import StepRecord
    from tlt.integrations.verl.step_stats import StepStats

    st = StepStats()
    steps = [StepRecord(batch=4, arm="3,1,3", sd=True, accepted=6, committed=10, seconds=0.1),
             StepRecord(batch=2, arm="3,1,3@suffix", sd=True, accepted=4, committed=6, seconds=0.1),
             StepRecord(batch=4, arm="off", sd=False, accepted=0, committed=4, seconds=0.1)]
    st.batch(types.SimpleNamespace(tokens=20, steps=steps), started=0.0, gen_s=0.3, requests=4)
    res = dict(session_id="s", world_size=1, start_step=0, end_step=2, losses=(1.0, 0.9),
               stop_reason="preempted", preempt_latency_s=None, stop_latency_s=None, checkpoint_step=2,
               check_interval_s=(), checkpoint_stall_s=())
    st.session(types.SimpleNamespace(result=SessionResult(rank=0, heldout_accept_length=2.5, **res)))
    st.session(types.SimpleNamespace(result=SessionResult(rank=1, heldout_accept_length=2.5, **res)))
    snap = st.snapshot()
    assert (snap["verifies"], snap["committed"]) == (6, 16)
    assert (snap["eagle_verifies"], snap["eagle_committed"]) == (4, 10)
    # per arm: the summary compares drafters at the same strategy
    assert snap["arm_verifies"] == {"3,1,3": 4, "3,1,3@suffix": 2}
    assert snap["arm_committed"] == {"3,1,3": 10, "3,1,3@suffix": 6}
    assert snap["heldout"] == [(2, 2.5)]  # once per session (rank 0 reports it)


def test_step_stats_time_the_replicas_decoding_span():
    """The first batch's start and the last batch's end: the trainer reports the rollout's time
    outside the replicas' decoding (before the first batch, after the last)."""
    import types

    from tlt.integrations.verl.step_stats import StepStats, replica_fields

    st = StepStats()
    assert (st.snapshot()["first_at"], st.snapshot()["done_at"]) == (None, None)
    for started, gen_s in ((10.0, 2.0), (12.5, 1.0)):
        st.batch(types.SimpleNamespace(tokens=1, steps=[]), started=started, gen_s=gen_s, requests=1)
    snap = st.snapshot()
    assert (snap["first_at"], snap["done_at"], snap["batches"]) == (10.0, 13.5, 2)
    idle = StepStats().snapshot()  # a replica that decoded nothing this step
    fields = replica_fields([snap, idle], began=9.5, ended=14.0)
    assert fields["replica_lead_s"] == [0.5, None] and fields["replica_trail_s"] == [0.5, None]
    assert fields["replica_gen_s"] == [3.0, 0.0] and fields["replica_batches"] == [2, 0]
    st.reset()
    assert st.snapshot()["first_at"] is None
