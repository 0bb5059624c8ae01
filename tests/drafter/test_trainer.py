"""Warm-up training: loss goes down, checkpoints are atomic, resume equals an uninterrupted run."""

from __future__ import annotations

import pytest
import torch

from drafter.eagle import Drafter
from drafter.checkpoint import complete_steps, latest
from drafter.trainer import STATE_NAME, TrainConfig, evaluate, train
from drafter.ttt import TTTConfig
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

    import drafter.trainer as trainer_mod

    real_save = trainer_mod.save_checkpoint

    def save_then_die(*a, **k):  # the process is killed right after the step-3 checkpoint
        real_save(*a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer_mod, "save_checkpoint", save_then_die)
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


def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    samples = make_samples(8)
    d = make_drafter("eagle")
    train(d, samples, _cfg(max_steps=3), tmp_path, progress=False)
    before = (tmp_path / "model.safetensors").read_bytes()

    import drafter.trainer as trainer_mod

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(trainer_mod.ckpt, "save_sync", boom)
    with pytest.raises(OSError):
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
