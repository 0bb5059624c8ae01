"""Warm-up training: loss goes down, checkpoints are atomic, resume equals an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tlt.drafter.eagle import Drafter
from tlt.drafter.async_checkpoint import AsyncCheckpointer
from tlt.drafter.checkpoint import complete_steps, latest
from tlt.drafter.spot import SpotTrainer
from tlt.drafter.offline_train import STATE_NAME, TrainConfig, evaluate, train
from tlt.drafter.ttt import TTTConfig
from tests.drafter.test_packing import make_drafter, make_samples


def _cfg(**kw):
    return TrainConfig(**{"max_steps": 6, "lr": 1e-2, "token_budget": 64, "save_every": 3,
                          "warmup_steps": 1, "ttt": TTTConfig(steps=2), **kw})


def test_loss_decreases_and_accuracy_is_measured():
    samples = make_samples(12)
    d = make_drafter("eagle")
    losses = train(d, samples, _cfg(max_steps=60), None, progress=False)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    st = evaluate(d, samples, TTTConfig(steps=2))
    assert 0 <= st.accuracy(0) <= 1 and st.accept_length >= 1


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_resume_equals_uninterrupted(tmp_path, method, monkeypatch):
    samples = make_samples(10, aux=method == "eagle3")
    full = make_drafter(method)
    train(full, samples, _cfg(), tmp_path / "full", progress=False)

    real_save = AsyncCheckpointer.save

    def save_then_die(self, step, state):  # the process is killed once the step-3 checkpoint is on disk
        real_save(self, step, state)
        self.wait()
        raise KeyboardInterrupt

    monkeypatch.setattr(AsyncCheckpointer, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train(make_drafter(method), samples, _cfg(), tmp_path / "part", progress=False)
    monkeypatch.undo()
    assert latest(tmp_path / "part" / STATE_NAME) == 3
    resumed = make_drafter(method)  # fresh weights: everything must come from the checkpoint
    with torch.no_grad():
        for p in resumed.parameters():
            p.zero_()
    losses = train(resumed, samples, _cfg(), tmp_path / "part", resume=True, progress=False)
    assert len(losses) == 3
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    # The saved drafter directory loads back into the same module.
    again = Drafter.load(tmp_path / "part", full.embed_weight, full.target_head_weight)
    for (name, a), b in zip(full.state_dict().items(), again.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_warmup_is_a_one_rank_spot_session_with_the_schedule(tmp_path, monkeypatch):
    """One loop: the warm-up runs the spot trainer, whose optimizer follows the warm-up's schedule."""
    seen = []
    real_run = SpotTrainer.run

    def spy(self, next_batch, should_stop, on_step=None):
        assert self.spec.world_size == 1 and self.cfg.local_data
        return real_run(self, next_batch, should_stop,
                        lambda step, loss: seen.append(self.cfg.lr_at(step - 1)))

    monkeypatch.setattr(SpotTrainer, "run", spy)
    cfg = _cfg(max_steps=6, warmup_steps=2, lr=1e-2, min_lr_ratio=0.1)
    train(make_drafter("eagle"), make_samples(8), cfg, tmp_path, progress=False)
    assert seen[:2] == [5e-3, 1e-2] and seen[-1] < seen[2] and len(seen) == 6
    assert complete_steps(tmp_path / STATE_NAME) == [6]


def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    samples = make_samples(8)
    d = make_drafter("eagle")
    train(d, samples, _cfg(max_steps=3), tmp_path, progress=False)
    before = (tmp_path / "model.safetensors").read_bytes()

    import tlt.drafter.async_checkpoint as ckpt_mod

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod, "commit", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        train(d, samples, _cfg(max_steps=6), tmp_path, resume=True, progress=False)
    monkeypatch.undo()
    assert (tmp_path / "model.safetensors").read_bytes() == before
    assert complete_steps(tmp_path / STATE_NAME) == [3]  # the previous state, alone
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt-")]


def test_target_embedding_is_shared_and_never_trained():
    d = make_drafter("eagle")
    embed, head = d.embed_weight, d.target_head_weight
    e0, h0 = embed.clone(), head.clone()
    assert all(p.data_ptr() != embed.data_ptr() for p in d.parameters())
    assert "embed_weight" not in d.state_dict()
    train(d, make_samples(6), _cfg(max_steps=5), None, progress=False)
    assert d.embed_weight is embed
    torch.testing.assert_close(embed, e0, rtol=0, atol=0)
    torch.testing.assert_close(head, h0, rtol=0, atol=0)


def test_empty_training_set_is_an_error():
    with pytest.raises(ValueError, match="no training samples"):
        train(make_drafter("eagle"), [], _cfg(), None, progress=False)


def _first_spot_session(warm_dir, root, samples, drafter, store=None):
    """One spot step from the warm-up directory ``warm_dir`` into an empty ``root``; returns the
    Adam step count of the checkpoint it wrote and the schedule's step."""
    import dataclasses
    import socket

    from tlt.drafter.checkpoint import TrainState, load
    from tlt.drafter.offline_train import EpochBatches
    from tlt.drafter.spot import SessionSpec

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = dataclasses.replace(_cfg().spot_config(), max_steps=1, interval=1)
    SpotTrainer(spec=SessionSpec(rank=0, world_size=1, master_port=port, session_id="spot"), config=cfg,
                drafter_config=drafter.config, embed_weight=drafter.embed_weight,
                head_weight=drafter.target_head_weight, checkpoint_root=root, warm_store=store,
                init_from=warm_dir).run(EpochBatches(samples, cfg.token_budget, 0), lambda: False)
    d = Drafter(drafter.config, drafter.embed_weight, drafter.target_head_weight)
    opt = torch.optim.AdamW(d.parameters())
    st = TrainState(d, opt, frozen=(d.embed_weight, d.target_head_weight))
    assert load(root, {"train": st}, alone=True) == 1
    return {int(v["step"]) for v in opt.state.values()}, st.step, d.state_dict()


def test_a_first_spot_session_continues_the_warmups_optimizer(tmp_path, monkeypatch):
    """A warm-up directory carries its training state: the first spot session continues its Adam
    moments (fresh ones make the first step lr * sign(grad) on every weight, undoing the warm-up)
    while the spot schedule starts at step 0, from the checkpoint or, prefetched, from this
    process's memory (the same update). A directory whose weights are not its newest state's (the
    recorded step differs) gives the weights only."""
    import json

    import tlt.drafter.spot as spot
    from tlt.drafter.resume_state import WarmStore, prefetch, warmup_state

    samples = make_samples(8)
    warm = make_drafter("eagle")
    train(warm, samples, _cfg(max_steps=3, save_every=3), tmp_path / "warm", progress=False)
    init = warmup_state(tmp_path / "warm")
    assert init == tmp_path / "warm" / STATE_NAME
    adam_steps, step, weights = _first_spot_session(tmp_path / "warm", tmp_path / "spot", samples, warm)
    assert adam_steps == {4} and step == 1  # 3 warm-up steps + this one; the schedule restarted

    # prefetched into this process (a replica does it at start): the same step, no checkpoint read
    cfg = _cfg().spot_config()
    store = WarmStore()
    prefetch(store, init, warm.config, warm.embed_weight, warm.target_head_weight, lr=cfg.lr, betas=cfg.betas,
             weight_decay=cfg.weight_decay)
    read, real_load = [], spot.load
    monkeypatch.setattr(spot, "load", lambda root, *a, **k: read.append(Path(root)) or real_load(root, *a, **k))
    try:
        adam_steps, step, again = _first_spot_session(tmp_path / "warm", tmp_path / "spot2", samples, warm, store)
    finally:
        store.clear()
    assert init not in read and adam_steps == {4} and step == 1
    for name, a in weights.items():
        torch.testing.assert_close(again[name], a, rtol=0, atol=0, msg=name)

    config = tmp_path / "warm" / "tlt_drafter.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "step": 2}))
    assert warmup_state(tmp_path / "warm") is None
    adam_steps, step, _ = _first_spot_session(tmp_path / "warm", tmp_path / "spot3", samples, warm)
    assert adam_steps == {1} and step == 1
