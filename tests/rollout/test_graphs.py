"""The engine's capture sizes; the benches' CUDA-graph bucket planner and memory model (CPU);
capture/replay parity and memory (GPU)."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest
import torch

from tlt.rollout.graph_pool import CAPTURE_LOCK, CudaGraphPool, FairLock
from tlt.bench.graph_plan import DEFAULT_BUCKETS, DraftGraphKey, GraphPlanConfig, GraphSet, plan_graphs
from tlt.rollout.graphs import CaptureSizes, DraftLoopGraphKey, TargetGraphKey
from tlt.bench.graph_memory import QWEN25_32B, ModelDims, estimate_bytes, estimate_parts, memory_report
from tlt.rollout.strategy import Arm

T, D = (lambda b, q: TargetGraphKey(batch=b, query_tokens=q)), (lambda b, k: DraftGraphKey(batch=b, topk=k))
A326, A224, A212 = Arm(3, 2, 6), Arm(2, 2, 4), Arm(2, 1, 2)
SMALL = GraphPlanConfig(capture_batch_sizes=(1, 2, 4), buckets=((1, (A326,)), (4, (A224, A212))),
                        include_decode=False, draft_graphs="step")
# Toy dims: H=4, A=2*2=4, K=1*2=2, I=8, V=16, bf16 activations, fp32 logits.
TOY = ModelDims(hidden_size=4, intermediate_size=8, vocab_size=16, num_layers=2, num_heads=2,
                num_kv_heads=1, head_dim=2)
TGT_OUT, TGT_WORK = 2 * 4 + 4 * 16, 2 * (2 * 4 + 2 * 4 + 2 * 2 + 3 * 8 + 16)  # 72, 120 per token
DRF_WORK = 2 * (4 * 4 + 2 * 4 + 2 * 2 + 3 * 8 + 16) + 4 * 16  # 200 per token
DRF_OUT = {1: 2 * 4 + 1 * 12, 2: 2 * 4 + 2 * 12}  # per token, by topk


def test_each_captured_size_gets_its_bucket_arms():
    cfg = GraphPlanConfig()  # the tuner's default buckets
    arms = dict(plan_graphs(cfg).arms_by_batch)
    assert tuple(arms) == cfg.capture_batch_sizes
    prev = 0
    for c, got in arms.items():  # brute force: every runtime batch that pads to c
        want = {a for bs in range(prev + 1, c + 1) for a in DEFAULT_BUCKETS[cfg.bucket_index(bs)][1]}
        assert set(got) == want, c
        prev = c
    assert set(arms[64]) == set(DEFAULT_BUCKETS[-1][1])
    assert cfg.bucket_index(1000) == len(DEFAULT_BUCKETS) - 1  # above the last max: last bucket


def test_captured_size_covers_every_bucket_padded_to_it():
    # bucket max 3 is not a captured size: batch 3 (bucket 0) and batch 4 (bucket 1) both pad to 4
    cfg = GraphPlanConfig(capture_batch_sizes=(2, 4, 8), buckets=((3, (A326,)), (6, (A224,)), (8, (A212,))),
                          include_decode=False, draft_graphs="step")
    arms = dict(plan_graphs(cfg).arms_by_batch)
    assert arms == {2: (A326,), 4: tuple(sorted((A326, A224))), 8: tuple(sorted((A224, A212)))}
    plan = plan_graphs(cfg)
    assert plan.keys_for(3, A326) == (T(4, 7), D(4, 2))  # the graph the tuner's pick at bs 3 needs


def test_no_sd_graphs_where_only_batches_above_the_elastic_threshold_pad():
    cfg = GraphPlanConfig(capture_batch_sizes=(16, 32, 48), buckets=((16, (A326,)), (64, (A224,))),
                          speculate_max_batch=30)
    plan = plan_graphs(cfg)
    # 32 still hosts SD (batches 17..30 pad to it); 48 only sees batches > 30: decode only
    assert dict(plan.arms_by_batch) == {16: (A326,), 32: (A224,), 48: ()}
    at48 = {scheme: {k for k in plan.graphs(scheme).keys if k.batch == 48} for scheme in ("naive", "bucketed")}
    assert at48 == {"naive": {T(48, 1)}, "bucketed": {T(48, 1)}}
    assert memory_report(plan, TOY).single_graphs == 2 * 2 + 3  # A326 at 16, 32 + decode at all three
    with pytest.raises(KeyError):
        plan.keys_for(40, A224)
    never = plan_graphs(dataclasses.replace(cfg, speculate_max_batch=0))
    assert never.naive == never.bucketed == GraphSet.of(T(c, 1) for c in (16, 32, 48))


def test_identical_shapes_merge():
    # same tokens_to_verify -> one target graph; same topk -> one draft graph
    cfg = GraphPlanConfig(capture_batch_sizes=(1, 2), buckets=((2, (Arm(2, 2, 4), Arm(4, 1, 4), Arm(3, 2, 5))),),
                          include_decode=False, draft_graphs="step")
    plan = plan_graphs(cfg)
    assert plan.bucketed.target == (T(1, 5), T(1, 6), T(2, 5), T(2, 6))
    assert plan.bucketed.draft == (D(1, 1), D(1, 2), D(2, 1), D(2, 2))


def test_small_config_counts_by_hand():
    plan = plan_graphs(SMALL)
    # c=1: bucket 0 (A326); c=2: batch 2 -> bucket 1; c=4: batches 3, 4 -> bucket 1
    assert plan.bucketed.target == (T(1, 7), T(2, 3), T(2, 5), T(4, 3), T(4, 5))
    assert plan.bucketed.draft == (D(1, 2), D(2, 1), D(2, 2), D(4, 1), D(4, 2))
    assert (len(plan.naive.target), len(plan.naive.draft)) == (3 * 3, 3 * 2)  # q {7,5,3}, k {2,1}
    assert set(plan.bucketed.keys) <= set(plan.naive.keys)
    dec = plan_graphs(dataclasses.replace(SMALL, include_decode=True))
    assert len(dec.bucketed) == 10 + 3 and len(dec.naive) == 15 + 3  # + T(c, 1) per captured size


def L(b, arm, sampled=True):  # noqa: E743
    return DraftLoopGraphKey(batch=b, depth=arm.depth, topk=arm.topk, tokens_to_verify=arm.tokens_to_verify,
                             window=arm.depth + 1, sampled=sampled)


def test_loop_graphs_one_per_batch_and_arm():
    """The engine's draft graphs: a whole proposal per (captured size, arm); a model-free arm has none."""
    suffix = Arm(4, 1, 4, proposer="suffix")
    cfg = dataclasses.replace(SMALL, draft_graphs="loop", buckets=((1, (A326,)), (4, (A224, A212, suffix))))
    plan = plan_graphs(cfg)
    assert set(plan.bucketed.draft) == {L(1, A326), L(2, A224), L(2, A212), L(4, A224), L(4, A212)}
    assert T(2, 5) in plan.bucketed.target  # the suffix arm verifies 4 drafts: a target graph only
    assert plan.keys_for(3, A224) == (T(4, 5), L(4, A224)) and plan.keys_for(3, suffix) == (T(4, 5), None)
    greedy = plan_graphs(dataclasses.replace(cfg, sampled=False))
    assert greedy.keys_for(1, A326)[1] == L(1, A326, sampled=False)
    with pytest.raises(ValueError, match="draft_graphs"):
        GraphPlanConfig(draft_graphs="tree")


def test_loop_memory_model_by_hand():
    # TOY: per-token draft step workspace DRF_WORK = 200; w = 4, k = 2, d = 3, n = 6, Vd = 16, H = 4
    key = L(2, A326)
    work = 4 * DRF_WORK + 2 * 3 * (2 * 4 + 24) + (3 + 4) * 4 * 16
    assert estimate_parts(key, TOY) == (2 * 6 * 16, 2 * work)
    assert estimate_parts(L(2, A326, sampled=False), TOY) == (2 * 6 * 16, 2 * (work - 7 * 4 * 16))


def test_naive_is_superset_of_bucketed_on_defaults():
    plan = plan_graphs(GraphPlanConfig())
    assert set(plan.bucketed.keys) < set(plan.naive.keys)
    assert len(plan.graphs("naive")) == len(plan.naive) > len(plan.bucketed)


def test_off_arm_only_adds_decode_graphs():
    base = ((2, (A326,)), (4, (A224,)))
    without = plan_graphs(GraphPlanConfig(capture_batch_sizes=(1, 2, 4), buckets=base, include_decode=False))
    with_off = plan_graphs(GraphPlanConfig(capture_batch_sizes=(1, 2, 4), include_decode=False,
                                           buckets=((2, (A326, Arm.off())), (4, (A224,)))))
    assert with_off.bucketed.draft == without.bucketed.draft
    assert set(with_off.bucketed.keys) - set(without.bucketed.keys) == {T(1, 1), T(2, 1)}
    assert with_off.keys_for(2, Arm.off()) == (T(2, 1), None)


def test_the_engines_capture_sizes_pad_and_validate():
    sizes = CaptureSizes()  # the engine's and the EAGLE proposer's (tlt.rollout.graphs)
    assert [sizes.padded_batch(b) for b in (1, 2, 3, 5, 17, 33, 64)] == [1, 2, 4, 8, 24, 48, 64]
    assert sizes.padded_batch(65) is None and CaptureSizes([2, 5]).capture_batch_sizes == (2, 5)
    for bad in ((), (0, 1), (2, 1), (1, 1)):
        with pytest.raises(ValueError, match="capture_batch_sizes"):
            CaptureSizes(bad)
    with pytest.raises(ValueError, match="batch"):
        sizes.padded_batch(0)


def test_padded_batch_and_keys_for():
    plan = plan_graphs(GraphPlanConfig(buckets=((2, (Arm(8, 8, 64),)), (8, (Arm(5, 4, 24),)),
                                                (32, (Arm(3, 1, 3), Arm.off()))), draft_graphs="step"))
    assert [plan.padded_batch(b) for b in (1, 2, 3, 5, 17, 33, 64)] == [1, 2, 4, 8, 24, 48, 64]
    assert plan.padded_batch(65) is None
    with pytest.raises(ValueError, match="batch"):
        plan.padded_batch(0)
    assert plan.keys_for(3, Arm(5, 4, 24)) == (T(4, 25), D(4, 4))
    with pytest.raises(KeyError, match="bucket"):
        plan.keys_for(64, Arm(8, 8, 64))  # a bs<=2 arm is not captured at 64 when bucketed
    assert plan.keys_for(64, Arm(8, 8, 64), scheme="naive") == (T(64, 65), D(64, 8))
    with pytest.raises(KeyError, match="eagerly"):
        plan.keys_for(65, Arm.off())


def test_memory_model_by_hand():
    assert estimate_parts(T(2, 5), TOY) == (10 * TGT_OUT, 10 * TGT_WORK)
    assert estimate_bytes(D(4, 2), TOY) == 8 * (DRF_OUT[2] + DRF_WORK)
    rep = memory_report(plan_graphs(SMALL), TOY)
    tgt, drf = TGT_OUT + TGT_WORK, {k: DRF_OUT[k] + DRF_WORK for k in (1, 2)}
    bucketed = (7 + 10 + 6 + 20 + 12) * tgt + (2 + 4 + 8) * drf[2] + (2 + 4) * drf[1]
    naive = 7 * (7 + 5 + 3) * tgt + 7 * 2 * drf[2] + 7 * drf[1]
    assert (rep.bucketed_bytes, rep.naive_bytes) == (bucketed, naive) == (15128, 24948)
    assert rep.ratio == pytest.approx(24948 / 15128) and rep.ratio > 1
    assert (rep.single_arm, rep.single_bytes, rep.single_graphs) == ("d3k2v6", 7 * 7 * tgt + 14 * drf[2], 6)
    # one shared pool: every output stays live, workspace only for the largest graph (T(4,5))
    outputs = 55 * TGT_OUT + (2 + 4 + 8) * DRF_OUT[2] + (2 + 4) * DRF_OUT[1]
    assert rep.bucketed_shared_bytes == outputs + 20 * TGT_WORK
    assert rep.as_dict()["ratio"] == rep.ratio and len(rep.lines()) == 4


def test_default_config_memory_on_32b_dims():
    rep = memory_report(plan_graphs(GraphPlanConfig()), QWEN25_32B)
    assert rep.naive_bytes >= rep.bucketed_bytes and rep.naive_bytes >= rep.single_bytes
    assert rep.ratio >= 1 and rep.naive_graphs >= rep.bucketed_graphs


def test_ratio_depends_on_how_much_buckets_differ():
    sizes = (1, 2, 4, 8, 16, 32, 64)
    deep, mid, flat = Arm(8, 4, 32), Arm(6, 4, 16), Arm(4, 1, 4)
    same = GraphPlanConfig(capture_batch_sizes=sizes, buckets=((4, (deep, mid, flat)), (64, (deep, mid, flat))))
    apart = GraphPlanConfig(capture_batch_sizes=sizes, buckets=((4, (deep, mid)), (64, (flat,))))
    r_same, r_apart = (memory_report(plan_graphs(c), QWEN25_32B) for c in (same, apart))
    assert r_same.ratio == 1.0 and r_same.bucketed_bytes == r_same.naive_bytes
    # apart: the big batches (8..64: 124 of 127 rows) verify 5 tokens instead of up to 33
    assert r_apart.ratio > 3 and r_apart.bucketed_bytes < r_apart.single_bytes


@pytest.mark.parametrize("kw, field", [
    (dict(capture_batch_sizes=()), "capture_batch_sizes"),
    (dict(capture_batch_sizes=(2, 1)), "capture_batch_sizes"),
    (dict(capture_batch_sizes=(0, 1)), "capture_batch_sizes"),
    (dict(capture_batch_sizes=(1, 1)), "capture_batch_sizes"),
    (dict(buckets=()), "buckets"),
    (dict(buckets=((4, (A326,)), (4, (A224,)))), "max_batch_size"),
    (dict(buckets=((0, (A326,)),)), "max_batch_size"),
    (dict(buckets=((4, ()),)), "arms"),
    (dict(buckets=((4, ("d3k2v6",)),)), "arms"),
    (dict(buckets=((4, (A326, A326)),)), "repeated"),
    (dict(buckets=(4, (A326,))), "buckets"),
    (dict(speculate_max_batch=-1), "speculate_max_batch"),
])
def test_config_validation(kw, field):
    with pytest.raises(ValueError, match=field):
        GraphPlanConfig(**kw)


def test_dims_validation_and_scheme_names():
    with pytest.raises(ValueError, match="vocab_size"):
        ModelDims(hidden_size=4, intermediate_size=8, vocab_size=0, num_layers=1, num_heads=1,
                  num_kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        ModelDims(hidden_size=4, intermediate_size=8, vocab_size=8, num_layers=1, num_heads=1,
                  num_kv_heads=1, head_dim=4, draft_vocab_size=-1)
    with pytest.raises(ValueError, match="scheme"):
        plan_graphs(SMALL).graphs("eager")
    assert GraphPlanConfig(capture_batch_sizes=[1, 2], buckets=[(2, [A326])]).buckets == ((2, (A326,)),)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_pool_without_cuda_raises():
    assert not CudaGraphPool.available()
    with pytest.raises(RuntimeError, match="CUDA"):
        CudaGraphPool(lambda key: ({}, lambda x: {}))


def test_held_weakly_lets_a_method_owner_go_and_keeps_a_function():
    """A pool made by its owner's method must not keep its owner (and the owner's KV cache) alive."""
    from tlt.rollout.graph_pool import held_weakly

    class Owner:
        def make(self, key):
            return {"key": key}, None

    owner = Owner()
    get = held_weakly(owner.make)
    assert get()(7) == ({"key": 7}, None)
    del owner
    assert get() is None
    fn = lambda key: ({}, None)  # noqa: E731  (a closure: only the pool holds it)
    get = held_weakly(fn)
    del fn
    assert get() is not None and get()(0) == ({}, None)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_a_dropped_engine_frees_its_memory_without_a_collection(device):
    """An engine dropped without ``close()`` (static shapes, EAGLE and suffix proposers; on CUDA with
    graphs captured) goes with its last reference: nothing it holds points back at it. A cycle would
    keep its KV cache -- tens of GiB at 32K x 8 on a GPU -- until a collection, and the next engine
    would not fit."""
    import gc
    import weakref

    from tlt.drafter.eagle import Drafter, DrafterConfig
    from tlt.drafter.model_config import ModelConfig
    from tlt.rollout.eagle_proposer import EagleProposer
    from tlt.rollout.engine import EngineConfig, RolloutEngine
    from tlt.rollout.generate import SamplingParams
    from tlt.rollout.suffix import SuffixProposer
    from tlt.rollout.target import TargetModel

    torch.manual_seed(0)
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # head dim 16: the Triton kernel on CUDA
    target = TargetModel(cfg).to(device).eval()
    drafter = Drafter(DrafterConfig.for_target(cfg), target.embed_weight, target.lm_head.weight).to(device).eval()
    prompts = [[3, 4, 5, 6, 3, 4, 5, 6], [7, 8, 9, 7, 8, 9]]

    def build_run_drop() -> list:
        eagle = EagleProposer(drafter, max_batch=2, max_len=96, static_shapes=True, capture_after=1)
        engine = RolloutEngine(target, EngineConfig(max_batch=2, max_len=96, static_shapes=True, capture_after=1,
                                                    arm=Arm(3, 1, 3)),
                               proposers={"": eagle, "suffix": SuffixProposer()})
        engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=16))
        held = [engine, engine.static_step, engine.cache, engine.cache.k, eagle]
        if device == "cuda":  # the graphs go with their pools
            assert engine.static_step.replays > 0 and eagle.replays > 0
            held += [engine.static_step.pool, eagle.pool]
        return [weakref.ref(x) for x in held]

    enabled = gc.isenabled()
    gc.disable()
    try:
        gone = build_run_drop()
        assert [r() for r in gone] == [None] * len(gone)
        if device == "cuda":  # its graphs wait for CAPTURE_LOCK, then go
            from tlt.rollout import graph_pool

            assert len(graph_pool._DROPPED) == 2
            graph_pool.destroy_dropped_graphs()
            assert graph_pool._DROPPED == []
    finally:
        if enabled:
            gc.enable()


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA device")
def test_pool_replay_matches_eager_and_bucketed_uses_less_memory():
    from tlt.drafter.model_config import ModelConfig
    from tlt.rollout.attention import AttnMeta
    from tlt.rollout.kv_cache import StaticKVCache
    from tlt.rollout.target import TargetModel

    torch.manual_seed(0)
    dev, span, prefix = torch.device("cuda"), 64, 20
    cfg = ModelConfig(model_type="llama", vocab_size=32000, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    target = TargetModel(cfg).to(dev).eval()
    drafter = TargetModel(dataclasses.replace(cfg, num_hidden_layers=1)).to(dev).eval()
    sizes = (1, 2, 4, 8)
    caches = {m: StaticKVCache(m.config.num_hidden_layers, sizes[-1], 2, span, 16, device=dev)
              for m in (target, drafter)}

    def make_step(key):
        model, q = (target, key.query_tokens) if isinstance(key, TargetGraphKey) else (drafter, key.topk)
        b, cache = key.batch, caches[model]
        inputs = {"ids": torch.zeros(b, q, dtype=torch.long, device=dev),
                  "pos": torch.zeros(b, q, dtype=torch.long, device=dev),
                  "ctx": torch.zeros(b, dtype=torch.long, device=dev)}

        def fn(x):  # a chain of q tokens after ctx cached ones
            out = model(x["ids"], x["pos"], cache.backend(AttnMeta.rows(x["ctx"], q, span)))
            if isinstance(key, TargetGraphKey):
                return {"logits": out.logits, "hidden": out.hidden}
            p, ids = out.logits.float().softmax(-1).topk(key.topk, dim=-1)
            return {"hidden": out.hidden, "p": p, "ids": ids}
        return inputs, fn

    def step_inputs(b, q):  # a chain of q tokens after a 20-token prefix
        pos = (prefix + torch.arange(q, device=dev)).expand(b, q).contiguous()
        return {"ids": torch.randint(0, cfg.vocab_size, (b, q), device=dev), "pos": pos,
                "ctx": torch.full((b,), prefix, device=dev)}

    plan = plan_graphs(GraphPlanConfig(capture_batch_sizes=sizes, buckets=(
        (2, (Arm(4, 4, 16), Arm.off())), (8, (Arm(2, 2, 4), Arm.off()))), draft_graphs="step"))
    pool = CudaGraphPool(make_step)
    try:
        for scheme in ("bucketed", "naive"):
            pool.capture(plan.graphs(scheme).keys, scheme=scheme)
        for c in caches.values():
            c.k.normal_(), c.v.normal_()
        for key in (T(8, 5), T(2, 17), T(1, 1), D(4, 2)):
            q = key.query_tokens if isinstance(key, TargetGraphKey) else key.topk
            x = step_inputs(key.batch, q)
            got = {k: v.clone() for k, v in pool.replay(key, **x).items()}
            _, fn = make_step(key)
            with torch.no_grad():
                want = fn(x)
            for name in want:
                assert torch.allclose(got[name].float(), want[name].float(), atol=1e-4, rtol=1e-4), (key, name)
        with pytest.raises(ValueError, match="shape"):
            pool.replay(T(8, 5), ids=torch.zeros(4, 5, dtype=torch.long, device=dev))
        rep = pool.memory_report()
        assert rep["naive"]["graphs"] == len(plan.naive) and rep["bucketed"]["graphs"] == len(plan.bucketed)
        assert rep["naive"]["pool_bytes"] > rep["bucketed"]["pool_bytes"] > 0
        assert rep["ratio_pool_bytes"] > 1
    finally:
        pool.close()


def _until(cond) -> None:
    deadline = time.monotonic() + 5
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_a_thread_asking_again_queues_behind_a_waiting_capture():
    """A drift probe's forwards back to back must not starve a capture: the probe asks, the capture
    asks, and when the probe asks again after its forward it goes behind the capture. (A plain
    RLock let dozens of a looping thread's sections pass before a waiter.) CAPTURE_LOCK is one."""
    assert isinstance(CAPTURE_LOCK, FairLock)
    lock, order = FairLock(), []
    lock.acquire()

    def probe():
        for _ in range(2):  # two forwards back to back
            with lock:
                order.append("probe")

    def capture():
        with lock:
            order.append("capture")

    threads = [threading.Thread(target=probe), threading.Thread(target=capture)]
    threads[0].start()
    _until(lambda: lock._tickets == 2)  # the probe waits (ticket 1)
    threads[1].start()
    _until(lambda: lock._tickets == 3)  # then the capture (ticket 2)
    lock.release()
    for t in threads:
        t.join(5)
    assert order == ["probe", "capture", "probe"]
    with lock, lock:  # reentrant for its holder
        pass
    with pytest.raises(RuntimeError, match="does not hold"):
        lock.release()


def test_a_waiter_interrupted_gives_its_turn_up():
    """An exception in a waiter must not leave the lock to a turn nobody takes: when the holder
    releases, the next waiter gets it."""
    lock = FairLock()
    lock.acquire()
    real_wait, errors = lock._cond.wait_for, []

    def interrupted(predicate):
        raise KeyboardInterrupt

    def ask():
        try:
            lock.acquire()
        except KeyboardInterrupt as e:
            errors.append(e)

    lock._cond.wait_for = interrupted
    first = threading.Thread(target=ask)
    first.start()
    first.join(5)
    lock._cond.wait_for = real_wait
    assert len(errors) == 1  # it took a ticket and left while the holder held
    got = threading.Event()
    second = threading.Thread(target=lambda: (lock.acquire(), got.set(), lock.release()), daemon=True)
    second.start()
    time.sleep(0.05)
    assert not got.is_set()  # the holder still holds it
    lock.release()
    second.join(5)
    assert got.is_set()
    assert lock.acquire() and lock.acquire()  # reentrant, True as a threading lock returns
    lock.release()
    lock.release()


def test_capturing_holds_the_lock_and_the_collector_off_without_a_collection(monkeypatch):
    """Inside ``capturing()`` no collection can run (it is disabled) and CAPTURE_LOCK is held; entering
    makes no full pass of its own (0.1 s in a bench's process, at every capture of a tuner's new
    shape); on leaving, the collector is as it was, even after an error."""
    import gc

    from tlt.rollout.graph_pool import capturing

    passes = []
    monkeypatch.setattr(gc, "collect", lambda *a: passes.append(a) or 0)
    assert gc.isenabled()
    with capturing():
        assert not gc.isenabled() and CAPTURE_LOCK._owner == threading.get_ident()
    assert gc.isenabled() and CAPTURE_LOCK._owner is None and not passes
    with pytest.raises(ValueError):
        with capturing():
            raise ValueError("a capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with capturing():
            pass
        assert not gc.isenabled()  # a caller's disabled collector stays disabled
    finally:
        gc.enable()


@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_pool_closed_or_dropped_in_another_thread_destroys_no_graph_in_a_capture(monkeypatch, how):
    """A replaced proposer's pool can be closed from another thread than the one capturing: its
    graphs are destroyed once the capture is over. Or it is dropped there with its engine (its last
    reference goes, no close()): the drop waits for nothing and destroys nothing, and the next
    capture destroys its graphs before it starts. (CUDA graphs cannot exist here: the pool is built
    without its constructor, its graphs are stand-ins that record their reset.)"""
    from tlt.rollout.graph_pool import CudaGraphPool, capturing

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    events = []

    class Graph:
        def reset(self):
            events.append("reset")

    pool = object.__new__(CudaGraphPool)
    pool._graphs, pool._pools = {("bucketed", "key"): type("Cap", (), {"graph": Graph()})()}, {"bucketed": ()}
    graphs = pool._graphs
    if how == "close":
        closer = threading.Thread(target=pool.close)
    else:
        held = [pool]
        closer = threading.Thread(target=held.clear)  # the last reference goes in that thread
    del pool
    with capturing():
        closer.start()
        if how == "close":
            _until(lambda: CAPTURE_LOCK._tickets > CAPTURE_LOCK._serving + 1)  # the closer waits its turn
            time.sleep(0.05)
        else:
            closer.join(5)
            assert not closer.is_alive() and events == []  # dropped mid-capture: nothing destroyed
        events.append("capture ends")
    closer.join(5)
    if how == "drop":
        assert events == ["capture ends"]
        with capturing():
            pass
    assert events == ["capture ends", "reset"] and not graphs


# A collection runs at any allocation, so a pool left in a reference cycle can be finalized inside
# CAPTURE_LOCK's own acquire or release, while its thread holds the lock's inner (not reentrant)
# lock. This collects such a pool at every line those two run: a finalizer that takes CAPTURE_LOCK
# (as close() does) deadlocks here.
_COLLECTED_INSIDE_THE_LOCK = """
import gc, sys
import torch
from tlt.rollout.graph_pool import CAPTURE_LOCK, CudaGraphPool, FairLock, capturing

torch.cuda.synchronize = lambda *a: None
torch.cuda.empty_cache = lambda *a: None
resets = []

class Graph:
    def reset(self):
        resets.append(1)

def cyclic_pool():
    pool = object.__new__(CudaGraphPool)
    pool._graphs, pool._pools = {("bucketed", "key"): type("Cap", (), {"graph": Graph()})()}, {}
    pool.cycle = pool

def trace(frame, event, arg):
    if event == "line" and frame.f_code in (FairLock.acquire.__code__, FairLock.release.__code__):
        cyclic_pool()
        gc.collect()
    return trace

gc.disable()
sys.settrace(trace)
with CAPTURE_LOCK:
    pass
sys.settrace(None)
made = len(resets)
with capturing():
    pass
print(made, len(resets) > made, flush=True)
"""


def test_a_pool_collected_inside_the_capture_lock_does_not_deadlock():
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _COLLECTED_INSIDE_THE_LOCK], capture_output=True, text=True,
                       timeout=30, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                           [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["0", "True"]  # nothing destroyed inside the lock; the next capture did it
