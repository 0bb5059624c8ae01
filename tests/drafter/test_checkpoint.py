"""Selective async checkpoints: one test per state-machine rule, selectivity, crash safety."""

from __future__ import annotations

import copy
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import Future

import pytest
import torch
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

import tlt.drafter.checkpoint as ck
from tlt.drafter.async_checkpoint import AsyncCheckpointer, SaveState
from tlt.drafter.checkpoint import (
    TrainState,
    complete_steps,
    latest,
    load,
    load_weights,
    save_sync,
    step_dir,
)
from tlt.drafter.packing import pack
from tlt.drafter.ttt import TTTConfig, ttt_forward
from tests.drafter.test_packing import make_drafter, make_samples


def _trained(method: str = "eagle3", seed: int = 0):
    d = make_drafter(method, seed=seed)
    opt = torch.optim.AdamW(d.parameters(), lr=1e-2)
    cfg = TTTConfig(steps=2)
    ttt_forward(d, pack(make_samples(4, aux=method == "eagle3")), cfg).loss(cfg).backward()
    opt.step()
    return d, opt


class _FakeSave:
    """Stands in for ``dcp.async_save``: writes a marker, returns futures the test completes."""

    def __init__(self, overlap: bool = False) -> None:
        self.futures: list[Future] = []  # upload completion
        self.staged: list[Future] = []  # staging completion (overlap only)
        self.overlap = overlap

    def __call__(self, state, *, storage_writer, **kw):
        os.makedirs(storage_writer.path, exist_ok=True)
        open(os.path.join(storage_writer.path, ".metadata"), "w").close()
        f: Future = Future()
        self.futures.append(f)
        if not self.overlap:
            return f
        self.staged.append(Future())
        return AsyncSaveResponse(staging_completion=self.staged[-1], upload_completion=f)


def _started(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_selective_state_has_only_drafter_params_and_optimizer(tmp_path):
    d, opt = _trained("eagle3")
    st = TrainState(d, opt, step=1, frozen=(d.embed_weight, d.target_head_weight))
    sd = st.state_dict()
    assert set(sd["model"]) == set(d.state_dict())  # params + the EAGLE-3 vocab-map buffers
    assert not any("embed" in k for k in sd["model"])
    assert set(sd["optim"]["state"]) == {n for n, _ in d.named_parameters()}
    assert sd["progress"] == {"step": 1}
    with AsyncCheckpointer(tmp_path) as c:
        c.save(1, {"train": st})
    param_bytes = sum(p.numel() * p.element_size() for p in d.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in (d.d2t, d.t2d))
    step_bytes = 4 * len(list(d.parameters()))  # Adam's per-parameter step counters
    assert c.stats.bytes == 3 * param_bytes + buffer_bytes + step_bytes  # params + 2 moments


def test_target_tensor_in_the_state_is_refused():
    d, opt = _trained("eagle")
    d.leak = torch.nn.Parameter(d.embed_weight, requires_grad=False)  # the reference impl's trap
    st = TrainState(d, opt, frozen=(d.embed_weight, d.target_head_weight))
    with pytest.raises(RuntimeError, match="target tensor"):
        st.state_dict()


@pytest.mark.parametrize("method,overlap", [("eagle", False), ("eagle3", False), ("eagle3", True)])
def test_load_restores_exactly_and_snapshot_is_taken_before_mutation(tmp_path, method, overlap):
    d, opt = _trained(method)
    want = {k: v.clone() for k, v in d.state_dict().items()}
    want_opt = copy.deepcopy(opt.state_dict())
    c = AsyncCheckpointer(tmp_path, overlap_staging=overlap)
    c.save(7, {"train": TrainState(d, opt, step=7)})
    c.wait_staged()  # without overlap the snapshot is already taken: a no-op
    with torch.no_grad():  # the loop goes on training right away: the snapshot must not see it
        for p in d.parameters():
            p.add_(1.0)
    c.close()
    assert c.state is SaveState.CLOSED and latest(tmp_path) == 7
    fresh, fresh_opt = make_drafter(method, seed=5), None
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    st = TrainState(fresh, fresh_opt)
    assert load(tmp_path, {"train": st}) == 7 and st.step == 7
    for k, v in want.items():
        torch.testing.assert_close(fresh.state_dict()[k], v, rtol=0, atol=0, msg=k)
    got_opt = fresh_opt.state_dict()
    for i, s in want_opt["state"].items():
        for name, v in s.items():
            torch.testing.assert_close(got_opt["state"][i][name], v, rtol=0, atol=0)
    assert got_opt["param_groups"][0]["lr"] == want_opt["param_groups"][0]["lr"]


def test_at_most_one_save_in_flight_second_waits_for_first(tmp_path, monkeypatch):
    fake = _FakeSave()
    monkeypatch.setattr(ck.dcp, "async_save", fake)
    c = AsyncCheckpointer(tmp_path)
    c.save(1, {"x": torch.zeros(2)})
    assert c.state is SaveState.SAVING and len(fake.futures) == 1
    second = _started(lambda: c.save(2, {"x": torch.ones(2)}))
    time.sleep(0.2)
    assert second.is_alive() and len(fake.futures) == 1  # blocked: step 1 still in flight
    assert latest(tmp_path) is None
    fake.futures[0].set_result(None)
    second.join(5)
    assert not second.is_alive() and len(fake.futures) == 2
    assert latest(tmp_path) == 1 and c.stats.stall_s[-1] >= 0.15  # the wait counts as stall
    fake.futures[1].set_result(None)
    assert c.wait() == 2 and c.state is SaveState.IDLE and c.stats.committed == [1, 2]


def test_commit_happens_when_the_write_finishes_without_wait(tmp_path, monkeypatch):
    fake = _FakeSave()
    monkeypatch.setattr(ck.dcp, "async_save", fake)
    c = AsyncCheckpointer(tmp_path)
    c.save(3, {"x": torch.zeros(2)})
    fake.futures[0].set_result(None)  # the writer finishes; the loop has not called wait()
    assert latest(tmp_path) == 3 and c.state is SaveState.SAVING
    assert c.wait() == 3 and c.state is SaveState.IDLE


def test_overlapped_snapshot_must_finish_before_the_state_changes(tmp_path, monkeypatch):
    fake = _FakeSave(overlap=True)
    monkeypatch.setattr(ck.dcp, "async_save", fake)
    c = AsyncCheckpointer(tmp_path, overlap_staging=True)
    assert c.wait_staged() == 0.0  # idle: nothing to wait for
    c.save(1, {"x": torch.zeros(2)})
    assert c.state is SaveState.STAGING
    stager = _started(c.wait_staged)
    time.sleep(0.2)
    assert stager.is_alive()  # the optimizer step would have to wait here
    fake.staged[0].set_result(None)
    stager.join(5)
    assert not stager.is_alive() and c.state is SaveState.SAVING
    assert c.stats.stall_s[-1] >= 0.15  # blocked time counts as this save's stall
    fake.futures[0].set_result(None)
    assert c.wait() == 1 and c.state is SaveState.IDLE


def test_close_waits_for_the_in_flight_save(tmp_path, monkeypatch):
    fake = _FakeSave()
    monkeypatch.setattr(ck.dcp, "async_save", fake)
    c = AsyncCheckpointer(tmp_path)
    c.save(1, {"x": torch.zeros(2)})
    closer = _started(c.close)
    time.sleep(0.2)
    assert closer.is_alive() and c.state is SaveState.SAVING
    fake.futures[0].set_result(None)
    closer.join(5)
    assert not closer.is_alive() and c.state is SaveState.CLOSED and latest(tmp_path) == 1
    with pytest.raises(RuntimeError, match="after close"):
        c.save(2, {"x": torch.zeros(2)})


def test_failed_write_surfaces_in_wait_and_commits_nothing(tmp_path, monkeypatch):
    fake = _FakeSave()
    monkeypatch.setattr(ck.dcp, "async_save", fake)
    c = AsyncCheckpointer(tmp_path)
    c.save(1, {"x": torch.zeros(2)})
    fake.futures[0].set_exception(OSError("disk full"))
    with pytest.raises(RuntimeError, match="step 1 failed"):
        c.wait()
    assert latest(tmp_path) is None and c.state is SaveState.IDLE


def test_latest_ignores_incomplete_and_keeps_last_k(tmp_path):
    with AsyncCheckpointer(tmp_path, keep_last=2) as c:
        for s in range(1, 6):
            c.save(s, {"x": torch.full((3,), float(s))})
    assert complete_steps(tmp_path) == [4, 5]
    (step_dir(tmp_path, 9).with_suffix(".tmp")).mkdir()  # a killed save, even with metadata
    (step_dir(tmp_path, 9).with_suffix(".tmp") / ".metadata").touch()
    step_dir(tmp_path, 8).mkdir()  # a directory without DCP metadata is not a checkpoint
    assert latest(tmp_path) == 5
    AsyncCheckpointer(tmp_path).close()  # a new checkpointer clears leftovers of killed saves
    assert not step_dir(tmp_path, 9).with_suffix(".tmp").exists()
    x = {"x": torch.zeros(3)}
    assert load(tmp_path, x) == 5 and x["x"].tolist() == [5.0] * 3
    with pytest.raises(ValueError, match="keep_last"):
        AsyncCheckpointer(tmp_path, keep_last=0)


def test_a_pinned_step_survives_pruning_until_unpinned(tmp_path):
    """The step the driver pushes is pinned while the replicas read it: without the pin a session
    that kept saving would prune it mid-read (the race this guards against)."""
    with AsyncCheckpointer(tmp_path, keep_last=1) as c:
        c.save(1, {"x": torch.ones(2)})
        c.wait()
        ck.pin(tmp_path, [1])
        for s in (2, 3):
            c.save(s, {"x": torch.full((2,), float(s))})
    assert complete_steps(tmp_path) == [1, 3] and ck.pinned(tmp_path) == {1}
    x = {"x": torch.zeros(2)}
    assert load(tmp_path, x, step=1) == 1 and x["x"].tolist() == [1.0, 1.0]  # the pushed step, not the latest
    ck.pin(tmp_path, [])
    ck.prune(tmp_path, keep_last=1)
    assert complete_steps(tmp_path) == [3]


def test_load_weights_reads_the_weights_only(tmp_path, monkeypatch):
    """Serving a drafter builds no optimizer and reads no optimizer state."""
    d, opt = _trained("eagle")
    save_sync(tmp_path, 2, {"train": TrainState(d, opt)})
    fresh = make_drafter("eagle", seed=5)

    def no_optimizer(*a, **k):
        raise AssertionError("load_weights touched optimizer state")

    monkeypatch.setattr(torch.optim, "AdamW", no_optimizer)
    monkeypatch.setattr(ck, "set_state_dict", no_optimizer)
    assert load_weights(tmp_path, fresh) == 2
    for (name, a), b in zip(d.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_checkpoint_of_another_drafter_is_a_value_error_naming_the_fix(tmp_path):
    """A root written by an EAGLE drafter, read into an EAGLE-3 one (a run whose drafter config
    changed): DCP's CheckpointException is a BaseException, which the spot agent's `except
    Exception` did not catch, so the session thread died without answering its STOP."""
    d, opt = _trained("eagle")
    save_sync(tmp_path, 2, {"train": TrainState(d, opt)})
    other, other_opt = _trained("eagle3")
    for read in (lambda: load(tmp_path, {"train": TrainState(other, other_opt)}),
                 lambda: load_weights(tmp_path, other)):
        with pytest.raises(ValueError, match=r"step-0+2 could not be read into this drafter: .*d2t.*draft "
                                             r"vocabulary changed .* use another checkpoint root"):
            read()


def test_sync_save_uses_the_same_commit(tmp_path):
    assert save_sync(tmp_path, 4, {"x": torch.ones(2)}) > 0
    assert latest(tmp_path) == 4 and not list(tmp_path.glob("*.tmp"))


# ---------------------------------------------------------------- SIGKILL during a save
def _big_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(6_000_000, generator=g), "step": torch.tensor(step)}  # 24 MB


def _killed_saver(root: str, where: str) -> None:
    torch.set_num_threads(1)
    c = AsyncCheckpointer(root)
    c.save(1, _big_state(1))
    c.wait()
    if where == "in_write":  # die inside DCP's writer, after the shard's bytes, before metadata
        real = os.fsync

        def fsync_then_die(fd):
            real(fd)
            os.kill(os.getpid(), signal.SIGKILL)

        os.fsync = fsync_then_die
    c.save(2, _big_state(2))
    if where == "after_save_returns":
        os.kill(os.getpid(), signal.SIGKILL)
    c.wait()  # only reached if the kill did not happen
    os._exit(3)


@pytest.mark.parametrize("where", ["after_save_returns", "in_write"])
def test_sigkill_during_save_keeps_the_latest_complete_checkpoint(tmp_path, where):
    proc = multiprocessing.get_context("spawn").Process(target=_killed_saver, args=(str(tmp_path), where))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    assert latest(tmp_path) == 1
    if where == "in_write":  # the kill really fell mid-save
        assert (step_dir(tmp_path, 2).with_suffix(".tmp") / "__0_0.distcp").is_file()
    state = {"w": torch.zeros(6_000_000), "step": torch.tensor(0)}
    assert load(tmp_path, state) == 1
    torch.testing.assert_close(state["w"], _big_state(1)["w"], rtol=0, atol=0)
