"""Abortable rendezvous: all ranks build on the store or none does; a stop, a missing rank, a taken
port and a stale store from an earlier session all end it in bounded time. Real TCPStores on
127.0.0.1, one thread per rank."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tlt.drafter.rendezvous import RendezvousAborted, rendezvous


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(port, world, delays, should_stop=lambda: False, session="s1e1", timeout_s=10.0):
    out: dict[int, object] = {}

    def go(rank: int, delay: float) -> None:
        time.sleep(delay)
        try:
            out[rank] = rendezvous("127.0.0.1", port, rank, world, session_id=session, timeout_s=timeout_s,
                                   store_timeout_s=30, should_stop=should_stop)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out[rank] = e

    ts = [threading.Thread(target=go, args=(r, d), daemon=True) for r, d in delays.items()]
    for t in ts:
        t.start()
    return ts, out


def test_staggered_arrival_all_go_and_share_the_store():
    port = _port()
    ts, out = _ranks(port, 3, {1: 0.0, 2: 0.3, 0: 0.8})  # clients first: they wait for rank 0
    for t in ts:
        t.join(20)
    assert all(not isinstance(v, Exception) for v in out.values()), out
    out[2].set("k", "v")
    assert out[0].get("k") == b"v"


def test_stop_aborts_every_waiting_rank_quickly():
    port, stop = _port(), threading.Event()
    ts, out = _ranks(port, 3, {0: 0.0, 1: 0.1}, should_stop=stop.is_set)  # rank 2 never comes
    time.sleep(0.6)
    t = time.monotonic()
    stop.set()
    for th in ts:
        th.join(10)
    assert time.monotonic() - t < 3.0
    assert all(isinstance(v, RendezvousAborted) for v in out.values()), out


def test_missing_rank_times_out_with_the_count():
    ts, out = _ranks(_port(), 2, {0: 0.0}, timeout_s=1.0)
    ts[0].join(10)
    assert isinstance(out[0], TimeoutError) and "1 of 2" in str(out[0])


def test_taken_port_is_a_clear_error_for_rank_0():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(RuntimeError, match="cannot host"):
            rendezvous("127.0.0.1", s.getsockname()[1], 0, 2, session_id="x", timeout_s=1,
                       store_timeout_s=5, should_stop=lambda: False)


def test_stale_store_of_another_session_is_never_a_go():
    """Session A (1 rank) went ahead on this port and its store is still up; a rank of session B
    reaching that store must not read A's decision: it times out instead of joining a dead group."""
    port = _port()
    stale = rendezvous("127.0.0.1", port, 0, 1, session_id="s1e1", timeout_s=5, store_timeout_s=5,
                       should_stop=lambda: False)
    ts, out = _ranks(port, 2, {1: 0.0}, session="s1e2", timeout_s=1.0)
    ts[0].join(10)
    assert isinstance(out[1], TimeoutError), out
    del stale


def test_spot_trainer_stopped_before_its_peers_arrive_returns_at_once(tmp_path):
    """A spot session whose other rank never comes: a preemption during the rendezvous ends it with
    no steps and nothing written, within a second, instead of after the rendezvous timeout."""
    from tlt.drafter.spot import PreemptFlag, SessionSpec, SpotConfig, SpotTrainer

    from .test_spot import _target

    dcfg, embed, head = _target()
    flag = PreemptFlag()
    threading.Timer(0.5, flag.set).start()
    t = time.monotonic()
    res = SpotTrainer(spec=SessionSpec(rank=0, world_size=2, master_port=_port(), session_id="s1e9"),
                      config=SpotConfig(rendezvous_timeout_s=60), drafter_config=dcfg, embed_weight=embed,
                      head_weight=head, checkpoint_root=tmp_path).run(lambda budget: [], flag)
    assert time.monotonic() - t < 3.0
    assert res.stop_reason == "preempted" and res.steps == 0 and res.checkpoint_step is None
    assert res.preempt_latency_s is not None and res.preempt_latency_s < 2.0
    assert not any(tmp_path.iterdir())


def test_a_rank_that_times_out_aborts_it_for_everyone():
    """Rank 1 gives up (its deadline is shorter); rank 0, still within its own, must not wait for a
    'go' that can no longer come, nor could a late arrival build a group rank 1 has left. Both fail
    with the timeout: rank 0 was not stopped (a stop is a preemption, not a failure)."""
    port = _port()
    out: dict[int, object] = {}

    def go(rank: int, timeout_s: float) -> None:
        try:
            out[rank] = rendezvous("127.0.0.1", port, rank, 3, session_id="s", timeout_s=timeout_s,
                                   store_timeout_s=30, should_stop=lambda: False)
        except Exception as e:  # noqa: BLE001
            out[rank] = e

    ts = [threading.Thread(target=go, args=a, daemon=True) for a in ((0, 20.0), (1, 0.5))]
    t = time.monotonic()
    for th in ts:
        th.start()
    for th in ts:
        th.join(15)
    assert isinstance(out[1], TimeoutError) and "2 of 3" in str(out[1]), out
    assert isinstance(out[0], TimeoutError) and "another rank's wait" in str(out[0]), out
    assert time.monotonic() - t < 5


def test_rank_0_reuses_the_store_it_hosts_on_the_same_port():
    """A later session landing on the port of this process's last store (which torch may keep
    alive) reuses it instead of failing to bind; the sessions' keys do not mix."""
    port = _port()
    first = rendezvous("127.0.0.1", port, 0, 1, session_id="a", timeout_s=5, store_timeout_s=5,
                       should_stop=lambda: False)
    second = rendezvous("127.0.0.1", port, 0, 1, session_id="b", timeout_s=5, store_timeout_s=5,
                        should_stop=lambda: False)
    first.set("k", "a")
    assert not second.check(["k"])
