"""The attention kernel compiles once per tile shape, not once per step shape.

Triton compiles a kernel per key of its specialization (its constexprs, each int argument's ==1 / %16
class, each pointer's alignment); on a GPU a compile of the attention kernel costs about a second,
inside whatever step first launches it, so an engine whose tuner keeps meeting new (arm, batch)
shapes would keep compiling in its timed rollouts. No GPU here: the keys are computed by Triton's
own binder for an H100 target from the arguments of each launch, and nothing is compiled or run on
a device (the launches are stand-ins that only key their arguments; the torch path computes)."""

from __future__ import annotations

import collections

import pytest
import torch

from tlt.rollout.attention import AttnMeta

pytest.importorskip("triton", reason="the kernel's compile keys need triton (the dev extra)")
pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's CUDA backend")

from tests.rollout.sm90 import SMS, backend, record_launches  # noqa: E402


@pytest.fixture
def launches(monkeypatch) -> collections.Counter:
    """The kernel's launches, keyed as Triton's JIT keys them for an H100: Counter of (kernel, key)."""
    from triton.runtime.jit import compute_cache_key

    from tlt.rollout import attention_triton as at
    from tlt.rollout.attention import TUNINGS

    target = backend()
    keys: collections.Counter = collections.Counter()

    def key(launch) -> None:
        _, spec, options = launch.bound
        keys[launch.kernel, compute_cache_key({}, spec, target.parse_options(options))] += 1

    record_launches(monkeypatch, key)
    monkeypatch.setattr(at, "tuning_for", lambda batch, kv_heads, device: TUNINGS.pick(batch, kv_heads, SMS))
    return keys


def test_a_new_batch_arm_or_split_count_compiles_no_new_kernel(launches):
    """Batch 1-64, split counts 1-64, plain steps, tree verifies, drafter levels and prefill chunks
    of any length: one kernel per tile shape (queries x GQA group: 16, 32 or 64 packed rows), masking
    (causal or not) and launch regime (few or many rows per multiprocessor)."""
    from tlt.rollout.attention import TUNINGS
    from tlt.rollout.attention_triton import paged_attention

    g = torch.Generator().manual_seed(0)
    slots, kvh, group, d = 512, 2, 4, 16  # an engine's cache: fixed while its steps' shapes change
    kl, vl = torch.zeros(64, kvh, slots, d), torch.zeros(64, kvh, slots, d)
    classes = set()
    for i in range(120):
        b, splits = int(torch.randint(1, 65, (1,), generator=g)), int(torch.randint(1, 65, (1,), generator=g))
        q = (1, int(torch.randint(2, 9, (1,), generator=g)), 2, int(torch.randint(1, 17, (1,), generator=g)))[i % 4]
        w = q if i % 4 != 2 else int(torch.randint(3, 12, (1,), generator=g))  # drafter levels: W > Q
        causal = i % 4 == 3  # a prefill chunk
        tail = None if causal else torch.rand(b, q, w, generator=g) < 0.5
        ctx = torch.randint(0, slots - w, (b,), generator=g)
        paged_attention(torch.zeros(b, kvh * group, q, d), kl, vl, AttnMeta.rows(ctx, w, slots, tail=tail, splits=splits))
        rows = q * group  # packed rows: queries x the GQA group
        classes.add((16 if rows <= 16 else 32 if rows <= 32 else 64, causal, TUNINGS.pick(b, kvh, SMS)))
    partials = {k for name, k in launches if name == "_partials"}
    merges = {k for name, k in launches if name == "_merge"}
    assert len(partials) == len(classes) and len(merges) <= len(classes), (len(partials), classes)


def test_a_tuners_later_rollouts_compile_no_kernel(launches, monkeypatch, trained_target, warm_drafters):
    """EAGLE + BEG-MAB with the tuner's GPU arms, static shapes, attention routed as on an H100 (its
    split counts, the kernel's launches keyed, every part through the kernel's entry point): the
    tuner explores arms at every batch size the tail passes through, and after the first rollout
    nothing it meets compiles. (With the batch bound and the split count compile-time constants, as
    before, its second rollout compiled 6 more kernels.)"""
    from tlt.demo.corpus import CorpusConfig, make_corpus
    from tlt.drafter.eagle import Drafter
    from tlt.rollout import attention, eagle_proposer, engine as engine_module, static_step
    from tlt.rollout.attention_triton import paged_attention
    from tlt.rollout.eagle_proposer import EagleProposer
    from tlt.rollout.engine import EngineConfig, RolloutEngine
    from tlt.rollout.generate import SamplingParams
    from tlt.rollout.target import TargetModel
    from tlt.rollout.tuner import BegMab, TunerConfig
    from tlt.tokenizer import TextTokenizer

    monkeypatch.setattr(attention, "_sms", lambda device: SMS)
    real = attention.default_splits

    def splits(batch, kv_heads, slots, device, kernel="auto", tuning=None, head_dim=128):
        return real(batch, kv_heads, slots, torch.device("cuda"), kernel, tuning, head_dim)

    for module in (static_step, engine_module, eagle_proposer):
        monkeypatch.setattr(module, "default_splits", splits)

    def attend(q, kl, vl, meta):  # the kernel's launch keyed, the torch path's output
        paged_attention(q, kl, vl, meta)
        return attention.attend_torch(q, kl, vl, meta)

    # step times as a function of the arm, not this machine's clock: the tuner's path (which arms it
    # meets at which batch sizes, in which rollout) is then the same in every run
    record = BegMab.record
    monkeypatch.setattr(BegMab, "record", lambda self, b, arm, accepted, seconds: record(
        self, b, arm, accepted, 1e-3 * (1 + arm.tokens_to_verify / 16)))
    settle = attention.PagedBackend._settle
    monkeypatch.setattr(attention, "attend", attend)
    monkeypatch.setattr(attention.PagedBackend, "_settle", lambda self, q, k: (*settle(self, q, k)[:2], None))
    model = TargetModel.from_pretrained(trained_target)
    tok = TextTokenizer.from_pretrained(trained_target)
    prompts = [tok.chat_prompt([{"role": "user", "content": p.prompt}])
               for p in make_corpus(8, CorpusConfig(seed=5, median_steps=3)) for _ in range(2)]
    params = [SamplingParams(max_new_tokens=8 + 5 * i, stop_ids=(tok.eos_id,)) for i in range(16)]  # the tail
    drafter = Drafter.load(warm_drafters["eagle"], model.embed_weight, model.lm_head.weight)
    eng = RolloutEngine(model, EngineConfig(max_batch=16, max_len=512, static_shapes=True, seed=0),
                        proposer=EagleProposer(drafter, max_batch=16, max_len=576),
                        tuner=BegMab(TunerConfig.for_device("cuda", seed=0)))
    first = None
    for _ in range(3):
        res = eng.generate(prompts, params)
        assert any(s.sd for s in res.steps) and len({s.batch for s in res.steps}) > 3
        first = first or set(launches)
        assert first, "no launch reached the kernel: the emulation routes nothing through it"
        assert set(launches) == first, f"{len(set(launches) - first)} kernels compiled after the first rollout"
    assert len(first) <= 16, len(first)  # tile shapes x masking x launch regimes x caches (target, drafter)
