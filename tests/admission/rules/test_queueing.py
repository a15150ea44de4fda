"""The queues inside the org's decision (admission/rules/queueing.py), as Kueue keeps them: what
a blocked job holds, who waits behind whom, and the order the decision weighs the queues' heads."""

from __future__ import annotations

from prefect_gpu_budget.admission.rules import queueing
from prefect_gpu_budget.admission.rules.quota import Placed, TeamQuota, proportional
from prefect_gpu_budget.admission.rules.requests import Request
from tests.admission.rules.pools import capacity, job, pool


def _req(job_id: str, scope: str, at: float, priority: int = 0, shape=None) -> Request:
    return Request(job_id, scope, 3_600_000, 360, 60.0, None, priority, at, shape=shape)


def test_a_blocked_job_holds_what_its_pools_and_teams_settings_say():
    plain, backfilled = pool(), pool(backfill=True)
    strict = TeamQuota("lab-a", "acme/a", proportional(plain, 8), queueing="strict_fifo")
    lenient = TeamQuota("lab-a", "acme/a", proportional(plain, 8))
    assert queueing.blocks(plain, None, within=False) == ("pool:lab-a",)
    assert queueing.blocks(backfilled, None, within=False) == ()
    assert queueing.blocks(plain, strict, within=False) == ("team:lab-a:acme/a",)
    assert queueing.blocks(plain, lenient, within=True) == ("borrow:lab-a",)  # nominal first
    assert queueing.blocks(backfilled, lenient, within=True) == ()


def test_a_budget_holds_only_its_own_teams_queue():
    key = queueing.scope_key("acme", "acme/vision/agent-7")
    assert key == "acme@acme/vision" and queueing.block_name(key) == "acme"
    held = {key: _req("head", "acme/vision/agent-7", 1.0)}
    same_team = _req("later", "acme/vision/agent-9", 2.0)
    other_team = _req("other", "acme/nlp/agent-1", 2.0)
    assert queueing.ahead(same_team, None, held, None) == (key, held[key])
    assert queueing.ahead(other_team, None, held, None) is None  # its ClusterQueue is its own
    assert not queueing.all_blocked(["acme/vision", "acme/nlp"], held)
    held[queueing.scope_key("acme", "acme/nlp/x")] = other_team
    assert queueing.all_blocked(["acme/vision", "acme/nlp"], held)


def test_borrowing_waits_behind_a_job_within_its_quota_and_a_job_within_its_own_does_not():
    lab = pool(nodes=2)
    a = TeamQuota("lab-a", "acme/a", proportional(lab, 8))
    b = TeamQuota("lab-a", "acme/b", proportional(lab, 8), borrow_pct=100)
    cap = capacity(lab, [a, b])
    held = {"borrow:lab-a": _req("a-head", "acme/a/s", 1.0, shape=job("acme/a", 8, 2))}
    within = job("acme/b", 8)  # its own nominal quota: it goes on
    borrower = job("acme/b", 16)  # more than its quota: it would borrow
    assert queueing.ahead(_req("b1", "acme/b/s", 2.0, shape=within), within, held, cap) is None
    found = queueing.ahead(_req("b2", "acme/b/s", 2.0, shape=borrower), borrower, held, cap)
    assert found is not None and found[0] == "borrow:lab-a"


def test_heads_within_their_quota_go_before_borrowers_then_by_priority():
    lab = pool(nodes=2)
    a = TeamQuota("lab-a", "acme/a", proportional(lab, 8), borrow_pct=100)
    b = TeamQuota("lab-a", "acme/b", proportional(lab, 8), borrow_pct=100)
    cap = capacity(lab, [a, b], [Placed("a0", job("acme/a", 8), (0,), 0, 0.0)])
    ordered = [  # priority then arrival, as the policy orders a queue
        _req("a1", "acme/a/s", 1.0, priority=5, shape=job("acme/a", 8)),  # would borrow
        _req("b1", "acme/b/s", 2.0, priority=0, shape=job("acme/b", 8)),  # within its quota
    ]
    assert [r.job_id for r in queueing.walk(ordered, cap)] == ["b1", "a1"]
    assert [r.job_id for r in queueing.walk(ordered, None)] == ["a1", "b1"]  # no pools: as is


def test_a_hold_is_named_for_people():
    assert queueing.describe("pool:lab-a") == "pool lab-a"
    assert (
        queueing.describe("team:lab-a:acme/a")
        == "the queue of team acme/a in pool lab-a (strict FIFO)"
    )
    assert queueing.describe("acme@acme/vision") == "acme"
