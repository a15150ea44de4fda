"""Who is asked to stop so that a waiting job in a pool can start (admission/rules/preemption.py):
reclaiming lent capacity, a team's own lower-priority work, its settings, the order of victims,
as Kueue and HyperPod task governance do it."""

from __future__ import annotations

from prefect_gpu_budget.admission.rules import preemption
from prefect_gpu_budget.admission.rules.quota import TeamQuota, proportional
from tests.admission.rules.pools import admit as _admit
from tests.admission.rules.pools import capacity as _capacity
from tests.admission.rules.pools import job as _job
from tests.admission.rules.pools import pool as _pool


def test_reclaiming_lent_capacity_picks_the_lowest_priority_newest_borrowed_job():
    pool = _pool(nodes=2)
    quotas = [
        TeamQuota("lab-a", "acme/a", proportional(pool, 8)),
        TeamQuota("lab-a", "acme/b", proportional(pool, 8), borrow_pct=100, within_team="never"),
    ]
    cap = _capacity(pool, quotas)
    for i, (priority, at) in enumerate([(0, 1.0), (0, 2.0), (-100, 3.0), (-100, 4.0)]):
        assert _admit(cap, f"b{i}", _job("acme/b", 4), priority, at)
    # b now uses all 16: its own 8 and a's 8, lent while a was idle
    fit = preemption.fit(cap, _job("acme/a", 4), priority=100)
    assert not fit.ok and fit.victims == ("b3",)  # low priority, most recently admitted
    assert "preempting b3 (acme/b, borrowing, priority -100)" in fit.reason
    fit = preemption.fit(cap, _job("acme/a", 8), priority=100)
    assert set(fit.victims) == {"b2", "b3"}
    # reclaim: any (HyperPod's default): lent capacity comes back whatever the borrower's priority
    assert preemption.fit(cap, _job("acme/a", 4), priority=-500).victims == ("b3",)
    assert set(preemption.fit(cap, _job("acme/a", 8), priority=-500).victims) == {"b2", "b3"}
    assert (
        preemption.fit(cap, _job("acme/b", 4), priority=100).victims == ()
    )  # b is over its own quota


def test_reclaim_follows_the_lending_teams_setting():
    pool = _pool(nodes=2)
    b = TeamQuota("lab-a", "acme/b", proportional(pool, 8), borrow_pct=100)
    for reclaim, victims in (("any", ("b1",)), ("lower_priority", ()), ("never", ())):
        a = TeamQuota("lab-a", "acme/a", proportional(pool, 8), reclaim=reclaim)
        cap = _capacity(pool, [a, b])
        assert _admit(cap, "b0", _job("acme/b", 8), 0, 1.0)
        assert _admit(cap, "b1", _job("acme/b", 8), 0, 2.0)  # a's 8, lent
        fit = preemption.fit(
            cap, _job("acme/a", 8), priority=0
        )  # the same priority as the borrower
        assert not fit.ok and fit.victims == victims, reclaim
        assert fit.reason.startswith("waiting for 1 x 8 H100 in pool lab-a: 0 nodes free")
        if reclaim != "any":
            assert f"(reclaim: {reclaim})" in fit.reason
        lower = preemption.fit(cap, _job("acme/a", 8), priority=100).victims
        assert lower == (() if reclaim == "never" else ("b1",))


def test_a_team_preempts_its_own_lower_priority_work_unless_it_says_never():
    """HyperPod's PreemptTeamTasks (default LowerPriority): a team's quota full of its own low
    job does not keep its high job waiting; never the other way round, never another team's
    work within that team's quota."""
    pool = _pool(nodes=2)
    b = TeamQuota("lab-a", "acme/b", proportional(pool, 8))
    for within, victims in (("lower_priority", ("lo",)), ("never", ())):
        a = TeamQuota("lab-a", "acme/a", proportional(pool, 8), borrow_pct=0, within_team=within)
        cap = _capacity(pool, [a, b])
        assert _admit(cap, "lo", _job("acme/a", 8), -100, 1.0)
        assert _admit(cap, "b-own", _job("acme/b", 8), -500, 2.0)
        fit = preemption.fit(cap, _job("acme/a", 8), priority=100)
        assert not fit.ok and fit.victims == victims, within
        assert fit.reason.startswith(
            "team acme/a uses 8 H100 of its quota 8 H100 (+0% borrow limit) in pool lab-a; "
            "this job needs 8 H100"
        )
        if victims:
            assert "preempting lo (acme/a, lower priority, priority -100)" in fit.reason
        else:
            assert "(within_team: never)" in fit.reason
        assert preemption.fit(cap, _job("acme/a", 8), priority=-100).victims == ()  # equal: never


def test_a_team_may_preempt_its_own_work_and_borrow_at_once_as_kueue_does():
    """HyperPod's walkthrough: team B's 2-node job at a higher priority suspends B's own 1-node
    job and borrows A's idle node; a preempted borrower could not preempt it back."""
    pool = _pool(nodes=2)
    a = TeamQuota("lab-a", "acme/a", proportional(pool, 8))
    b = TeamQuota("lab-a", "acme/b", proportional(pool, 8), borrow_pct=100)
    cap = _capacity(pool, [a, b])
    assert _admit(cap, "b-train", _job("acme/b", 8), 0, 1.0)
    assert _admit(cap, "a-job", _job("acme/a", 8), 0, 2.0)
    assert (
        preemption.fit(cap, _job("acme/b", 8, nodes=2), 100).victims == ()
    )  # a runs within its quota
    cap.placed = [p for p in cap.placed if p.job_id != "a-job"]  # a's job ended: a's node idle
    assert preemption.fit(cap, _job("acme/b", 8, nodes=2), 100).victims == ("b-train",)
    assert preemption.fit(cap, _job("acme/b", 8, nodes=2), 0).victims == ()  # not lower: nothing


def test_victims_already_stopping_go_first():
    from dataclasses import replace

    pool = _pool(nodes=2)
    quotas = [
        TeamQuota("lab-a", "acme/a", proportional(pool, 8)),
        TeamQuota("lab-a", "acme/b", proportional(pool, 8), borrow_pct=100),
    ]
    cap = _capacity(pool, quotas)
    for i in range(4):
        assert _admit(cap, f"b{i}", _job("acme/b", 4), 0, float(i))
    assert preemption.fit(cap, _job("acme/a", 4), 0).victims == ("b3",)
    cap.placed = [replace(p, stopping=p.job_id == "b2") for p in cap.placed]
    assert preemption.fit(cap, _job("acme/a", 4), 0).victims == (
        "b2",
    )  # asked once: no second victim
