"""Static step shapes (what CUDA graphs capture) give exactly the dynamic engine's tokens.

On CPU the static path runs eagerly: batch padded to a captured size (padding rows on free cache
rows), tree padded with invalid nodes to the arm's width, attention over the whole cache. The
CUDA-graph replay of the same path is checked by the ``gpu`` test when a device exists.
"""

from __future__ import annotations

import pytest
import torch

from tlt.drafter.eagle import Drafter
from tlt.rollout.draft_tree import DraftTree
from tlt.rollout.eagle_proposer import EagleProposer
from tlt.rollout.graph_pool import CudaGraphPool
from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.suffix import SuffixProposer
from tlt.rollout.strategy import Arm
from tlt.rollout.target import TargetModel
from tlt.rollout.tuner import BegMab, TunerConfig
from tests.rollout.test_engine import setup  # noqa: F401  (fixture)


def _run(model, prompts, params, *, static, arm=None, proposer=None, tuner=None, groups=None, device="cpu"):
    cfg = EngineConfig(max_batch=8, max_len=512, arm=arm, static_shapes=static)
    eng = RolloutEngine(model, cfg, proposer=proposer, tuner=tuner)
    return eng, eng.generate(prompts, params, groups)


def test_padded_tree_adds_only_invalid_root_children():
    tree = DraftTree.chains([[5, 6], [7]])
    padded = tree.padded_to(4)
    assert padded.num_nodes == 4 and tree.padded_to(1) is tree
    assert padded.valid.tolist() == [[True, True, False, False], [True, False, False, False]]
    assert padded.parents[:, 2:].eq(-1).all()


@pytest.mark.parametrize("kind,arm", [("ar", None), ("eagle", Arm(3, 1, 3)), ("eagle", Arm(4, 2, 8)),
                                      ("suffix", Arm(4, 2, 8)), ("eagle-mab", None)], ids=str)
def test_static_shapes_are_token_identical(setup, warm_drafters, kind, arm):  # noqa: F811
    model, prompts, params = setup
    prompts, params = prompts[:5], params[:5]  # 5 running requests pad to 8, then shrink: 4, 2, 1
    ref = _run(model, prompts, params, static=False)[1]
    groups = [0, 0, 1, 1, 2]

    def proposer():
        if kind == "suffix":
            return SuffixProposer()
        drafter = Drafter.load(warm_drafters["eagle"], model.embed_weight, model.lm_head.weight)
        return EagleProposer(drafter, max_batch=8, max_len=600, static_shapes=True)

    kw = {}
    if kind != "ar":
        kw = {"arm": arm, "proposer": proposer()}
        if arm is None:
            kw["tuner"] = BegMab(TunerConfig.for_device("cpu", seed=1))
    eng, res = _run(model, prompts, params, static=True, groups=groups, **kw)
    assert eng.static_step is not None and eng.static_step.pool is None  # eager on CPU
    assert res.outputs == ref.outputs
    if kind != "ar":
        assert any(s.sd for s in res.steps)
    if kind.startswith("eagle"):  # whole proposals at static shapes (a longer backlog: dynamic)
        assert kw["proposer"].static_proposals > 0 and kw["proposer"].pool is None
    for a, b in zip(res.logprobs, ref.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("arm", [Arm(3, 1, 3), Arm(4, 2, 8)], ids=str)
def test_static_drafting_is_token_identical_sampled(setup, warm_drafters, method, arm):  # noqa: F811
    """Coupled sampling (T = 1, shared-noise drafts): the static-shape proposer and the dynamic one
    commit the plain loop's tokens; the static one proposes at fixed shapes after its first step."""
    from tlt.rollout.generate import SamplingParams

    model, prompts, params = setup
    prompts = prompts[:5]
    params = [SamplingParams(max_new_tokens=p.max_new_tokens, stop_ids=p.stop_ids, temperature=1.0) for p in params[:5]]
    seeds = [11, 12, 13, 14, 15]
    ref = RolloutEngine(model, EngineConfig(max_batch=8, max_len=512)).generate(prompts, params, seeds=seeds)
    out = {}
    for static in (False, True):
        drafter = Drafter.load(warm_drafters[method], model.embed_weight, model.lm_head.weight)
        prop = EagleProposer(drafter, max_batch=8, max_len=600, static_shapes=static)
        eng = RolloutEngine(model, EngineConfig(max_batch=8, max_len=512, arm=arm, static_shapes=static), proposer=prop)
        out[static] = eng.generate(prompts, params, seeds=seeds)
        assert out[static].outputs == ref.outputs
        assert (prop.static_proposals > 0) == static
    acc = {k: sum(r.accept_lengths) / len(r.accept_lengths) for k, r in out.items()}
    assert acc[True] > 1.2 and abs(acc[True] - acc[False]) < 0.25 * acc[False], acc  # the same drafter


class EagerPool:
    """CudaGraphPool's contract without a GPU (a test stand-in): capture makes the static inputs and
    runs the step function on them as the pool's warm-up does (3 times: their side effects count);
    replay copies the inputs into the static buffers (same shape and dtype) and runs the function."""

    def __init__(self, make_step) -> None:
        self.make, self.graphs, self.replays = make_step, {}, 0
        self._followed = {}

    follow = CudaGraphPool.follow  # the real rule: a buffer the graphs read moved, they are dropped

    def has(self, key) -> bool:
        return key in self.graphs

    def capture(self, keys) -> None:
        for key in keys:
            inputs, fn = self.make(key)
            for _ in range(3):
                fn(inputs)
            self.graphs[key] = (inputs, fn)

    def replay(self, key, **x):
        inputs, fn = self.graphs[key]
        for name, value in x.items():
            assert inputs[name].shape == value.shape and inputs[name].dtype == value.dtype, (key, name)
            inputs[name].copy_(value)
        self.replays += 1
        return fn(inputs)

    def close(self) -> None:
        self.graphs.clear()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_graphed_paths_replay_their_static_inputs(setup, warm_drafters, temperature):  # noqa: F811
    """The verify step's and the draft loop's graph paths (static input buffers from their
    make_step, warm-up runs, copy-in replay) on CPU with a stand-in pool: the plain loop's tokens,
    and the same proposals as the static path without a pool (equal accept lengths)."""
    from tlt.rollout.generate import SamplingParams

    model, prompts, params = setup
    prompts = prompts[:5]
    params = [SamplingParams(max_new_tokens=p.max_new_tokens, stop_ids=p.stop_ids, temperature=temperature)
              for p in params[:5]]
    seeds = [31, 32, 33, 34, 35]
    ref = RolloutEngine(model, EngineConfig(max_batch=8, max_len=512)).generate(prompts, params, seeds=seeds)
    for arm in (Arm(3, 1, 3), Arm(4, 2, 8)):
        runs = {}
        for pooled in (False, True):
            drafter = Drafter.load(warm_drafters["eagle3"], model.embed_weight, model.lm_head.weight)
            prop = EagleProposer(drafter, max_batch=8, max_len=600, static_shapes=True)
            eng = RolloutEngine(model, EngineConfig(max_batch=8, max_len=512, arm=arm, static_shapes=True),
                                proposer=prop)
            if pooled:
                eng.static_step.pool = EagerPool(eng.static_step._make_step)
                prop.pool = EagerPool(lambda key, prop=prop: prop.loop_graph_step(key, prop._features))
            runs[pooled] = eng.generate(prompts, params, seeds=seeds)
            assert runs[pooled].outputs == ref.outputs
        step = eng.static_step  # each shape's first use ran eagerly, every later one replayed
        assert step.pool.replays + step.gate.eager == len(runs[True].steps) and step.gate.eager == len(step.gate.uses)
        assert prop.pool.replays > 0
        assert runs[True].accept_lengths == runs[False].accept_lengths


def test_a_first_eagle_drafter_joins_a_static_engine(setup, warm_drafters):  # noqa: F811
    """A replica starts with the suffix drafter only (no target features); its first EAGLE drafter
    reads the hidden state, so the static step is rebuilt (on CUDA: its graphs captured again), the
    engine and its cache stay, the output stays token-identical; a later drafter of the same kind
    keeps the step (and its graphs)."""
    model, prompts, params = setup
    prompts, params = prompts[:5], params[:5]
    ref = _run(model, prompts, params, static=False)[1]
    groups = [0, 0, 1, 1, 2]
    eng, res = _run(model, prompts, params, static=True, groups=groups, proposer=SuffixProposer(),
                    tuner=BegMab(TunerConfig.for_device("cpu", seed=1)))
    assert res.outputs == ref.outputs
    cache, step = eng.cache, eng.static_step

    def eagle():
        drafter = Drafter.load(warm_drafters["eagle"], model.embed_weight, model.lm_head.weight)
        return EagleProposer(drafter, max_batch=8, max_len=600)

    proposers = ("", "suffix")
    eng.set_proposers({"": eagle(), "suffix": SuffixProposer()}, BegMab(TunerConfig.for_device("cpu", proposers=proposers, seed=1)))
    assert eng.cache is cache and eng.static_step is not step  # the features changed: a new step
    res = eng.generate(prompts, params, groups)
    assert res.outputs == ref.outputs and any(s.sd for s in res.steps)
    step = eng.static_step
    eng.set_proposers({"": eagle(), "suffix": SuffixProposer()}, BegMab(TunerConfig.for_device("cpu", proposers=proposers, seed=1)))
    assert eng.static_step is step  # the same features: the step and its graphs stay
    assert eng.generate(prompts, params, groups).outputs == ref.outputs


def test_static_shapes_default_off_on_cpu(setup):  # noqa: F811
    model, _, _ = setup
    assert RolloutEngine(model, EngineConfig(max_batch=2, max_len=64)).static_step is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_matches_eager(setup, trained_target, warm_drafters):  # noqa: F811
    _, prompts, params = setup
    gpu = TargetModel.from_pretrained(trained_target, device="cuda")
    drafter = Drafter.load(warm_drafters["eagle"], gpu.embed_weight, gpu.lm_head.weight)
    ref = RolloutEngine(gpu, EngineConfig(max_batch=8, max_len=512, static_shapes=False)).generate(prompts, params)
    for arm in (None, Arm(3, 1, 3), Arm(4, 2, 8)):
        eng = RolloutEngine(gpu, EngineConfig(max_batch=8, max_len=512, arm=arm),
                            proposer=EagleProposer(drafter, max_batch=8, max_len=600) if arm else None)
        res = eng.generate(prompts, params)
        assert eng.static_step.pool is not None and eng.static_step.replays + eng.static_step.gate.eager == len(res.steps)
        assert res.outputs == ref.outputs, arm


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafter_graphs_replay_the_eager_proposals(setup, trained_target, warm_drafters, temperature):  # noqa: F811
    """fp32 on CUDA: the graphed draft loop commits the plain loop's tokens and proposes exactly what
    the same static-shape loop proposes eagerly (equal accept lengths, step by step); after a drafter
    push the graphs replay the new drafter's weights, not the old ones (equal to the new drafter's
    eager proposals, different from the old drafter's)."""
    from tlt.rollout.generate import SamplingParams

    model, prompts, params = setup
    gpu = TargetModel.from_pretrained(trained_target, device="cuda")
    prompts = prompts[:5]
    params = [SamplingParams(max_new_tokens=p.max_new_tokens, stop_ids=p.stop_ids, temperature=temperature)
              for p in params[:5]]
    seeds = [21, 22, 23, 24, 25]
    ref = RolloutEngine(gpu, EngineConfig(max_batch=8, max_len=512)).generate(prompts, params, seeds=seeds)
    warm = lambda: Drafter.load(warm_drafters["eagle"], gpu.embed_weight, gpu.lm_head.weight)  # noqa: E731
    torch.manual_seed(3)
    other = lambda: Drafter(warm().config, gpu.embed_weight, gpu.lm_head.weight).to("cuda")  # noqa: E731
    for arm in (Arm(3, 1, 3), Arm(4, 2, 8)):
        def run(drafter, graphs):
            prop = EagleProposer(drafter, max_batch=8, max_len=600, static_shapes=True, cuda_graphs=graphs)
            eng = RolloutEngine(gpu, EngineConfig(max_batch=8, max_len=512, arm=arm, cuda_graphs=graphs), proposer=prop)
            return eng, prop, eng.generate(prompts, params, seeds=seeds)

        eng, prop, graphed = run(warm(), True)
        _, _, eager = run(warm(), False)
        assert graphed.outputs == ref.outputs == eager.outputs
        assert prop.replays > 0 and graphed.accept_lengths == eager.accept_lengths
        new = EagleProposer(other(), max_batch=8, max_len=600, static_shapes=True)
        eng.set_proposers({"": new}, None)  # a drafter push: a new proposer, graphs of its own
        pushed = eng.generate(prompts, params, seeds=seeds)
        _, _, pushed_eager = run(new.drafter, False)
        assert pushed.outputs == ref.outputs and new.replays > 0
        assert pushed.accept_lengths == pushed_eager.accept_lengths != graphed.accept_lengths


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captures_survive_collections_and_a_probe_thread(setup, trained_target, warm_drafters):  # noqa: F811
    """The way captures failed (1 sampled rollout in 99): engines built one after another and dropped
    without closing (every other one in a reference cycle), with a collection forced at every allocation
    (``gc.set_threshold(1)``), while a second thread runs the replica's drift-probe forward in a loop.
    Every rollout captures its graphs and samples the plain loop's tokens."""
    import gc
    import threading

    from tlt.integrations.verl.weight_sync import DriftProbe
    from tlt.rollout.generate import SamplingParams

    _, prompts, params = setup
    gpu = TargetModel.from_pretrained(trained_target, device="cuda")
    prompts = prompts[:4]
    params = [SamplingParams(max_new_tokens=p.max_new_tokens, stop_ids=p.stop_ids, temperature=1.0) for p in params[:4]]
    ref = RolloutEngine(gpu, EngineConfig(max_batch=8, max_len=512, static_shapes=False)).generate(
        prompts, params, seeds=[1, 2, 3, 4])
    probe = DriftProbe(gpu, threading.Lock())
    probe.record(prompts)
    stop, probed, errors = threading.Event(), [], []

    def probing():
        try:
            while not stop.is_set():
                probe.before()
                probed.append(1)
        except Exception as e:  # the test fails on it below
            errors.append(e)

    thread = threading.Thread(target=probing, daemon=True)
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    thread.start()
    try:
        for i, arm in enumerate((Arm(3, 1, 3), Arm(4, 2, 8)) * 3):
            drafter = Drafter.load(warm_drafters["eagle"], gpu.embed_weight, gpu.lm_head.weight)
            eng = RolloutEngine(gpu, EngineConfig(max_batch=8, max_len=512, arm=arm),
                                proposer=EagleProposer(drafter, max_batch=8, max_len=600))
            res = eng.generate(prompts, params, seeds=[1, 2, 3, 4])
            assert eng.static_step.replays + eng.static_step.gate.eager == len(res.steps) and res.outputs == ref.outputs, (i, arm)
            if i % 2:
                eng.cycle = eng  # left to a collection: its pools' graphs wait for the next capture
            del eng  # not closed
    finally:
        stop.set()
        thread.join()
        gc.set_threshold(*threshold)
    assert not errors and len(probed) > 6, (errors, len(probed))  # the probe ran forwards all along


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_paged_graphs_on_cuda_are_token_identical(setup, trained_target, warm_drafters, temperature):  # noqa: F811
    """fp32 on CUDA, graphs replayed: a paged cache of 16-position blocks, roomy and then too small for
    the batch (evictions), samples the static cache's tokens, EAGLE chain and tree."""
    from tlt.rollout.generate import SamplingParams

    _, prompts, params = setup
    gpu = TargetModel.from_pretrained(trained_target, device="cuda")
    params = [SamplingParams(max_new_tokens=p.max_new_tokens, stop_ids=p.stop_ids, temperature=temperature)
              for p in params]
    seeds = list(range(len(prompts)))
    ref = RolloutEngine(gpu, EngineConfig(max_batch=8, max_len=512)).generate(prompts, params, seeds=seeds)
    need = max(-(-(len(p) + sp.max_new_tokens + 1 + 16) // 16) for p, sp in zip(prompts, params))
    for arm in (Arm(3, 1, 3), Arm(4, 2, 8)):
        for kv_blocks in (None, need + 2):
            drafter = Drafter.load(warm_drafters["eagle"], gpu.embed_weight, gpu.lm_head.weight)
            eng = RolloutEngine(gpu, EngineConfig(max_batch=8, max_len=512, max_draft_tokens=16, arm=arm, block_size=16,
                                                  kv_blocks=kv_blocks), proposer=EagleProposer(drafter, max_batch=8, max_len=600))
            res = eng.generate(prompts, params, seeds=seeds)
            assert res.outputs == ref.outputs, (arm, kv_blocks)
            assert eng.static_step.replays > 0 and (kv_blocks is None or eng.lifecycle["evicted"] > 0)
