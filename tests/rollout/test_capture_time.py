"""Graph capture is no arm's cost: the tuner's rewards leave out the time a step spends capturing a
CUDA graph on first use. CPU stand-in for the GPU pool (this machine has no GPU): a pool whose
capture sleeps and whose replay runs the step's eager forward."""

from __future__ import annotations

import time

import torch

from tlt.drafter.model_config import ModelConfig
from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.graph_pool import CudaGraphPool
from tlt.rollout.generate import SamplingParams
from tlt.rollout.suffix import SuffixProposer
from tlt.rollout.target import TargetModel
from tlt.rollout.tuner import BegMab, TunerConfig

CAPTURE_S = 0.25


class _SlowCapturePool:
    """Stands in for tlt.rollout.graph_pool.CudaGraphPool (needs a GPU): capture costs CAPTURE_S."""

    def __init__(self, step) -> None:
        self.step, self.keys, self._followed = step, set(), {}

    follow = CudaGraphPool.follow

    def has(self, key) -> bool:
        return key in self.keys

    def capture(self, keys) -> None:
        time.sleep(CAPTURE_S)
        self.keys |= set(keys)

    def replay(self, key, **inputs):  # the captured function, run eagerly on the static inputs
        return self.step._step(inputs, self.step._buffer, key.depth, key.masked, key.sampled)

    def close(self) -> None:
        self.keys.clear()


def test_graph_capture_time_stays_out_of_tuner_rewards():
    torch.manual_seed(0)
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = TargetModel(cfg).eval()
    tuner = BegMab(TunerConfig.for_device("cpu", proposers=("suffix",), seed=0))
    times: list[float] = []
    record = tuner.record
    tuner.record = lambda b, arm, acc, s: (times.append(s), record(b, arm, acc, s))[1]
    engine = RolloutEngine(model, EngineConfig(max_batch=2, max_len=96, static_shapes=True, capture_after=1),
                           proposers={"suffix": SuffixProposer()}, tuner=tuner)
    step = engine.static_step
    step.pool = _SlowCapturePool(step)
    prompts = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [7, 8, 9, 7, 8, 9, 7, 8]]
    res = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=24))
    out = res.outputs
    assert len(step.pool.keys) >= 2 and step.capture_s >= CAPTURE_S * len(step.pool.keys) * 0.99
    assert times and max(times) < CAPTURE_S, times  # every capture happened inside a timed step
    # the step records say where each capture went, and that a CPU step is all host time
    captured = [s for s in res.steps if s.capture_seconds > 0]
    assert len(captured) == len(step.pool.keys) and all(s.capture_seconds >= CAPTURE_S * 0.99 for s in captured)
    assert all(s.capture_seconds <= s.host_seconds <= s.seconds for s in res.steps)
    assert sum(s.host_seconds for s in res.steps) >= 0.9 * sum(s.seconds for s in res.steps)
    engine.static_step.pool = None  # eager: the same tokens
    assert engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=24)).outputs == out


class _SlowLoopPool:
    """Stands in for the EAGLE proposer's CudaGraphPool: capture costs CAPTURE_S, replay runs the
    captured function on the static inputs made at capture (copy-in, as the real pool does)."""

    def __init__(self, make_step) -> None:
        self.make, self.graphs, self._followed = make_step, {}, {}

    follow = CudaGraphPool.follow

    def has(self, key) -> bool:
        return key in self.graphs

    def capture(self, keys) -> None:
        time.sleep(CAPTURE_S)
        self.graphs.update({k: self.make(k) for k in keys})

    def replay(self, key, **inputs):
        static, fn = self.graphs[key]
        for name, value in inputs.items():
            static[name].copy_(value)
        return fn(static)


def test_draft_loop_capture_time_stays_out_of_tuner_rewards():
    from tlt.rollout.eagle_proposer import EagleProposer
    from tests.rollout.test_transfers import _models

    model, drafter = _models()
    prop = EagleProposer(drafter, max_batch=2, max_len=128, static_shapes=True, capture_after=1)
    prop.pool = _SlowLoopPool(lambda key: prop.loop_graph_step(key, prop._features))
    tuner = BegMab(TunerConfig.for_device("cpu", seed=0))
    times: list[float] = []
    record = tuner.record
    tuner.record = lambda b, arm, acc, s: (times.append(s), record(b, arm, acc, s))[1]
    engine = RolloutEngine(model, EngineConfig(max_batch=2, max_len=96), proposer=prop, tuner=tuner)
    prompts = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [7, 8, 9, 7, 8, 9, 7, 8]]
    engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=40))
    assert prop.pool.graphs and prop.capture_s >= CAPTURE_S * len(prop.pool.graphs) * 0.99
    assert times and max(times) < CAPTURE_S, times


def test_a_shape_is_captured_at_its_second_use_and_an_arm_tried_once_never():
    """The default ``capture_after=2``: exploring an arm once costs an eager step, not a capture.
    Every captured shape was used twice before it was, every other one once; the tokens are the
    eager engine's."""
    torch.manual_seed(0)
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = TargetModel(cfg).eval()
    prompts = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [7, 8, 9, 7, 8, 9, 7, 8]]
    params = SamplingParams(temperature=0.0, max_new_tokens=40)

    def engine():
        return RolloutEngine(model, EngineConfig(max_batch=2, max_len=96, static_shapes=True),
                             proposers={"suffix": SuffixProposer()},
                             tuner=BegMab(TunerConfig.for_device("cpu", proposers=("suffix",), seed=0)))

    eng = engine()
    step = eng.static_step
    step.pool = _SlowCapturePool(step)
    res = eng.generate(prompts, params)
    assert step.pool.keys and all(step.gate.uses[k] == 2 for k in step.pool.keys)
    assert all(n == 1 for k, n in step.gate.uses.items() if k not in step.pool.keys)
    assert step.gate.eager == len(step.gate.uses) and step.capture_s < CAPTURE_S * (len(step.pool.keys) + 0.5)
    assert len([s for s in res.steps if s.capture_seconds > 0]) == len(step.pool.keys)
    assert res.outputs == engine().generate(prompts, params).outputs


def test_graphs_are_dropped_when_a_buffer_they_read_moves():
    """The one rule of the verify step and the draft loop (the bookkeeping, without a device): the
    same buffer keeps the graphs; another tensor, or the same memory reshaped, drops them once."""
    pool = object.__new__(CudaGraphPool)  # (its constructor needs CUDA; close() is what is counted)
    pool._followed, closed = {}, []
    pool.close = lambda: closed.append(1)
    buf = torch.zeros(4, 2)
    for t in (None, buf, buf, None):
        pool.follow("features", t)
    assert closed == []
    pool.follow("features", torch.zeros(4, 2))
    assert closed == [1]
    pool.follow("features", pool_buf := torch.zeros(8))
    pool.follow("features", pool_buf.view(4, 2))  # the same address, another layout
    assert closed == [1, 1, 1]
    pool.follow("other", buf)  # each followed buffer by its own name
    assert closed == [1, 1, 1]
