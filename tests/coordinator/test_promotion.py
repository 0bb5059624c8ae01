"""Promotion rules as pure logic: thresholds, sessions per DP group, stops, lost leaders, ordering."""

from __future__ import annotations

import pytest

from tlt.coordinator.promotion import Promotion, PromotionConfig
from tlt.coordinator.protocol import Promote, ProtocolError, Register, Role, Session, State, Stop, Stopped, WorkerState

B, I, T = WorkerState.BUSY, WorkerState.IDLE, WorkerState.TRAINING


def _merge(d, extra):
    d.sends += extra.sends
    d.results += extra.results
    d.events += extra.events
    return d


class World:
    """The promotion rules plus each worker's seq counter, so tests read like the protocol."""

    def __init__(self, **cfg):
        cfg.setdefault("stop_timeout_s", 5.0)
        self.p = Promotion(PromotionConfig(**cfg))
        self.seq: dict[str, int] = {}
        self.now = 0.0
        self.p.step_begin(0, self.now)  # the driver's first word: nobody is promoted before it

    def tick(self, dt=0.01):
        self.now += dt
        return self.now

    def register(self, wid, group=0, state=B, step=0, rank=0):
        self.seq[wid] = 1
        return _merge(self.p.register(Register(worker_id=wid, dp_group=group, rank=rank, state=state,
                                               step=step, seq=1, address=f"addr-{wid}"), self.tick()),
                      self.p.session_updates())

    def report(self, wid, state, step=0, session=-1):
        self.seq[wid] += 1
        return _merge(self.p.report(wid, State(state=state, step=step, seq=self.seq[wid], session=session),
                                    self.tick()), self.p.session_updates())

    def accept(self, d):
        """Workers accept every PROMOTE in ``d`` (as the client does)."""
        for wid, m in d.sends:
            if isinstance(m, Promote):
                assert m.seq == self.seq[wid]
                self.report(wid, T, m.step, m.session)

    def stopped(self, wid, session, state=B, step=0):
        self.seq[wid] += 1
        return _merge(self.p.stopped(wid, Stopped(session=session, step=step, seq=self.seq[wid], state=state),
                                     self.tick()), self.p.session_updates())

    def state(self, wid):
        return self.p.workers[wid].state

    def three_in_session(self):
        """Workers a, b, c registered and idle; a leads, b and c joined its session."""
        for wid in "abc":
            self.register(wid)
        self.report("a", I)
        self.accept(self.report("b", I))
        self.accept(self.report("c", I))


def promotes(d):
    return {wid: m for wid, m in d.sends if isinstance(m, Promote)}


def sessions(d):
    return {wid: m for wid, m in d.sends if isinstance(m, Session)}


def stops(d):
    return {wid: m for wid, m in d.sends if isinstance(m, Stop)}


def test_config_validation_names_the_field():
    for kw, field in [({"idle_threshold": 0}, "idle_threshold"), ({"stop_timeout_s": 0}, "stop_timeout_s"),
                      ({"max_workers": 0}, "max_workers"), ({"max_workers": 4097}, "max_workers")]:
        with pytest.raises(ValueError, match=field):
            PromotionConfig(**kw)
    with pytest.raises(TypeError):
        PromotionConfig(3)  # keyword-only


def test_threshold_promotes_the_idle_pool_at_once():
    w = World(idle_threshold=3)
    for k in range(4):
        w.register(f"w{k}")
    assert promotes(w.report("w2", I)) == {}
    assert promotes(w.report("w0", I)) == {}
    d = w.report("w1", I)
    got = promotes(d)
    assert set(got) == {"w0", "w1", "w2"}
    assert got["w2"].role is Role.LEADER  # first idle leads
    assert got["w0"].role is got["w1"].role is Role.MEMBER
    assert got["w1"].members == ("w2", "w0", "w1") and got["w0"].leader == "w2"
    assert got["w0"].leader_address == "addr-w2"
    upd = sessions(d)  # one SESSION per member, from the batch's session_updates()
    assert set(upd) == {"w0", "w1", "w2"} and len({(m.epoch, m.members) for m in upd.values()}) == 1
    assert upd["w0"].members == ("w2", "w0", "w1") and upd["w0"].epoch >= 1
    assert all(w.state(x) is T for x in ("w0", "w1", "w2")) and w.state("w3") is B


def test_leader_per_dp_group_and_late_joiner():
    w = World(idle_threshold=2)
    for k in range(6):
        w.register(f"w{k}", group=k % 2)
    w.report("w1", I)
    d = w.report("w0", I)
    got = promotes(d)
    assert got["w1"].role is Role.LEADER and got["w1"].dp_group == 1
    assert got["w0"].role is Role.LEADER and got["w0"].dp_group == 0
    assert got["w0"].session != got["w1"].session
    w.accept(d)
    late = promotes(w.report("w2", I))           # group 0: joins w0's session at once
    assert late["w2"].role is Role.MEMBER and late["w2"].leader == "w0"
    assert late["w2"].session == got["w0"].session


def test_threshold_counts_training_workers():
    """After the first crossing, a lone idle worker of a new group starts its own session at once."""
    w = World(idle_threshold=2)
    for wid, g in [("a", 0), ("b", 0), ("c", 1)]:
        w.register(wid, group=g)
    w.report("a", I)
    w.accept(w.report("b", I))
    got = promotes(w.report("c", I))
    assert got["c"].role is Role.LEADER and got["c"].dp_group == 1


def test_no_promotion_after_rollout_done_for_that_step():
    w = World(idle_threshold=1)
    w.register("a")
    w.p.rollout_done(0, w.tick(), token="t")
    assert promotes(w.report("a", I, step=0)) == {}      # step 0 is over
    w.report("a", B, step=1)
    assert set(promotes(w.report("a", I, step=1))) == {"a"}


def test_register_idle_is_promotable():
    w = World(idle_threshold=1)
    assert set(promotes(w.register("a", state=I))) == {"a"}


def test_rollout_done_stops_all_and_barrier_waits_for_acks():
    w = World(idle_threshold=2)
    for wid, g in [("a", 0), ("b", 0), ("c", 1), ("d", 1)]:
        w.register(wid, group=g)
    for wid in "abc":
        w.accept(w.report(wid, I))
    d = w.p.rollout_done(0, w.tick(), token="drv")
    assert set(stops(d)) == {"a", "b", "c"} and all(m.reason == "rollout_done" for m in stops(d).values())
    assert d.results == []
    sessions = {wid: w.p.workers[wid].session for wid in "abc"}
    assert w.stopped("a", sessions["a"]).results == []
    assert w.stopped("c", sessions["c"]).results == []
    r = w.stopped("b", sessions["b"], state=B).results
    assert len(r) == 1 and r[0].token == "drv" and set(r[0].stopped) == {"a", "b", "c"}
    assert r[0].timed_out == () and r[0].lost == ()
    assert all(w.state(x) is B for x in "abcd")
    assert w.p.sessions == {}


def test_rollout_done_with_nobody_training_answers_at_once():
    w = World()
    w.register("a")
    d = w.p.rollout_done(3, w.tick(), token=1)
    assert len(d.results) == 1 and d.results[0].step == 3 and d.results[0].stopped == ()


def test_stop_deadline_marks_lost_and_finishes_barrier():
    w = World(idle_threshold=2, stop_timeout_s=1.0)
    w.register("a")
    w.register("b")
    w.report("a", I)
    w.accept(w.report("b", I))
    w.p.rollout_done(0, w.tick(), token="drv", deadline_s=0.5)   # driver's deadline is tighter
    w.stopped("a", w.p.workers["a"].session)
    assert w.p.tick(w.now + 0.4).results == []
    d = w.p.tick(w.now + 0.6)
    assert [e.worker_id for e in d.events if e.kind == "lost"] == ["b"]
    assert d.results[0].stopped == ("a",) and d.results[0].timed_out == ("b",)
    assert "b" not in w.p.workers and w.p.next_deadline() is None


def test_lost_during_barrier_is_reported_as_lost():
    w = World(idle_threshold=1)
    w.register("a")
    w.accept(w.report("a", I))
    w.p.rollout_done(0, w.tick(), token="drv")
    d = w.p.lose("a", "heartbeat", w.tick())
    assert d.results[0].lost == ("a",) and d.results[0].stopped == ()


def test_lost_leader_ends_session_and_members_regroup_under_a_new_leader():
    w = World(idle_threshold=2)
    w.three_in_session()
    sid = w.p.workers["a"].session
    d = w.p.lose("a", "heartbeat", w.tick())
    assert set(stops(d)) == {"b", "c"} and stops(d)["b"].reason == "leader_lost"
    assert promotes(w.stopped("b", sid, state=I)) == {}     # c still stopping: only b is free... 
    got = promotes(w.stopped("c", sid, state=I))            # ...now b and c are free: threshold met
    assert got["b"].role is Role.LEADER and got["b"].session != sid
    assert got["c"].role is Role.MEMBER and got["c"].leader == "b"


def test_session_updates_are_coalesced():
    """Several joins between two session_updates() calls cost each member one SESSION message,
    with a new epoch; nothing is sent when nothing changed."""
    w = World(idle_threshold=1)
    for wid in "abcd":
        w.register(wid)
    d = w.report("a", I)
    w.accept(d)
    first = sessions(d)
    assert list(first) == ["a"] and first["a"].members == ("a",)
    for wid in "bcd":
        w.seq[wid] += 1
        w.p.report(wid, State(state=I, step=0, seq=w.seq[wid]), w.tick())
    d = w.p.session_updates()
    assert [(wid, m.members) for wid, m in d.sends] == [(x, ("a", "b", "c", "d")) for x in "abcd"]
    assert {m.epoch for _, m in d.sends} == {first["a"].epoch + 1}
    assert w.p.session_updates().sends == []


def test_epochs_are_unique_across_sessions():
    """Every SESSION of every group gets a new, larger epoch (trainers derive rendezvous ports)."""
    w = World(idle_threshold=1)
    for k in range(4):
        w.register(f"w{k}", group=k % 2)
    epochs = []
    for wid in ("w0", "w1", "w2", "w3"):  # two groups, a session each, then a joiner each
        d = w.report(wid, I)
        w.accept(d)
        epochs += sorted({m.epoch for m in sessions(d).values()})
    assert epochs == sorted(set(epochs)) and len(epochs) == 4


def test_lost_member_updates_every_member():
    w = World(idle_threshold=2)
    w.three_in_session()
    w.p.session_updates()
    d = _merge(w.p.lose("c", "heartbeat", w.tick()), w.p.session_updates())
    assert [(wid, m.members) for wid, m in d.sends if isinstance(m, Session)] == [
        ("a", ("a", "b")), ("b", ("a", "b"))]
    assert stops(d) == {}


def test_decline_race_and_repromotion():
    """A worker reports BUSY before it saw its PROMOTE: it leaves the session, nothing is stuck."""
    w = World(idle_threshold=2)
    for wid in "abc":
        w.register(wid)
    w.report("a", I)
    d = w.report("b", I)
    assert set(promotes(d)) == {"a", "b"}
    w.report("a", T, session=promotes(d)["a"].session)     # a (leader) accepts
    w.report("b", B)                                        # b declines (raced)
    assert w.state("b") is B and w.p.sessions[promotes(d)["a"].session].members == ["a"]
    d2 = promotes(w.report("b", I))                         # b idle again: joins a's session
    assert d2["b"].session == promotes(d)["a"].session and d2["b"].seq == w.seq["b"]


def test_stale_accept_is_out_of_order():
    w = World(idle_threshold=1)
    w.register("a")
    sid = promotes(w.report("a", I))["a"].session
    w.report("a", B)                                        # declined (raced)
    with pytest.raises(ProtocolError, match="out_of_order"):
        w.report("a", T, session=sid)                       # a buggy client accepting anyway


@pytest.mark.parametrize("case", ["stopped_unknown_session", "stopped_while_busy", "busy_while_training",
                                  "accept_twice", "seq_not_increasing", "unknown_worker"])
def test_out_of_order_raises_and_changes_nothing(case):
    w = World(idle_threshold=1)
    w.register("a")
    w.register("b")
    sid = promotes(w.report("a", I))["a"].session
    w.report("a", T, session=sid)
    before = (w.p.snapshot(), {k: v.members[:] for k, v in w.p.sessions.items()})
    with pytest.raises(ProtocolError) as e:
        if case == "stopped_unknown_session":
            w.stopped("a", sid + 99)
        elif case == "stopped_while_busy":
            w.stopped("b", sid)
        elif case == "busy_while_training":
            w.report("a", B)
        elif case == "accept_twice":
            w.report("a", T, session=sid)
        elif case == "seq_not_increasing":
            w.p.report("b", State(state=I, step=0, seq=1), w.tick())
        else:
            w.p.report("zz", State(state=I, step=0, seq=5), w.tick())
    assert e.value.kind == "out_of_order"
    assert (w.p.snapshot(), {k: v.members[:] for k, v in w.p.sessions.items()}) == before


def test_reregister_replaces_the_old_incarnation():
    w = World(idle_threshold=1)
    w.register("a")
    w.register("b")
    sid = promotes(w.report("a", I))["a"].session
    w.report("a", T, session=sid)
    d = w.register("a", state=B)
    assert [e.detail["reason"] for e in d.events if e.kind == "lost"] == ["reregistered"]
    assert w.state("a") is B and w.p.sessions == {}


def test_max_workers_refused():
    w = World(max_workers=2)
    w.register("a")
    w.register("b")
    with pytest.raises(ProtocolError, match="refused"):
        w.register("c")
    w.register("a")  # re-registering a known id is always allowed


def test_step_begin_closes_earlier_rollouts():
    """A restarted coordinator knows nothing of step 0; STEP_BEGIN 1 tells it step 0's rollout is
    over, so workers re-registering as IDLE in step 0 are not promoted into a finished rollout."""
    w = World(idle_threshold=2)
    w.p.step_begin(1, w.tick())
    for wid in "ab":
        w.register(wid, state=I, step=0)
    assert w.state("a") is I and w.state("b") is I
    w.report("a", I, step=1)
    assert set(promotes(w.report("b", I, step=1))) == {"a", "b"}


def test_workers_idle_before_the_drivers_first_word_are_promoted_when_it_comes():
    """Nobody is promoted before the driver's first STEP_BEGIN (a restarted coordinator does not
    know whether the step's rollout is over); workers that reported IDLE before it are promoted by
    the STEP_BEGIN itself, not left waiting for a report they may never send."""
    w = World(idle_threshold=2)
    w.p = Promotion(PromotionConfig(idle_threshold=2, stop_timeout_s=5.0))  # no driver word yet
    for wid in "ab":
        w.register(wid, state=I, step=1)
    assert w.state("a") is I and w.state("b") is I  # not before the driver speaks
    d = w.p.step_begin(1, w.tick())
    assert set(promotes(d)) == {"a", "b"} and w.state("a") is T
    w2 = World(idle_threshold=2)
    w2.p = Promotion(PromotionConfig(idle_threshold=2, stop_timeout_s=5.0))
    for wid in "ab":
        w2.register(wid, state=I, step=0)
    assert promotes(w2.p.step_begin(1, w2.tick())) == {}  # IDLE in a rollout step 1's start closed
