"""The engine's feature sink into the DataBuffer (:class:`~tlt.integrations.verl.spot_wiring.BufferFeed`):
a rollout's samples train the drafter exactly as whole sequences of the same tokens do.

A finished request reaches the buffer with every token, its last (the stop token, or the one its
budget ended on) a label like the others: the drafter learns to predict the end of a response. For
each sample, the training-time-test loss and its counts (:func:`~tlt.drafter.ttt.ttt_forward`) equal
those of a direct forward over the whole sequence, as the warm-up builds its samples; the feature
row the engine has no forward for (the last token's) is never read.
"""

from __future__ import annotations

import pytest
import torch

from tlt.demo.corpus import CorpusConfig, make_corpus
from tlt.drafter.buffer import BufferConfig, DataBuffer
from tlt.drafter.eagle import Drafter
from tlt.drafter.packing import FeatureSample, pack
from tlt.drafter.ttt import TTTConfig, ttt_forward
from tlt.integrations.verl.spot_wiring import BufferFeed
from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.generate import SamplingParams
from tlt.rollout.target import TargetModel
from tlt.tokenizer import TextTokenizer


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_rollouts_samples_train_like_whole_sequences_final_token_included(trained_target, warm_drafters, method):
    model = TargetModel.from_pretrained(trained_target)
    tok = TextTokenizer.from_pretrained(trained_target)
    drafter = Drafter.load(warm_drafters[method], model.embed_weight, model.lm_head.weight)
    prompts = [tok.chat_prompt([{"role": "user", "content": p.prompt}])
               for p in make_corpus(4, CorpusConfig(seed=21, median_steps=3))]
    buffer = DataBuffer(BufferConfig(dtype="float32"))
    feed = BufferFeed(buffer, drafter.feature_layers, lambda: 0)
    res = RolloutEngine(model, EngineConfig(max_batch=4, max_len=512), sink=feed).generate(
        prompts, SamplingParams(max_new_tokens=200, stop_ids=(tok.eos_id,), temperature=1.0), seeds=[1, 2, 3, 4])
    samples = buffer.sample_batch(1 << 20)
    assert sorted(s.input_ids.tolist() for s in samples) == sorted(p + o for p, o in zip(prompts, res.outputs))
    assert any(o[-1] == tok.eos_id for o in res.outputs)  # a stop token among the final labels
    cfg = TTTConfig(steps=3)
    for s in samples:
        with torch.no_grad():
            ref = model(s.input_ids[None], capture=drafter.feature_layers)
            aux = torch.cat([ref.aux[i][0] for i in drafter.feature_layers], -1) if drafter.feature_layers else None
            whole = FeatureSample(s.input_ids, s.loss_mask, ref.hidden[0], aux)
            got, want = (ttt_forward(drafter, pack([x]), cfg) for x in (s, whole))
        response = int(s.loss_mask.sum())
        assert got.positions == want.positions == response  # every response token is a label, the last too
        assert got.count == want.count and got.top1 == want.top1
        assert torch.allclose(got.loss(cfg), want.loss(cfg), atol=1e-4)
