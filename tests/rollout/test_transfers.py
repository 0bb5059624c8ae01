"""Host <-> device transfers: the counter classifies what would cross PCIe on CUDA (also on a CPU),
and the engine's steps stay within one packed upload and one packed read, for every arm."""

from __future__ import annotations

import collections

import pytest
import torch

from tlt.drafter.eagle import Drafter, DrafterConfig
from tlt.drafter.model_config import ModelConfig
from tlt.rollout.eagle_proposer import EagleProposer
from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.generate import SamplingParams
from tlt.rollout.suffix import SuffixProposer
from tlt.rollout.strategy import Arm
from tlt.rollout.target import TargetModel
from tlt.bench.transfer_count import count_per_call, count_transfers
from tlt.rollout.tuner import BegMab, TunerConfig


def test_the_counter_tells_host_from_device_tensors():
    dev = torch.zeros(8)  # made outside the block: a device tensor
    with count_transfers() as c:
        host = torch.arange(3)  # no device: host
        _ = host * 2 + host.sum()  # host work: free
        _ = host.tolist(), int(host[0])
        assert c.total == 0
        dev.sum().item()
        assert (c.reads, c.total) == (1, 1)
        torch.tensor([1, 2], device=dev.device)
        host.to(dev.device)
        assert c.uploads == 2
        _ = dev[host]  # a device tensor indexed with a host index
        dev[[0, 1]] = 1.0  # ... with a Python list
        _ = dev + torch.tensor(1.0)  # a 0-dim host tensor passes as a scalar: free
        assert c.mixed == 2
        on_dev = torch.arange(3, device=dev.device)
        _ = dev[on_dev] + on_dev
        assert c.total == 5
        dev[on_dev].cpu()
        dev.to("cpu", copy=True)
        assert c.reads == 3
        dev[dev > 0]  # a boolean mask: its size is read
        dev.nonzero()
        dev.new_tensor([1.0, 2.0])
        made = torch.zeros_like(host, device=dev.device)  # named device: a device tensor
        _ = dev[:3] + made
        assert (c.reads, c.uploads, c.mixed) == (5, 3, 2)
    assert set(c.sites) and all(site.split(":")[0] == "test_transfers.py" for site in c.sites)


def _models():
    torch.manual_seed(0)
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    target = TargetModel(cfg).eval()
    drafter = Drafter(DrafterConfig.for_target(cfg), target.embed_weight, target.lm_head.weight).eval()
    return target, drafter


RUNS = {  # name: (arm or "tuner", temperature)
    "plain": (None, 0.0), "plain-t1": (None, 1.0),
    "chain": (Arm(3, 1, 3), 0.0), "chain-t1": (Arm(3, 1, 3), 1.0),
    "tree": (Arm(3, 2, 6), 0.0), "tree-t1": (Arm(3, 2, 6), 1.0),
    "suffix": (Arm(4, 1, 4, proposer="suffix"), 0.0), "suffix-tree-t1": (Arm(3, 2, 6, proposer="suffix"), 1.0),
    "beg-mab-t1": ("tuner", 1.0),
}


@pytest.mark.parametrize("block_size", [None, 4], ids=["rows", "paged"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("name", list(RUNS))
def test_a_step_makes_at_most_one_upload_and_one_read(name, static, block_size):
    """Counted per step (prefill and the row compaction of leaving requests are not a step's work;
    a proposer's own compaction after a leave is, and fits). Before the device-resident step the
    maxima were: plain 4, chain 14, chain-t1 15, tree 14, tree-t1 16, suffix 5, suffix tree 6. A
    paged cache's tables grow every few steps (blocks of 4) and travel in the step's one upload,
    with the suffix drafter's trees (before: 3 for a plain step that grew a table, 5 for a suffix one)."""
    target, drafter = _models()
    arm, temp = RUNS[name]
    eagle = EagleProposer(drafter, max_batch=4, max_len=96, static_shapes=static)
    kw = {}
    if arm == "tuner":
        buckets = ((1, (Arm.off(), Arm(3, 1, 3), Arm(3, 2, 6), Arm(4, 1, 4, proposer="suffix"))),)
        kw = {"proposers": {"": eagle, "suffix": SuffixProposer()},
              "tuner": BegMab(TunerConfig(buckets=buckets, epsilon=0.5, seed=1))}
        arm = None
    elif arm is not None:
        kw = {"proposers": {"suffix": SuffixProposer()} if arm.proposer else {"": eagle}}
    eng = RolloutEngine(target, EngineConfig(max_batch=4, max_len=72, arm=arm, elastic_threshold=4,
                                             static_shapes=static, block_size=block_size), **kw)
    prompts = [[1 + i, 2, 3 + i, 2, 3 + i] for i in range(4)]
    with count_per_call(eng, "_step") as calls:
        res = eng.generate(prompts, [SamplingParams(max_new_tokens=20 + 7 * i, temperature=temp) for i in range(4)],
                           groups=[0, 0, 1, 1])
    per_step = [c.total for c in calls]
    sites = sum((c.sites for c in calls), collections.Counter())
    assert len(per_step) == len(res.steps) > 10
    if name not in ("plain", "plain-t1"):
        assert any(s.sd for s in res.steps)
    assert max(per_step) <= 2, (name, max(per_step), dict(sites))
    if block_size:  # tables grew inside the counted steps
        assert sum(n for site, n in sites.items() if site.startswith("step_upload.py")) >= len(per_step) // 8, dict(sites)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("block_size", [None, 4], ids=["rows", "paged"])
@pytest.mark.parametrize("arm", [Arm(3, 1, 3), Arm(3, 2, 6), Arm(4, 1, 4, proposer="suffix")], ids=str)
def test_a_sampled_speculative_rollout_makes_no_unintended_sync(arm, block_size):
    """Under ``set_sync_debug_mode("error")`` every synchronising call fails but those the engine
    marks (``intended_sync``: the step's packed read and upload, prefill, leaving requests). Graphs
    are captured in a first rollout; the second, counted one replays them."""
    with torch.device("cuda"):
        target, drafter = _models()
    props = {"suffix": SuffixProposer()} if arm.proposer else {"": EagleProposer(drafter, max_batch=4, max_len=96,
                                                                                capture_after=1)}
    eng = RolloutEngine(target, EngineConfig(max_batch=4, max_len=72, arm=arm, elastic_threshold=4, capture_after=1,
                                             block_size=block_size), proposers=props)
    prompts = [[1 + i, 2, 3 + i, 2, 3 + i] for i in range(4)]
    params = [SamplingParams(max_new_tokens=20 + 7 * i, temperature=1.0) for i in range(4)]
    first = eng.generate(prompts, params, groups=[0, 0, 1, 1])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = eng.generate(prompts, params, groups=[0, 0, 1, 1])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert again.outputs == first.outputs and any(s.sd for s in again.steps)
