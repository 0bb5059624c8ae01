"""Spot trainer: 2-rank FSDP2/gloo equals one process (EAGLE and EAGLE-3, with gradient
accumulation), resume on another membership, preemption within one micro-step, and a SIGKILL
loses at most one checkpoint interval.

Real processes (spawn), gloo on 127.0.0.1, a tiny drafter; each test stays well under 40 s.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import random
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from tlt.drafter.checkpoint import TrainState, complete_steps, latest, load, step_dir
from tlt.drafter.eagle import Drafter, DrafterConfig
from tlt.drafter.packing import pack, shard_samples, split_chunks
from tlt.drafter.resume_state import WarmStore
from tlt.drafter.spot import PreemptFlag, SessionResult, SessionSpec, SpotConfig, SpotTrainer, run_session
from tlt.drafter.ttt import TTTConfig, ttt_forward
from tests.drafter.test_packing import make_samples, tiny_target_cfg

TTT = TTTConfig(steps=2)


def _dump(r: SessionResult, path) -> None:  # a spawned rank's result, back to the test process
    Path(path).write_text(json.dumps(dataclasses.asdict(r)))


def _read(path) -> SessionResult:
    return SessionResult(**{k: tuple(v) if isinstance(v, list) else v
                            for k, v in json.loads(Path(path).read_text()).items()})


def _cfg(**kw) -> SpotConfig:
    return SpotConfig(**{"lr": 1e-2, "token_budget": 256, "interval": 2, "ttt": TTT, "seed": 3, **kw})


def _target(method: str = "eagle"):
    g = torch.Generator().manual_seed(11)
    tcfg = tiny_target_cfg()
    embed = torch.randn(tcfg.vocab_size, tcfg.hidden_size, generator=g)
    head = torch.randn(tcfg.vocab_size, tcfg.hidden_size, generator=g) * 0.3
    return DrafterConfig.for_target(tcfg, method, draft_vocab_size=40), embed, head


class _Stream:
    """Call-indexed data, identical on every rank: call ``i`` always returns the same samples."""

    def __init__(self, start: int = 0, n: int = 6, hook=None, aux: bool = False) -> None:
        self.i, self.n, self.hook, self.aux = start, n, hook, aux

    def __call__(self, token_budget: int):
        if self.hook:
            self.hook(self.i)
        out = make_samples(self.n, seed=1000 + self.i, aux=self.aux)
        self.i += 1
        return out


def _reference(micro: list[int], cfg: SpotConfig, method: str = "eagle"):
    """One process, no FSDP, each micro-batch in one packed row: the ground truth.

    ``micro[k]`` micro-batches (gradient accumulation, mean) make optimizer step ``k``.
    """
    dcfg, embed, head = _target(method)
    torch.manual_seed(cfg.seed)
    d = Drafter(dcfg, embed, head)
    opt = torch.optim.AdamW(d.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    ttt = cfg.ttt.for_drafter(d)
    stream, losses, weights = _Stream(aux=method == "eagle3"), [], []
    for m in micro:
        total = 0.0
        for _ in range(m):
            loss = ttt_forward(d, pack(stream(0)), ttt).loss(ttt) / m
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(list(d.parameters()), cfg.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
        weights.append({k: v.clone() for k, v in d.state_dict().items()})
    return losses, weights


def _checkpoint_weights(root, step: int, method: str = "eagle") -> dict:
    dcfg, embed, head = _target(method)
    d = Drafter(dcfg, embed, head)
    st = TrainState(d, torch.optim.AdamW(d.parameters()))
    assert load(root, {"train": st}, step=step) == step and st.step == step
    return d.state_dict()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ports() -> tuple[int, int]:
    """Two ports for back-to-back sessions, below the ephemeral range: the first session's gloo
    sockets cannot take the second one's port in between (an EADDRINUSE seen in CI)."""
    from tlt.ports import free_port

    p = free_port(2)
    return p, p + 1


def _spawn(fn, nprocs: int, *args, timeout: float = 90) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=fn, args=(r, *args)) for r in range(nprocs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0] * nprocs


STORE = WarmStore()  # this process's warm states, as a replica holds its own (each spawned rank has one)


def _session(rank, world, port, sid, root, cfg, stream, stop=lambda: False, target=None,
             method="eagle", store=STORE, init_from=None):
    dcfg, embed, head = target or _target(method)
    spec = SessionSpec(rank=rank, world_size=world, master_port=port, session_id=sid)
    return run_session(spec=spec, config=cfg, drafter_config=dcfg, embed_weight=embed, head_weight=head,
                       checkpoint_root=root, next_batch=stream, should_stop=stop, warm_store=store,
                       init_from=init_from)


# ---------------------------------------------------------------- workers (spawned processes)
def _two_then_one(rank, ports, root, out, method):
    torch.set_num_threads(1)
    aux = method == "eagle3"
    # Session 1: 2 ranks, 2 micro-steps per step, overlapped snapshots (the CUDA default) forced
    # on: a missing wait_staged() would let the optimizer step race the copy.
    cfg1 = _cfg(max_steps=4, micro_steps=2, overlap_staging=True)
    r1 = _session(rank, 2, ports[0], "s1", root, cfg1, _Stream(aux=aux), method=method)
    _dump(r1, f"{out}/s1-{rank}.json")
    if rank == 0:  # this process stays; the next session has other members and another port
        stream = _Stream(start=2 * r1.end_step, aux=aux)
        r2 = _session(0, 1, ports[1], "s2", root, _cfg(max_steps=6), stream, method=method)
        _dump(r2, f"{out}/s2-0.json")


def _preempted(rank, port, root, out, seed):
    torch.set_num_threads(1)
    flag = PreemptFlag()
    rng = random.Random(seed)

    def hook(i):  # rank 0 only: the request lands at a random moment inside micro-step 3
        if rank == 0 and i == 3:
            threading.Timer(rng.uniform(0.0, 0.05), flag.set).start()

    target = _target()
    before = (target[1].clone(), target[2].clone())
    r = _session(rank, 2, port, "p", root, _cfg(token_budget=2048, interval=100), _Stream(n=24, hook=hook),
                 stop=flag, target=target)
    assert torch.equal(target[1], before[0]) and torch.equal(target[2], before[1])  # never written
    _dump(r, f"{out}/p-{rank}.json")


def _chunked(rank, port, root, out, seed):
    """Local data of different sizes per rank (rank 1's micro-steps have fewer chunks: it pads
    with empty ones), trained in ~20 ms chunks; rank 0's flag lands inside micro-step 3."""
    torch.set_num_threads(1)
    flag = PreemptFlag()
    rng = random.Random(seed)

    def hook(i):
        if rank == 0 and i == 3:
            threading.Timer(rng.uniform(0.0, 0.05), flag.set).start()

    cfg = _cfg(token_budget=2048, interval=100, local_data=True, preempt_s=0.02)
    r = _session(rank, 2, port, "c", root, cfg, _Stream(n=24 if rank == 0 else 8, hook=hook), stop=flag)
    _dump(r, f"{out}/c-{rank}.json")


def _killed(rank, port, root, kill_at):
    torch.set_num_threads(1)

    def hook(i):
        if i == kill_at:  # kill_at steps are done; give the background commit time, then die
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)

    _session(rank, 1, port, "k", root, _cfg(interval=2), _Stream(hook=hook))
    os._exit(3)  # unreachable: the session trains until killed


# ---------------------------------------------------------------- tests
def test_configs_validate():
    with pytest.raises(ValueError, match="rank"):
        SessionSpec(rank=2, world_size=2, master_port=1234, session_id="x")
    with pytest.raises(ValueError, match="master_port"):
        SessionSpec(rank=0, world_size=1, master_port=0, session_id="x")
    with pytest.raises(ValueError, match="interval"):
        SpotConfig(interval=0)
    with pytest.raises(ValueError, match="lr"):
        SpotConfig(lr=0)
    with pytest.raises(ValueError, match="max_steps"):
        SpotConfig(max_steps=-1)


def test_shards_are_disjoint_balanced_and_cover_the_batch():
    samples = make_samples(9)
    shards = [shard_samples(samples, r, 2) for r in range(2)]
    ids = sorted(id(s) for sh in shards for s in sh)
    assert ids == sorted(id(s) for s in samples)
    loads = [sum(len(s) for s in sh) for sh in shards]
    assert abs(loads[0] - loads[1]) <= max(len(s) for s in samples)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_two_ranks_equal_one_process_and_resume_on_other_membership(tmp_path, method):
    root, out = tmp_path / "ckpt", tmp_path
    _spawn(_two_then_one, 2, _two_ports(), str(root), str(out), method)
    ref_losses, ref_w = _reference([2, 2, 2, 2, 1, 1], _cfg(), method)
    s1 = [_read(out / f"s1-{r}.json") for r in range(2)]
    s2 = _read(out / "s2-0.json")
    assert s1[0].losses == s1[1].losses and s1[0].stop_reason == "max_steps"
    assert (s1[0].start_step, s1[0].end_step, s1[0].checkpoint_step) == (0, 4, 4)
    torch.testing.assert_close(list(s1[0].losses), ref_losses[:4], rtol=1e-5, atol=1e-6)
    # Session 2: one rank, resumed from the 2-rank checkpoint; its first loss only matches if
    # weights *and* optimizer state came back exactly.
    assert (s2.start_step, s2.end_step, s2.world_size, s2.checkpoint_step) == (4, 6, 1, 6)
    torch.testing.assert_close(list(s2.losses), ref_losses[4:6], rtol=1e-5, atol=1e-6)
    assert complete_steps(root) == [4, 6]  # keep_last=2
    for step in (4, 6):
        got = _checkpoint_weights(root, step, method)
        for k, v in ref_w[step - 1].items():  # Adam amplifies summation-order noise a little
            torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-4,
                                       msg=lambda m, k=k, step=step: f"step {step} {k}: {m}")


def test_preemption_stops_both_ranks_within_one_micro_step(tmp_path):
    _spawn(_preempted, 2, _free_port(), str(tmp_path / "ckpt"), str(tmp_path), 7)
    r0, r1 = (_read(tmp_path / f"p-{r}.json") for r in range(2))
    assert r0.stop_reason == r1.stop_reason == "preempted"
    assert r0.end_step == r1.end_step >= 4  # the flag fell during or after the 4th step
    assert r1.preempt_latency_s is None  # rank 1's own flag was never set; it followed rank 0
    bound = max(r0.check_interval_s) + 0.25  # one micro-step + the stop all-reduce (loaded CI box)
    assert 0 <= r0.preempt_latency_s <= bound, (r0.preempt_latency_s, r0.check_interval_s)
    assert r0.stop_latency_s >= r0.preempt_latency_s
    assert r0.checkpoint_step == r0.end_step == latest(tmp_path / "ckpt")  # final checkpoint durable


def test_split_chunks_keeps_whole_samples_in_order():
    samples = make_samples(9, seed=5)
    for cap in (1, 40, 100, 10_000):
        chunks = split_chunks(samples, cap)
        assert [s for c in chunks for s in c] == samples
        assert all(sum(map(len, c)) <= cap or len(c) == 1 for c in chunks)
    assert len(split_chunks(samples, 10_000)) == 1 and split_chunks([], 8) == []
    with pytest.raises(ValueError, match="preempt_s"):
        _cfg(preempt_s=0)


def test_chunked_preemption_stops_within_one_chunk(tmp_path):
    _spawn(_chunked, 2, _free_port(), str(tmp_path / "ckpt"), str(tmp_path), 3)
    r0, r1 = (_read(tmp_path / f"c-{r}.json") for r in range(2))
    assert r0.stop_reason == r1.stop_reason == "preempted"
    assert r0.end_step == r1.end_step >= 3 and r0.losses == r1.losses  # agreed chunks, one global loss
    assert all(x == x and x > 0 for x in r0.losses)
    # More stop checks than micro-steps: each micro-step was cut into chunks, on both ranks alike.
    assert len(r0.check_interval_s) == len(r1.check_interval_s) > 2 * r0.end_step
    assert r0.tokens_per_s and r1.tokens_per_s
    bound = max(r0.check_interval_s) + 0.25
    assert 0 <= r0.preempt_latency_s <= bound, (r0.preempt_latency_s, r0.check_interval_s)
    assert r0.checkpoint_step == r0.end_step == latest(tmp_path / "ckpt")


def test_a_step_stopped_between_or_inside_chunks_applies_the_chunks_trained(tmp_path):
    """The stop lands before the third chunk of the first step (check 7), between its TTT steps
    (8) or before its backward (9): the mean gradient of the two chunks trained is applied (step
    1, checkpointed), not thrown away, and the abandoned chunk adds nothing: the same weights."""
    # Checks: 2 in set-up, 1 before the micro-step, none inside the session's first chunk, then
    # per chunk (TTT.steps == 2): one before it, one between its TTT steps, one before its backward.
    got = []
    for n in (7, 8, 9):
        calls = []

        def stop(calls=calls, n=n):
            calls.append(1)
            return len(calls) >= n

        cfg = _cfg(token_budget=2048, interval=100, preempt_s=0.01)  # first chunks: 64 tokens
        r = _session(0, 1, _free_port(), "h", tmp_path / str(n), cfg, _Stream(n=24), stop=stop)
        assert (r.stop_reason, r.start_step, r.end_step, r.checkpoint_step) == ("preempted", 0, 1, 1)
        assert len(r.losses) == 1 and r.losses[0] > 0 and len(calls) == n
        got.append((r.losses, _checkpoint_weights(tmp_path / str(n), 1)))
    for losses, weights in got[1:]:
        assert losses == got[0][0]
        for k, v in weights.items():
            assert torch.equal(v, got[0][1][k]), k


def test_a_session_applies_its_first_chunk_however_soon_the_stop(tmp_path):
    """A stop raised once training began (any check after the micro-step's first) is not obeyed
    inside the session's first chunk: that chunk is applied (step 1, checkpointed), so a session in
    a very short idle window still moves the drafter."""
    calls = []

    def stop():
        calls.append(1)
        return len(calls) >= 4  # 2 in set-up, the micro-step's first; then stop at the next check

    cfg = _cfg(token_budget=2048, interval=100, preempt_s=0.01)
    r = _session(0, 1, _free_port(), "f", tmp_path, cfg, _Stream(n=24), stop=stop)
    assert (r.stop_reason, r.start_step, r.end_step, r.checkpoint_step) == ("preempted", 0, 1, 1)
    assert len(calls) == 4


def test_a_stop_before_a_periodic_checkpoint_exits_before_it(tmp_path, monkeypatch):
    """The flag rises as step 1 ends, a checkpoint step (interval 1): the loop exits at the agreed
    check before that save, and the final save writes step 1; a stop does not wait for a periodic
    save (slowed to 0.5 s here)."""
    from tlt.drafter import spot

    real = spot.AsyncCheckpointer.save

    def slow(self, *a, **kw):
        time.sleep(0.5)
        return real(self, *a, **kw)

    monkeypatch.setattr(spot.AsyncCheckpointer, "save", slow)
    flag, (dcfg, embed, head) = PreemptFlag(), _target()
    trainer = SpotTrainer(spec=SessionSpec(rank=0, world_size=1, master_port=_free_port(), session_id="i"),
                          config=_cfg(interval=1, preempt_s=0.02), drafter_config=dcfg, embed_weight=embed,
                          head_weight=head, checkpoint_root=tmp_path)
    r = trainer.run(_Stream(), flag, on_step=lambda step, loss: flag.set())
    assert (r.stop_reason, r.start_step, r.end_step, r.checkpoint_step) == ("preempted", 0, 1, 1)
    assert r.preempt_latency_s < 0.25 <= r.stop_latency_s  # exited, then the (slow) final save


@pytest.mark.parametrize("stage", ["formed", "built"])
def test_a_stop_during_set_up_skips_the_rest_of_it(tmp_path, monkeypatch, stage):
    """A stop that lands once the group formed, or while the drafter is being built, returns at
    the next set-up check: no checkpoint read, no training, nothing written."""
    from tlt.drafter import spot

    first = _session(0, 1, _free_port(), "a", tmp_path, _cfg(max_steps=2, interval=100), _Stream())
    assert first.checkpoint_step == 2
    flag = spot.PreemptFlag()
    real_build, reads = spot.SpotTrainer._build, []
    if stage == "formed":
        flag.set()
    else:
        def build(self):
            out = real_build(self)
            flag.set()  # lands while the session is still setting up
            return out
        monkeypatch.setattr(spot.SpotTrainer, "_build", build)
    monkeypatch.setattr(spot.SpotTrainer, "_resume", lambda *a: reads.append(1) or 0)
    r = _session(0, 1, _free_port(), "b", tmp_path, _cfg(max_steps=4, interval=100), _Stream(), stop=flag)
    assert (r.stop_reason, r.start_step, r.end_step, r.checkpoint_step, r.losses) == ("preempted", 2, 2, 2, ())
    assert reads == [] and 0 <= r.preempt_latency_s < 5.0


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_warm_resume_equals_a_checkpoint_resume(tmp_path, method):
    """Back-to-back sessions in one process resume from memory; the result is the same as
    reading the checkpoint (the cold run clears the process's warm state between sessions), and
    as a warm state prefetched from the checkpoint outside any session (a replica that loaded
    another replica's newer drafter to serve it). EAGLE-3's draft vocabulary is target ids 21..60:
    its map (saved buffers, not parameters) was once lost by a warm resume."""
    from tlt.drafter import resume_state as warm

    results = {}
    target = _target(method)
    init = Drafter(*target)
    if method == "eagle3":
        init.set_vocab_map(torch.arange(21, 61))
    init = init.state_dict()
    for mode in ("warm", "cold", "prefetched"):
        root = tmp_path / mode
        a = _session(0, 1, _free_port(), "a", root, _cfg(max_steps=2, interval=100), _Stream(aux=method == "eagle3"),
                     target=target, init_from=init)
        if mode != "warm":
            STORE.clear()
        if mode == "prefetched":
            cfg = _cfg()
            got = warm.prefetch(STORE, root, *target, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
            assert got is not None and got.step == 2
            assert warm.prefetch(STORE, root, *target, lr=cfg.lr, betas=cfg.betas, weight_decay=0.0) is None  # held
        b = _session(0, 1, _free_port(), "b", root, _cfg(max_steps=4, interval=100),
                     _Stream(start=2, aux=method == "eagle3"), target=target)
        assert (a.warm, b.warm) == (False, mode != "cold") and b.start_step == 2 and b.end_step == 4
        results[mode] = (b.losses, _checkpoint_weights(root, 4, method))
    if method == "eagle3":
        assert results["cold"][1]["d2t"][0] == 21 and int(results["cold"][1]["t2d"].sum()) == 40
    for mode in ("warm", "prefetched"):
        assert results[mode][0] == results["cold"][0], mode
        for k, v in results["cold"][1].items():
            torch.testing.assert_close(results[mode][1][k], v, rtol=0, atol=0, msg=f"{mode} {k}")


def test_warm_state_belongs_to_its_store(tmp_path):
    """Two owners in one process (two replicas' agents, a simulation's workers) keep their own warm
    states: a session resumes from memory only from the store its own owner's sessions filled."""
    target, root = _target("eagle"), tmp_path / "r"
    mine, other = WarmStore(), WarmStore()
    _session(0, 1, _free_port(), "a", root, _cfg(max_steps=2, interval=100), _Stream(), target=target, store=mine)
    b = _session(0, 1, _free_port(), "b", root, _cfg(max_steps=3, interval=100), _Stream(start=2), target=target,
                 store=other)
    c = _session(0, 1, _free_port(), "c", root, _cfg(max_steps=4, interval=100), _Stream(start=3), target=target,
                 store=other)
    assert (b.warm, c.warm) == (False, True) and (b.start_step, c.start_step) == (2, 3)
    assert mine.get(root).step == 2 and other.get(root).step == 4


def _two_from_one(rank, ports, root, out, prefetched):
    """Rank ``rank`` of a 2-rank session resuming a 1-rank checkpoint (read, or prefetched here).
    Prefetched: then a 2-rank session that trains nothing keeps the newer one-rank warm state
    (the replica's step-end prefetch), which fits any next membership; its own shards would not."""
    from tlt.drafter import resume_state as warm

    torch.set_num_threads(1)
    target = _target()
    cfg = _cfg()
    if prefetched:
        assert warm.prefetch(STORE, root, *target, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay).step == 2
    r = _session(rank, 2, ports[0], "two", root, _cfg(max_steps=4, interval=100), _Stream(start=2), target=target)
    assert r.warm == prefetched and (r.start_step, r.end_step) == (2, 4)
    _dump(r, f"{out}/two-{rank}.json")
    if prefetched:
        assert (STORE.get(root).step, STORE.get(root).world_size) == (4, 2)  # this session's shards
        assert warm.prefetch(STORE, root, *target, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay).step == 4
        idle = _session(rank, 2, ports[1], "idle", root, _cfg(max_steps=4, interval=100), _Stream(), target=target)
        assert idle.warm and (idle.start_step, idle.end_step, idle.stop_reason) == (4, 4, "max_steps")
        assert (STORE.get(root).step, STORE.get(root).world_size) == (4, 1)


def test_a_one_rank_warm_state_resumes_a_two_rank_session(tmp_path):
    """Each rank cuts its FSDP2 shard from a one-rank (prefetched) warm state: the 2-rank session
    trains exactly as it does after reading the checkpoint."""
    results = {}
    for mode in ("cold", "prefetched"):
        root = tmp_path / mode
        _session(0, 1, _free_port(), "one", root, _cfg(max_steps=2, interval=100), _Stream())
        _spawn(_two_from_one, 2, _two_ports(), str(root), str(root), mode == "prefetched")
        results[mode] = (_read(root / "two-0.json").losses, _checkpoint_weights(root, 4))
    assert results["prefetched"][0] == results["cold"][0]
    for k, v in results["cold"][1].items():
        torch.testing.assert_close(results["prefetched"][1][k], v, rtol=0, atol=0, msg=k)


def _two_twice(rank, ports, root, out, warm_start):
    """Two back-to-back 2-rank sessions in the same processes: the second resumes this rank's own
    shards from memory (``warm_start``) or, its warm state cleared, from the checkpoint."""
    torch.set_num_threads(1)
    target = _target()
    _session(rank, 2, ports[0], "first", root, _cfg(max_steps=2, interval=100), _Stream(), target=target)
    assert (STORE.get(root).step, STORE.get(root).world_size, STORE.get(root).rank) == (2, 2, rank)
    if not warm_start:
        STORE.clear()
    r = _session(rank, 2, ports[1], "second", root, _cfg(max_steps=4, interval=100), _Stream(start=2),
                 target=target)
    assert r.warm == warm_start and (r.start_step, r.end_step) == (2, 4)
    _dump(r, f"{out}/second-{rank}.json")


def test_a_two_rank_session_resumes_its_own_shards_from_memory(tmp_path):
    """The sharded warm state (loaded as DTensors on the new session's mesh) trains exactly as a
    resume from the checkpoint does."""
    results = {}
    for mode in ("cold", "warm"):
        root = tmp_path / mode
        _spawn(_two_twice, 2, _two_ports(), str(root), str(root), mode == "warm")
        results[mode] = (_read(root / "second-0.json").losses, _checkpoint_weights(root, 4))
    assert results["warm"][0] == results["cold"][0]
    for k, v in results["cold"][1].items():
        torch.testing.assert_close(results["warm"][1][k], v, rtol=0, atol=0, msg=k)


def test_a_session_reports_its_heldout_accept_length(tmp_path):
    """The push guard's reference figure: the greedy-chain accept length of every batch the
    session trained, each scored by the weights before that batch's own update."""
    r = _session(0, 1, _free_port(), "h", tmp_path, _cfg(max_steps=3, interval=100), _Stream())
    cfg = _cfg()
    dcfg, embed, head = _target()
    torch.manual_seed(cfg.seed)
    d = Drafter(dcfg, embed, head)
    opt = torch.optim.AdamW(d.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    ttt, stream, chain, positions = cfg.ttt.for_drafter(d), _Stream(), 0, 0
    for _ in range(3):
        st = ttt_forward(d, pack(stream(0)), ttt)
        chain, positions = chain + st.chain_accept, positions + st.positions
        st.loss(ttt).backward()
        torch.nn.utils.clip_grad_norm_(list(d.parameters()), cfg.grad_clip)
        opt.step()
        opt.zero_grad()
    assert positions > 0 and chain > 0
    assert r.heldout_accept_length == pytest.approx(1.0 + chain / positions, abs=1e-9)


def test_sigkill_loses_at_most_one_interval(tmp_path):
    root = tmp_path / "ckpt"
    _spawn_killed = multiprocessing.get_context("spawn").Process(
        target=_killed, args=(0, _free_port(), str(root), 7))
    _spawn_killed.start()
    _spawn_killed.join(90)
    assert _spawn_killed.exitcode == -signal.SIGKILL
    # 7 steps done, interval 2: step 6 was committed by the writer thread (the loop never waited).
    assert latest(root) == 6 and 7 - latest(root) <= _cfg().interval
    _, ref_w = _reference([1] * 6, _cfg())
    got = _checkpoint_weights(root, 6)
    for k, v in ref_w[5].items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_session_refuses_a_live_process_group(tmp_path, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    dcfg, embed, head = _target()
    t = SpotTrainer(spec=SessionSpec(rank=0, world_size=1, master_port=1, session_id="x"),
                    config=_cfg(), drafter_config=dcfg, embed_weight=embed, head_weight=head,
                    checkpoint_root=tmp_path)
    with pytest.raises(RuntimeError, match="already initialized"):
        t.run(_Stream(), lambda: False)


def test_every_group_of_a_session_times_out_at_timeout_s(tmp_path):
    """The checkpoint writer's group too (torch gives a new group 30 minutes unless told): a peer
    that dies in a save stops the survivor's collective, and its STOP, within ``timeout_s``."""
    import datetime

    import torch.distributed as dist

    dcfg, embed, head = _target()
    t = SpotTrainer(spec=SessionSpec(rank=0, world_size=1, master_port=_free_port(), session_id="g"),
                    config=_cfg(timeout_s=7.0), drafter_config=dcfg, embed_weight=embed, head_weight=head,
                    checkpoint_root=tmp_path)
    group = t._init_group(lambda: False)
    try:
        timeouts = [g._get_backend(torch.device("cpu")).options._timeout for g in (group, dist.group.WORLD)]
    finally:
        dist.destroy_process_group()
    assert timeouts == [datetime.timedelta(seconds=7)] * 2


@pytest.mark.parametrize("field", ["betas"])
def test_frozen_configs(field):
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(_cfg(), field, (0.5, 0.5))


def test_in_process_sessions_stop_on_no_data_and_reform_the_group(tmp_path):
    class _Dries(_Stream):  # the buffer runs dry after 3 batches
        def __call__(self, token_budget):
            return super().__call__(token_budget) if self.i < 3 else []

    r1 = _session(0, 1, _free_port(), "a", tmp_path, _cfg(interval=100), _Dries())
    assert (r1.stop_reason, r1.end_step, r1.checkpoint_step) == ("no_data", 3, 3)
    assert r1.preempt_latency_s is None and len(r1.checkpoint_stall_s) == 1  # the final save only
    # Same process, next session (new group, new port): nothing left to do, nothing rewritten.
    before = (step_dir(tmp_path, 3) / ".metadata").stat().st_mtime_ns
    r2 = _session(0, 1, _free_port(), "b", tmp_path, _cfg(max_steps=3), _Stream())
    assert (r2.stop_reason, r2.start_step, r2.end_step, r2.checkpoint_step) == ("max_steps", 3, 3, 3)
    assert (step_dir(tmp_path, 3) / ".metadata").stat().st_mtime_ns == before
