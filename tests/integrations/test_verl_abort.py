"""verl's abort and resume on the ``tlt`` backend, through a real Ray actor of ``TLTServer``.

``abort_all_requests`` returns every running request's partial output (``aborted``); a request that
arrives before ``resume_generation`` waits for it (with ``reject_request`` it returns at once, aborted
and empty); verl's partial rollout resubmits an aborted request as prompt + partial output under a
new request id (verl's client sends one per call), and the replica goes on from the request's state:
the tokens equal an uninterrupted run's (same seeds, coupled sampling), a request whose seed came
from its first id included. A request that arrives while others decode joins them.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'tlt-rollout[verl]')")
ray = pytest.importorskip("ray")

from tlt.demo import job as demo  # noqa: E402
from tlt.integrations.verl.config import TLTConfig  # noqa: E402
from tlt.integrations.verl.server import TLTServer, server_name  # noqa: E402

pytestmark = pytest.mark.slow
N = 6


def _sampling(i: int, max_tokens: int = 160) -> dict:
    return {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": max_tokens, "logprobs": True,
            "seed": 1000 + i}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tlt.demo.target_factory import ensure_target

    tmp = tmp_path_factory.mktemp("abort")
    model = str(ensure_target(demo.QUICK.target, progress=False))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="tlt-abort-test")
    tlt = TLTConfig.from_mapping({"coordinator": {"enable": False}, "engine": {"max_batch": 8}}).to_dict()
    s = ray.remote(TLTServer).options(name=server_name(0), max_concurrency=32, num_cpus=0).remote(
        model_path=model, replica_rank=0, tlt=tlt, prompt_length=16, response_length=160, coordinator=None,
        spot_root=str(tmp / "spot"), run_dir=str(tmp), seed=1)
    yield s
    ray.shutdown()


def _prompt(i: int) -> list[int]:
    return [1, 5 + i, 7, 9, 11 + i]


def _wait_running(s, timeout_s: float = 120) -> None:
    t0 = time.monotonic()
    while ray.get(s.step_stats.remote())["running"] == 0:
        assert time.monotonic() - t0 < timeout_s
        time.sleep(0.005)


def test_abort_returns_partials_holds_arrivals_and_resumes_token_for_token(server):
    s = server
    ref = ray.get([s.generate.remote(f"ref{i}", _prompt(i), _sampling(i)) for i in range(N)], timeout=300)
    assert all(o.stop_reason in ("completed", "length") for o in ref)

    calls = [s.generate.remote(f"r{i}", _prompt(i), _sampling(i)) for i in range(N)]
    _wait_running(s)
    time.sleep(0.05)
    aborted = ray.get(s.abort_all_requests.remote(), timeout=120)
    outs = ray.get(calls, timeout=120)
    assert aborted["aborted_count"] >= 1 and len(aborted["request_ids"]) == aborted["aborted_count"]
    held = s.generate.remote("late", _prompt(0), _sampling(0))  # behind the closed gate: waits
    assert not ray.wait([held], timeout=0.5)[0]
    cut = [i for i, o in enumerate(outs) if o.stop_reason == "aborted"]
    assert sorted(f"r{i}" for i in cut) == sorted(aborted["request_ids"])
    for i, o in enumerate(outs):  # each: a prefix of the uninterrupted run's, or all of it
        assert o.token_ids == ref[i].token_ids[:len(o.token_ids)] and len(o.log_probs) == len(o.token_ids)
    ray.get(s.resume_generation.remote())
    assert ray.get(held, timeout=120).token_ids == ref[0].token_ids

    # verl's partial rollout: prompt + partial output, a new request id, the budget left
    again = ray.get([s.generate.remote(f"r{i}-again", _prompt(i) + outs[i].token_ids,
                                       _sampling(i, 160 - len(outs[i].token_ids))) for i in cut], timeout=300)
    for i, o in zip(cut, again):
        assert outs[i].token_ids + o.token_ids == ref[i].token_ids
        assert o.stop_reason == ref[i].stop_reason
    st = ray.get(s.step_stats.remote())
    assert st["engine_lifecycle"].get("aborted", 0) == len(cut) and st["running"] == 0

    ray.get(s.abort_all_requests.remote(reject_request=True))
    rejected = ray.get(s.generate.remote("x", _prompt(1), _sampling(1)), timeout=30)
    assert rejected.stop_reason == "aborted" and rejected.token_ids == []
    ray.get(s.resume_generation.remote())


def test_a_request_arriving_mid_generation_joins_it(server):
    s = server
    ref = ray.get(s.generate.remote("solo", _prompt(3), _sampling(3, 40)), timeout=120)
    joined = ray.get(s.step_stats.remote())["engine_lifecycle"].get("joined", 0)
    long = [s.generate.remote(f"long{i}", _prompt(i), _sampling(i)) for i in range(2)]
    _wait_running(s)
    late = ray.get(s.generate.remote("solo2", _prompt(3), _sampling(3, 40)), timeout=120)
    assert late.token_ids == ref.token_ids  # same seed and prompt, decoded beside others
    done = ray.wait(long, num_returns=2, timeout=0)[0]
    assert len(done) < 2  # the late request finished while the long ones still ran: it joined them
    ray.get(long, timeout=300)
    assert ray.get(s.step_stats.remote())["engine_lifecycle"].get("joined", 0) > joined


def test_a_request_without_a_seed_keeps_one_per_request_id(server):
    s = server
    unseeded = {k: v for k, v in _sampling(0, 24).items() if k != "seed"}
    a, b, c = ray.get([s.generate.remote(rid, _prompt(0), unseeded) for rid in ("u1", "u1", "u2")], timeout=120)
    assert a.token_ids == b.token_ids  # a retry under the same request id samples the same tokens
    assert a.token_ids != c.token_ids


def test_an_unseeded_request_resumes_its_own_seed_under_a_new_request_id(server):
    """No seed from the agent loop: the seed comes from the first request id, and the resubmission
    (a new id, as verl's client sends it) goes on with it: token for token the uninterrupted run."""
    s = server
    unseeded = {k: v for k, v in _sampling(4).items() if k != "seed"}
    ids = [f"u{k}" for k in range(4)]
    refs = dict(zip(ids, ray.get([s.generate.remote(r, _prompt(4), unseeded) for r in ids], timeout=300)))
    rid = max(ids, key=lambda r: len(refs[r].token_ids))  # the longest run: the most time to abort it
    ref = refs[rid]
    for _ in range(5):  # the abort races the request's end: a request that finished first is retried
        call = s.generate.remote(rid, _prompt(4), unseeded)
        _wait_running(s)
        ray.get(s.abort_all_requests.remote(), timeout=120)
        part = ray.get(call, timeout=120)
        ray.get(s.resume_generation.remote())
        if part.stop_reason == "aborted" and 0 < len(part.token_ids) < len(ref.token_ids):
            break
        assert ref.token_ids[:len(part.token_ids)] == part.token_ids
    else:
        pytest.fail(f"no abort caught {rid} mid-generation in 5 tries ({len(ref.token_ids)} tokens)")
    # the same tokens under other settings: a new request, not this one's resume (greedy, twice alike)
    greedy = {**unseeded, "temperature": 0.0, "max_tokens": 160 - len(part.token_ids)}
    g1, g2 = (ray.get(s.generate.remote(f"{rid}-greedy{k}", _prompt(4) + part.token_ids, greedy), timeout=300)
              for k in (1, 2))
    assert g1.token_ids == g2.token_ids
    rest = {**unseeded, "max_tokens": 160 - len(part.token_ids)}
    again = ray.get(s.generate.remote(f"{rid}-again", _prompt(4) + part.token_ids, rest), timeout=300)
    assert part.token_ids + again.token_ids == ref.token_ids
