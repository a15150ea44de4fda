"""Governance as Kueue and HyperPod document it (promise 12), through the ledger on SQLite and
PostgreSQL: lent capacity is reclaimed from a borrower of any priority, by victims that free a
placement and come from the highest fair share first; a team preempts its own lower-priority
work; a team's waiting job holds only its own team, for machines or money; jobs within nominal
quota go before borrowers, which go by fair share before priority; a team borrows 50% by
default; and every reason names the resource that binds, and a preemption only when asked."""

from __future__ import annotations

import sys
import time

import pytest

from prefect_gpu_budget.admission.ledger import NewJob
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.admission.rules.quota import Pool, TeamQuota, proportional, team_setting
from prefect_gpu_budget.units import BudgetInputError
from tests.support.jobs import new_job

NODE = (8, 192, 2048)


def _pool(nodes: int, **kw) -> Pool:
    return Pool("acme", "lab-a", nodes, NODE, ("local:h100x8",), "H100", **kw)


def _job(scope: str, nodes: int = 1, gpus: int = 8, priority: int = 0, **kw) -> NewJob:
    return new_job(
        scope,
        **{
            "name": f"{nodes}x{gpus}",
            "instance_type": "local:h100x8",
            "nodes": nodes,
            "rate_micro_per_hour": 1_000_000,
            "rate_cents": 100,
            "priority": priority,
            "node_gpus": gpus,
            **kw,
        },
    )


def _done(ledger, job_id: str, outcome: str = "completed") -> None:
    ledger.settlements.settle(
        job_id, ended_at=time.time(), outcome=outcome, scope=ledger.views.job(job_id)["scope"]
    )


def _state(ledger, job_id: str) -> str:
    return ledger.views.job(job_id)["state"]


@pytest.mark.parametrize("reclaim", ["any", "lower_priority", "never"])
def test_a_lender_reclaims_from_a_borrower_of_equal_priority_by_default(ledger, reclaim):
    """HyperPod's walkthrough: team B's job within B's quota suspends team A's job that
    borrowed B's idle node at the same priority (Kueue's `reclaimWithinCohort: Any`)."""
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    pool = _pool(2)
    ledger.config.set_pool(
        pool,
        [
            TeamQuota("lab-a", "acme/a", proportional(pool, 8), borrow_pct=100),
            TeamQuota("lab-a", "acme/b", proportional(pool, 8), reclaim=reclaim),
        ],
    )
    a_own, first = ledger.queue.request(_job("acme/a/s"))
    a_borrowed, second = ledger.queue.request(_job("acme/a/s"))  # B's idle node, lent
    assert first.verdict == second.verdict == "admit"
    b_own, waits = ledger.queue.request(_job("acme/b/s"))  # the same priority as A's
    assert waits.verdict == "wait"
    assert waits.reason.startswith("waiting for 1 x 8 H100 in pool lab-a: 0 nodes free")
    if reclaim != "any":
        assert not waits.preempt and ledger.views.job(a_borrowed)["preempt_at"] is None
        assert f"(reclaim: {reclaim})" in waits.reason
        ledger.queue.cancel_queued(b_own, "acme/b/s", "test over")
        for job_id in (a_own, a_borrowed):
            _done(ledger, job_id)
        return
    assert waits.preempt == (a_borrowed,)  # only the borrowed job: A keeps its own quota
    assert f"preempting {a_borrowed[:8]} (acme/a, borrowing, priority 0)" in waits.reason
    assert ledger.views.job(a_borrowed)["preempt_at"] is not None
    assert ledger.views.job(a_own)["preempt_at"] is None
    assert ledger.views.stop_asked(a_borrowed) == "preempted"
    again, requeued = ledger.queue.request(_job("acme/a/s"))  # a requeued borrower cannot take it
    assert requeued.verdict == "wait" and not requeued.preempt
    _done(ledger, a_borrowed, "preempted")  # its holder stopped it
    assert _state(ledger, b_own) == "admitted"  # the node freed went to B, not to A's again
    assert _state(ledger, again) == "queued"
    ledger.queue.cancel_queued(again, "acme/a/s", "test over")
    for job_id in (a_own, b_own):
        _done(ledger, job_id)


@pytest.mark.parametrize("within_team", ["lower_priority", "never"])
def test_a_teams_high_priority_job_preempts_its_own_low_one(ledger, within_team):
    """HyperPod's PreemptTeamTasks (default LowerPriority): a team's quota full of its own
    `low` job does not keep its `high` job waiting forever."""
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    pool = _pool(2)
    ledger.config.set_pool(
        pool,
        [
            TeamQuota(  # no borrowing: its quota is all it may use
                "lab-a", "acme/a", proportional(pool, 8), borrow_pct=0, within_team=within_team
            ),
            TeamQuota("lab-a", "acme/b", proportional(pool, 8)),
        ],
    )
    low, _ = ledger.queue.request(_job("acme/a/s", priority=-100))
    b_own, _ = ledger.queue.request(
        _job("acme/b/s", priority=-500)
    )  # within B's quota: never a victim
    high, waits = ledger.queue.request(_job("acme/a/s", priority=100))
    assert waits.verdict == "wait"
    assert waits.reason.startswith(
        "team acme/a uses 8 H100 of its quota 8 H100 (+0% borrow limit) in pool lab-a; "
        "this job needs 8 H100"
    )
    assert ledger.views.job(b_own)["preempt_at"] is None
    if within_team == "never":
        assert not waits.preempt and "(within_team: never)" in waits.reason
        ledger.queue.cancel_queued(high, "acme/a/s", "test over")
    else:
        assert waits.preempt == (low,)
        assert f"preempting {low[:8]} (acme/a, lower priority, priority -100)" in waits.reason
        assert ledger.views.job(low)["preempt_at"] is not None
        _done(ledger, low, "preempted")
        assert _state(ledger, high) == "admitted"
        _done(ledger, high)
    for job_id in (low, b_own):
        if _state(ledger, job_id) != "settled":
            _done(ledger, job_id)


def test_a_teams_waiting_job_holds_only_its_own_team(ledger):
    """Kueue orders and blocks per ClusterQueue: team A's 2-node gang job, waiting within A's
    quota, does not hold team C's job that fits C's quota and the machines now. It holds only
    borrowers (nominal quota first), unless the pool's backfill lets them pass."""
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    pool = _pool(4)
    quotas = [
        TeamQuota("lab-a", "acme/a", proportional(pool, 16)),
        TeamQuota("lab-a", "acme/c", proportional(pool, 16), borrow_pct=50),
    ]
    ledger.config.set_pool(pool, quotas)
    running = [ledger.queue.request(_job("acme/c/s", gpus=g))[0] for g in (5, 4, 5)]  # 3 machines
    gang, waits = ledger.queue.request(_job("acme/a/s", nodes=2))  # within A's 16, 1 machine free
    assert waits.verdict == "wait"
    assert waits.reason == "waiting for 2 x 8 H100 in pool lab-a: 1 node free"
    c_small, decision = ledger.queue.request(_job("acme/c/s", gpus=2))  # C's 14 + 2 = its 16
    assert decision.verdict == "admit", decision.reason  # never "waiting behind job ..."
    c_borrow, behind = ledger.queue.request(_job("acme/c/s", gpus=4))  # would borrow A's idle quota
    assert behind.verdict == "wait"
    assert behind.reason.startswith(f"waiting behind job {gang[:8]}")
    assert behind.reason.endswith(
        "for pool lab-a, where jobs within their team's quota go before borrowers"
    )
    ledger.config.set_pool(_pool(4, backfill=True), quotas)  # the pool lets borrowers pass
    assert _state(ledger, c_borrow) == "admitted"
    ledger.queue.cancel_queued(gang, "acme/a/s", "test over")
    for job_id in (*running, c_small, c_borrow):
        _done(ledger, job_id)


def test_jobs_within_nominal_quota_go_before_a_higher_priority_borrower(ledger):
    """Kueue admits workloads that fit their nominal quota first, then borrowers by fair share
    and priority: the node that frees goes to the lender's own job, not to a higher-priority
    borrower that would then hold it (and, as an equal, could not be reclaimed)."""
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    pool = _pool(2)
    ledger.config.set_pool(
        pool,
        [
            TeamQuota("lab-a", "acme/a", proportional(pool, 8), reclaim="lower_priority"),
            TeamQuota("lab-a", "acme/b", proportional(pool, 8), borrow_pct=100),
        ],
    )
    b_own, _ = ledger.queue.request(_job("acme/b/s", priority=100))  # B's own, not lower: it stays
    a_first, _ = ledger.queue.request(_job("acme/a/s"))
    borrower, b_waits = ledger.queue.request(_job("acme/b/s", priority=100))
    assert b_waits.verdict == "wait"
    assert b_waits.reason == (
        "team acme/b uses 8 H100 of its quota 8 H100 in pool lab-a and this job would borrow "
        "8 H100; other teams lend 0 H100 idle now"
    )
    lender, a_waits = ledger.queue.request(_job("acme/a/s"))
    assert a_waits.verdict == "wait" and not a_waits.preempt  # a_first is no lower
    assert "team acme/a uses 8 H100 of its quota 8 H100" in a_waits.reason
    _done(ledger, a_first)  # A's node frees: A's own job is within quota, B's would borrow
    assert _state(ledger, lender) == "admitted"
    assert _state(ledger, borrower) == "queued"
    assert "other teams lend 0 H100 idle now" in ledger.views.job(borrower)["reason"]
    ledger.queue.cancel_queued(borrower, "acme/b/s", "test over")
    for job_id in (b_own, lender):
        _done(ledger, job_id)


def test_every_wait_names_the_resource_that_binds(ledger):
    """A pool without team quotas: a job short of vCPU says so, with the amounts, while 4 GPUs
    are free; on the quota path the same."""
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    ledger.config.set_pool(_pool(1))
    hungry, _ = ledger.queue.request(_job("acme/a/s", gpus=4, node_vcpu=150))
    small, waits = ledger.queue.request(_job("acme/b/s", gpus=2))  # 2/8 of the machine: 48 vCPU
    assert waits.verdict == "wait"
    assert waits.reason == (
        "waiting for 1 x 2 H100 in pool lab-a: 0 nodes free; vCPU binds: a node of this job "
        "needs 48 vCPU, at most 42 vCPU is free on a machine (4 H100 free in all)"
    )
    ledger.queue.cancel_queued(small, "acme/b/s", "test over")
    _done(ledger, hungry)

    pool = _pool(2)
    ledger.config.set_pool(
        pool, [TeamQuota("lab-a", "acme/a", proportional(pool, 4, vcpu=40), borrow_pct=0)]
    )
    first, _ = ledger.queue.request(_job("acme/a/s", gpus=2, node_vcpu=30))
    second, waits = ledger.queue.request(_job("acme/a/s", gpus=2, node_vcpu=20))
    assert waits.reason == (
        "team acme/a uses 30 vCPU of its quota 40 vCPU (+0% borrow limit) in pool lab-a; "
        "this job needs 20 vCPU"
    )
    ledger.queue.cancel_queued(second, "acme/a/s", "test over")
    _done(ledger, first)

    ledger.config.set_pool(Pool("acme", "cloud", 2, NODE, (), "H100", kind="quota"))  # totals only
    big, _ = ledger.queue.request(_job("acme/a/s", gpus=4, node_memory_gib=3800, pool="cloud"))
    short, waits = ledger.queue.request(_job("acme/a/s", gpus=2, pool="cloud"))
    assert waits.reason == (
        "waiting for 2 H100 in pool cloud: 12 H100 free; memory binds: this job needs 512 GiB "
        "of memory, 296 GiB of memory free"
    )
    ledger.queue.cancel_queued(short, "acme/a/s", "test over")
    _done(ledger, big)


def test_team_settings_are_kept_and_checked(ledger):
    pool = _pool(2)
    ledger.config.set_pool(pool, [TeamQuota("lab-a", "acme/a", proportional(pool, 8))])
    [quota] = ledger.config.capacity("acme")[1]
    assert (quota.reclaim, quota.within_team, quota.queueing) == (
        "any",
        "lower_priority",
        "best_effort_fifo",
    )
    strict = TeamQuota(
        "lab-a",
        "acme/a",
        proportional(pool, 8),
        reclaim="never",
        within_team="never",
        queueing="strict_fifo",
    )
    ledger.config.set_pool(pool, [strict])
    assert ledger.config.capacity("acme")[1] == [strict]
    [status] = ledger.views.capacity_status("acme")
    assert status["teams"][0]["reclaim"] == "never"
    with pytest.raises(BudgetInputError, match="^reclaim: acme/a: must be any or lower_priority"):
        ledger.config.set_pool(pool, [TeamQuota("lab-a", "acme/a", (8, 1, 1), reclaim="sometimes")])
    assert ledger.config.capacity("acme")[1] == [strict]  # nothing written
    assert team_setting("reclaim", "LowerPriority") == "lower_priority"  # as Kueue spells it
    assert team_setting("queueing", "StrictFIFO") == "strict_fifo"
    assert team_setting("within_team", "lower-priority") == "lower_priority"
    with pytest.raises(BudgetInputError, match="^within_team: must be lower_priority or never"):
        team_setting("within_team", "any")


def _cli(monkeypatch, capsys, url: str, *argv: str) -> tuple[int, str, str]:
    from prefect_gpu_budget.cli import main

    monkeypatch.setattr(sys, "argv", ["prefect-gpu-budget", "--ledger-url", url, *argv])
    code = 0
    try:
        main()
    except SystemExit as exit_:
        code = exit_.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_cli_sets_a_teams_settings_and_keeps_what_it_leaves_out(
    ledger, ledger_url, monkeypatch, capsys
):
    ledger.config.set_pool(_pool(2))
    quota = ["pool", "quota", "acme/a", "--pool", "lab-a", "--gpus", "8"]
    code, out, err = _cli(
        monkeypatch,
        capsys,
        ledger_url,
        *quota,
        "--borrow-pct",
        "50",
        "--reclaim",
        "LowerPriority",
        "--queueing",
        "strict-fifo",
    )
    assert code == 0, err
    assert "reclaim lower_priority, within team lower_priority, strict_fifo" in out
    code, _, err = _cli(monkeypatch, capsys, ledger_url, *quota, "--within-team", "never")
    assert code == 0, err
    [kept] = ledger.config.capacity("acme")[1]
    assert (kept.borrow_pct, kept.reclaim, kept.within_team, kept.queueing) == (
        50,
        "lower_priority",
        "never",
        "strict_fifo",
    )
    for option, value, field in (
        ("--reclaim", "sometimes", "reclaim"),
        ("--within-team", "any", "within_team"),
        ("--queueing", "lifo", "queueing"),
    ):
        code, _, err = _cli(monkeypatch, capsys, ledger_url, *quota, option, value)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, err
        assert lines[0].startswith(f"error: {field}: must be "), err
    assert ledger.config.capacity("acme")[1] == [kept]  # nothing written
    from prefect_gpu_budget.cli import common

    monkeypatch.setenv("COLUMNS", "300")  # a narrower table wraps the cell
    monkeypatch.setattr(common._Console, "_rich", None)
    code, out, err = _cli(monkeypatch, capsys, ledger_url, "capacity", "acme")
    assert code == 0 and "lower_priority / never / strict_fifo" in out, err


def test_reclaim_frees_a_placement_when_the_borrowers_jobs_are_spread(ledger):
    """Kueue takes candidates in order until the preemptor fits, then spares those not needed;
    its quota is placement-free, ours places each node on a machine. B borrows A's whole quota
    with four 4-GPU jobs, its lowest-priority ones on different machines: taking those two
    would bring B back to its quota but free no machine, so the set asked is the two jobs of
    one machine (B is still above its quota when each is taken), never a third."""
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    pool = _pool(2)
    quotas = [
        TeamQuota("lab-a", "acme/a", proportional(pool, 8)),
        TeamQuota("lab-a", "acme/b", proportional(pool, 8), borrow_pct=100, within_team="never"),
    ]
    ledger.config.set_pool(pool, quotas)
    jobs = {}
    for name, priority in (("b0_lo", -100), ("b1", 0), ("b2_lo", -100), ("b3", 0)):
        jobs[name], decision = ledger.queue.request(_job("acme/b/s", gpus=4, priority=priority))
        assert decision.verdict == "admit"
    where = {name: ledger.views.job(job_id)["placement"] for name, job_id in jobs.items()}
    assert where["b0_lo"] != where["b2_lo"]  # the lowest priorities on different machines
    a_job, waits = ledger.queue.request(_job("acme/a/s"))  # within A's quota of 8
    assert waits.verdict == "wait" and len(waits.preempt) == 2, waits.reason
    names = {name for name, job_id in jobs.items() if job_id in waits.preempt}
    assert len({where[name] for name in names}) == 1  # both on one machine
    assert any(name.endswith("_lo") for name in names)  # the cheaper machine: newest first
    assert waits.reason.startswith("waiting for 1 x 8 H100 in pool lab-a: 0 nodes free; preempting")
    for job_id in waits.preempt:
        _done(ledger, job_id, "preempted")
    assert _state(ledger, a_job) == "admitted"
    for job_id in (a_job, *(j for j in jobs.values() if j not in waits.preempt)):
        _done(ledger, job_id)


def test_a_gang_reclaim_frees_whole_machines_with_the_fewest_victims(ledger):
    """A 2-node job within its quota, against a borrower whose jobs share every machine: the
    victims are the four jobs of two machines, no more."""
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    pool = _pool(4)
    ledger.config.set_pool(
        pool,
        [
            TeamQuota("lab-a", "acme/a", proportional(pool, 16)),
            TeamQuota(
                "lab-a", "acme/b", proportional(pool, 16), borrow_pct=100, within_team="never"
            ),
        ],
    )
    b_jobs = [
        ledger.queue.request(_job("acme/b/s", gpus=4, priority=-100 if i % 2 == 0 else 0))[0]
        for i in range(8)
    ]
    where = {job_id: ledger.views.job(job_id)["placement"] for job_id in b_jobs}
    gang, waits = ledger.queue.request(_job("acme/a/s", nodes=2))
    assert len(waits.preempt) == 4, waits.reason
    freed = {where[job_id] for job_id in waits.preempt}
    assert len(freed) == 2
    assert all(job_id in waits.preempt for job_id in b_jobs if where[job_id] in freed)
    for job_id in waits.preempt:
        _done(ledger, job_id, "preempted")
    assert _state(ledger, gang) == "admitted"
    for job_id in (gang, *(j for j in b_jobs if j not in waits.preempt)):
        _done(ledger, job_id)


def test_a_borrower_is_never_cut_below_its_quota_for_a_placement(ledger):
    """Kueue takes a borrower's job only while its queue borrows (the last one taken may leave
    it below its quota, no more). B borrows 4 GPUs with 2-node jobs on both machines, one GPU
    free on each: a machine for A's 6-GPU job would take five of B's jobs, B from 12 to 2 of
    its 8. A waits, and nobody is asked to stop (Kueue, placement-free, would stop two and
    admit a job whose pods find no machine)."""
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    pool = _pool(2)
    ledger.config.set_pool(
        pool,
        [
            TeamQuota("lab-a", "acme/a", proportional(pool, 6)),
            TeamQuota("lab-a", "acme/b", proportional(pool, 8), borrow_pct=100),
            TeamQuota("lab-a", "acme/c", proportional(pool, 2)),
        ],
    )
    c_job, _ = ledger.queue.request(_job("acme/c/s", nodes=2, gpus=1))
    b_jobs = [ledger.queue.request(_job("acme/b/s", nodes=2, gpus=1))[0] for _ in range(6)]
    assert all(_state(ledger, job_id) == "admitted" for job_id in b_jobs)  # B: 12 of its 8
    a_job, waits = ledger.queue.request(_job("acme/a/s", gpus=6))  # within A's quota of 6
    assert waits.verdict == "wait" and not waits.preempt
    assert waits.reason == (
        "waiting for 1 x 6 H100 in pool lab-a: 0 nodes free; taking back lent capacity would "
        "free a machine for it only by cutting team acme/b below its quota"
    )
    assert all(ledger.views.job(job_id)["preempt_at"] is None for job_id in b_jobs)
    ledger.queue.cancel_queued(a_job, "acme/a/s", "test over")
    for job_id in (c_job, *b_jobs):
        _done(ledger, job_id)


def _ones(weights: dict[str, int], idle: int = 4) -> Pool:
    """Eight 1-GPU machines; teams a and b of quota 2 borrowing at will, with these weights;
    team c of quota `idle` lending."""
    pool = Pool("acme", "lab-a", 8, (1, 24, 256), ("local:h100x8",), "H100")
    return pool, [
        TeamQuota(
            "lab-a", f"acme/{t}", (2, 48, 512), borrow_pct=1000, weight=w, within_team="never"
        )
        for t, w in weights.items()
    ] + [TeamQuota("lab-a", "acme/c", (idle, 24 * idle, 256 * idle))]


@pytest.mark.parametrize("weight_a", [50, 0])
def test_borrowers_are_ordered_by_fair_share_before_priority(ledger, weight_a):
    """Kueue's fair sharing (on by default in HyperPod): among heads that would borrow, the
    team whose share once its head runs (borrowed per weight) is least goes first, then
    priority. A borrows 2 and B 1: B's next job goes before A's of priority 100; a team of
    weight 0 borrows last of all."""
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    pool, quotas = _ones({"a": weight_a, "b": 50})
    ledger.config.set_pool(pool, quotas)
    one = {"gpus": 1}
    running = [
        ledger.queue.request(_job("acme/a/s", **one))[0] for _ in range(4 if weight_a else 2)
    ]
    running += [ledger.queue.request(_job("acme/b/s", **one))[0] for _ in range(3)]
    c_jobs = [ledger.queue.request(_job("acme/c/s", **one))[0] for _ in range(1 if weight_a else 3)]
    assert all(_state(ledger, job_id) == "admitted" for job_id in running + c_jobs)
    a_next, a_waits = ledger.queue.request(_job("acme/a/s", priority=100, **one))
    b_next, b_waits = ledger.queue.request(_job("acme/b/s", **one))
    assert a_waits.verdict == b_waits.verdict == "wait"
    _done(ledger, c_jobs[0])  # one machine of C's idle quota frees
    assert (_state(ledger, a_next), _state(ledger, b_next)) == ("queued", "admitted")
    ledger.queue.cancel_queued(a_next, "acme/a/s", "test over")
    for job_id in (*running, *c_jobs[1:], b_next):
        _done(ledger, job_id)


def test_victims_come_from_the_team_with_the_highest_share_first(ledger):
    """Kueue's fair-sharing preemption takes from the queue with the highest share first: B
    (weight 10) and C (weight 90) each borrow 2 of A's idle quota at the same priority, C's
    newest; A's job takes back from B."""
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    pool = Pool("acme", "lab-a", 8, (1, 24, 256), ("local:h100x8",), "H100")
    lend = {"borrow_pct": 100, "within_team": "never"}
    ledger.config.set_pool(
        pool,
        [
            TeamQuota("lab-a", "acme/a", (4, 96, 1024)),
            TeamQuota("lab-a", "acme/b", (2, 48, 512), weight=10, **lend),
            TeamQuota("lab-a", "acme/c", (2, 48, 512), weight=90, **lend),
        ],
    )
    b_jobs = [ledger.queue.request(_job("acme/b/s", gpus=1))[0] for _ in range(4)]
    c_jobs = [ledger.queue.request(_job("acme/c/s", gpus=1))[0] for _ in range(4)]
    a_job, waits = ledger.queue.request(_job("acme/a/s", gpus=1))
    assert waits.preempt == (b_jobs[-1],), waits.reason  # B's newest, though C's is newer
    assert "(acme/b, borrowing, priority 0)" in waits.reason
    _done(ledger, b_jobs[-1], "preempted")
    assert _state(ledger, a_job) == "admitted"
    for job_id in (a_job, *b_jobs[:-1], *c_jobs):
        _done(ledger, job_id)


def test_a_reason_names_a_preemption_only_when_one_is_asked(ledger):
    """Budget limits never preempt: a job blocked by its team's cap and by capacity asks
    nobody to stop, and neither its reason nor its time-out says it does."""
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    ledger.config.set_budget(BudgetRule("acme/a", hourly_cap_cents=150))
    pool = _pool(2)
    ledger.config.set_pool(
        pool,
        [
            TeamQuota("lab-a", "acme/a", proportional(pool, 8)),
            TeamQuota("lab-a", "acme/b", proportional(pool, 8), borrow_pct=100),
        ],
    )
    b_jobs = [ledger.queue.request(_job("acme/b/s"))[0] for _ in range(2)]  # B borrows A's machine
    a_cheap, _ = ledger.queue.request(
        new_job("acme/a/s", rate_micro_per_hour=10**6, rate_cents=100)
    )
    a_job, waits = ledger.queue.request(_job("acme/a/s", max_wait_s=0.5))  # $2/h > $1.50/h, no node
    assert waits.verdict == "wait" and not waits.preempt
    assert waits.reason == (
        "blocked by hourly cap of acme/a: running $1.00/h + this job $1.00/h > cap $1.50/h "
        "(over by $0.50/h); resumes when jobs there end; waiting for 1 x 8 H100 in pool "
        "lab-a: 0 nodes free"
    )
    assert ledger.views.job(a_job)["reason"] == waits.reason
    assert all(ledger.views.job(job_id)["preempt_at"] is None for job_id in b_jobs)
    time.sleep(0.6)
    ended = ledger.queue.try_admit(a_job, "acme/a/s")
    assert ended.verdict == "timeout" and "preempting" not in ended.reason
    assert ledger.views.job(a_job)["reason"].endswith("0 nodes free")
    for job_id in (*b_jobs, a_cheap):
        _done(ledger, job_id)


def test_a_money_wait_holds_only_its_own_team(ledger):
    """Each team's queue blocks only itself: team A's big job waits for the org's hourly cap;
    team C's $1/h job, which fits the cap, its quota and the machines, is admitted, while A's
    next job waits behind A's head, naming the cap it waits for with amounts."""
    ledger.config.set_budget(BudgetRule("acme", hourly_cap_cents=1000, period_budget_micro=10**9))
    pool = _pool(2)
    ledger.config.set_pool(
        pool,
        [
            TeamQuota("lab-a", "acme/a", proportional(pool, 8)),
            TeamQuota("lab-a", "acme/c", proportional(pool, 8)),
        ],
    )

    def priced(scope: str, gpus: int, cents: int) -> NewJob:
        return _job(scope, gpus=gpus, rate_micro_per_hour=cents * 10_000, rate_cents=cents)

    c_run, _ = ledger.queue.request(priced("acme/c/s", 2, 500))
    a_big, a_waits = ledger.queue.request(priced("acme/a/s", 8, 800))
    assert a_waits.verdict == "wait" and a_waits.reason.startswith(
        "blocked by hourly cap of acme: running $5.00/h + this job $8.00/h > cap $10.00/h"
    )
    c_small, c_decision = ledger.queue.request(priced("acme/c/s", 2, 100))
    assert c_decision.verdict == "admit", c_decision.reason
    a_small, behind = ledger.queue.request(priced("acme/a/s", 1, 100))
    assert behind.verdict == "wait" and (behind.limit, behind.scope) == ("queue", "acme")
    assert behind.reason.startswith(f"waiting behind job {a_big[:8]}")
    assert behind.reason.endswith("for the hourly cap of acme ($10.00/h)")
    for job_id in (a_big, a_small):
        ledger.queue.cancel_queued(job_id, "acme/a/s", "test over")
    for job_id in (c_run, c_small):
        _done(ledger, job_id)


def test_pool_quota_changes_only_the_options_given(ledger, ledger_url, monkeypatch, capsys):
    """`pool quota` is field-wise as `budget set` is: a team's weight, or one setting, alone."""
    ledger.config.set_pool(_pool(2))
    at = ["pool", "quota", "acme/vision", "--pool", "lab-a"]
    code, _, err = _cli(monkeypatch, capsys, ledger_url, *at, "--weight", "70")
    assert code == 2 and err.strip() == (
        "error: gpus: acme/vision has no quota in acme/lab-a yet: give --gpus"
    ), err
    assert ledger.config.capacity("acme")[1] == []  # nothing written
    code, _, err = _cli(
        monkeypatch, capsys, ledger_url, *at, "--gpus", "4", "--vcpu", "64", "--weight", "60"
    )
    assert code == 0, err
    code, out, err = _cli(monkeypatch, capsys, ledger_url, *at, "--weight", "70")
    assert code == 0 and "weight 70" in out, err
    code, _, err = _cli(monkeypatch, capsys, ledger_url, *at, "--reclaim", "never")
    assert code == 0, err
    [quota] = ledger.config.capacity("acme")[1]
    assert (quota.quota, quota.weight, quota.reclaim) == ((4, 64, 1024), 70, "never")


def test_a_team_borrows_half_its_quota_by_default_as_hyperpod(ledger):
    """HyperPod's default sharing is LendAndBorrow with BorrowLimit 50: a team given only a
    quota borrows up to half of it more from an idle team, and no more."""
    from prefect_gpu_budget.admission.admin_settings import TeamShare

    assert TeamQuota("lab-a", "acme/a", NODE).borrow_pct == 50
    assert TeamShare(team="acme/a", gpus=8).borrow_pct == 50
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    pool = _pool(2)
    ledger.config.set_pool(
        pool,
        [
            TeamQuota("lab-a", "acme/a", proportional(pool, 8)),
            TeamQuota("lab-a", "acme/b", proportional(pool, 8)),
        ],
    )
    own, _ = ledger.queue.request(_job("acme/a/s"))
    borrowed, decision = ledger.queue.request(_job("acme/a/s", gpus=4))  # 50% of 8 from idle B
    assert decision.verdict == "admit", decision.reason
    more, waits = ledger.queue.request(_job("acme/a/s", gpus=1))
    assert waits.reason == (
        "team acme/a uses 12 H100 of its quota 8 H100 (+50% borrow limit) in pool lab-a; "
        "this job needs 1 H100"
    )
    ledger.queue.cancel_queued(more, "acme/a/s", "test over")
    for job_id in (own, borrowed):
        _done(ledger, job_id)


def test_an_org_defines_at_most_ten_priority_classes_as_hyperpod(ledger):
    for index in range(10):
        ledger.config.set_priority_class("acme", f"c{index}", 10 * index)
    with pytest.raises(BudgetInputError, match="^name: acme has 10 priority classes of its own"):
        ledger.config.set_priority_class("acme", "c10", 500)
    ledger.config.set_priority_class("acme", "c9", 95)  # redefining one of the ten is no eleventh
    ledger.config.set_priority_class("other", "c0", 1)  # another org's are its own
    own = {
        c["name"]: c["value"]
        for c in ledger.config.priority_classes("acme")
        if c["defined_by"] == "acme"
    }
    assert len(own) == 10 and own["c9"] == 95 and "c10" not in own


def test_a_job_more_than_others_may_ever_lend_is_refused_at_once(ledger):
    """B lends nothing (HyperPod's DontLend, Kueue's lendingLimit 0): A's 16-GPU job, within
    A's quota plus its borrow limit, could never fit, and is refused at once, naming why."""
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    pool = _pool(2)
    ledger.config.set_pool(
        pool,
        [
            TeamQuota("lab-a", "acme/a", proportional(pool, 8), borrow_pct=100),
            TeamQuota("lab-a", "acme/b", proportional(pool, 8), lend_pct=0),
        ],
    )
    _, decision = ledger.queue.request(_job("acme/a/s", nodes=2))
    assert decision.verdict == "reject"
    assert decision.reason == (
        "can never fit: needs 16 H100, more than team acme/a's quota of 8 H100 plus the most "
        "other teams may lend (0 H100) in pool lab-a"
    )
    own, fits = ledger.queue.request(_job("acme/a/s"))  # its own quota still runs
    assert fits.verdict == "admit"
    _done(ledger, own)
