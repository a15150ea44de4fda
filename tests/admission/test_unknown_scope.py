"""Issue 31, point 6: a typo in a scope's org or team is refused at the gate, as Kueue admits no
workload whose LocalQueue does not exist. An org exists once anything names it; a team once an
admin named it or a scope under it (a budget, a session template, a share in a pool, agent
limits), never by a job. A job naming one that does not exist is refused (`UnknownScope`, one
line, the name it may have meant) with nothing recorded, whichever way it asks (the gate,
`run_gpu_job`, `@gpu_task`; workers call the same `Gate.admit`), also when the team is the
scope's last level in an org that has teams. A new session under a known team stays automatic,
and so do two-level scopes in an org that has no team."""

from __future__ import annotations

import sys
import time

import pytest

from prefect_gpu_budget.admission.gate import AdmissionRefused, Gate
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.admission.rules.quota import Pool, TeamQuota, proportional
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.pricing.catalog import Catalog
from tests.support.jobs import new_job

TYPO = (
    "team acme/visoin of scope acme/visoin/agent-8 does not exist (nothing names it: no "
    "budget, session template, pool share or agent limits); did you mean acme/vision?"
)


def _job(**kw) -> GpuJob:
    return GpuJob(instance_type="local:box", max_runtime="1m", kill_grace="1s", **kw)


@pytest.fixture
def acme(ledger, prices):
    """An org with one team, `acme/vision`; a gate over it."""
    ledger.config.set_budget(
        BudgetRule("acme", hourly_cap_cents=100_000, period_budget_micro=10**9)
    )
    ledger.config.set_budget(BudgetRule("acme/vision", hourly_cap_cents=10_000))
    return Gate(ledger, catalog=Catalog.load(prices), poll_s=0.02)


def _run(gate: Gate, scope: str) -> dict:
    admission = gate.admit(_job(), scope)
    gate.holding.started(admission, time.time())
    gate.holding.settle(admission, ended_at=time.time(), outcome="completed")
    return gate.ledger.views.job(admission.job_id)


def test_a_typo_in_the_team_is_refused_with_did_you_mean_and_nothing_recorded(ledger, acme):
    before = (ledger.views.jobs(), ledger.views.status(), ledger.config.budgets())
    for _ in range(2):  # a refusal leaves nothing that would let the next one in
        with pytest.raises(AdmissionRefused) as refused:
            acme.admit(_job(), "acme/visoin/agent-8")
        assert refused.value.state_name == "UnknownScope"
        assert refused.value.reason == TYPO and "\n" not in refused.value.reason
        assert str(refused.value) == f"UnknownScope: {TYPO}"
    assert (ledger.views.jobs(), ledger.views.status(), ledger.config.budgets()) == before
    assert ledger.views.unknown_scope("acme/visoin/agent-8") == TYPO


def test_a_typo_in_the_org_and_a_team_nobody_named(ledger, acme):
    with pytest.raises(AdmissionRefused) as org:
        acme.admit(_job(), "acne/vision/agent-8")
    assert org.value.reason.startswith("org acne of scope acne/vision/agent-8 does not exist")
    assert org.value.reason.endswith("; did you mean acme?")
    with pytest.raises(AdmissionRefused) as far:  # nothing near: how to create it, and peers
        acme.admit(_job(), "acme/robotics/s1")
    assert far.value.reason.endswith(
        "create it first (`prefect-gpu-budget budget set acme/robotics ...`); "
        "known teams: acme/vision"
    )
    with pytest.raises(AdmissionRefused, match="^UnknownScope: org newco of scope newco/t "):
        acme.admit(_job(), "newco/t")  # an org nobody created, above a new last level
    assert ledger.views.jobs() == []


def test_the_last_level_stays_automatic(ledger, acme):
    # a new session under a known team: no budget of its own, the team's and org's bind
    row = _run(acme, "acme/vision/agent-8")
    assert row["state"] == "settled" and row["outcome"] == "completed"
    assert "acme/vision/agent-8" not in {r.scope for r in ledger.config.budgets()}
    # the org itself
    assert _run(acme, "acme")["state"] == "settled"
    # a session under a team known by its session template gets the template
    ledger.config.set_session_template(BudgetRule("acme/agents", hourly_cap_cents=360))
    assert _run(acme, "acme/agents/agent-1")["state"] == "settled"
    assert {r.scope: r.hourly_cap_cents for r in ledger.config.budgets()}[
        "acme/agents/agent-1"
    ] == 360


def test_every_way_a_team_comes_to_exist(ledger, acme):
    from prefect_gpu_budget.admission.admin_settings import AgentLimits

    assert ledger.views.unknown_scope("acme/lab/s") is not None
    pool = Pool("acme", "lab-a", 1, (8, 64, 256), ("local:box8",), "H100")
    ledger.config.set_pool(pool, [TeamQuota("lab-a", "acme/lab", proportional(pool, 8))])
    assert ledger.views.unknown_scope("acme/lab/s") is None  # a share in a pool

    assert ledger.views.unknown_scope("acme/bots/s") is not None
    ledger.grants.set_agent_limits(
        "acme/bots", AgentLimits(team="acme/bots", max_sweeps=1).stored()
    )
    assert ledger.views.unknown_scope("acme/bots/s") is None  # the limits on its agents

    assert ledger.views.unknown_scope("acme/nlp/s") is not None
    ledger.config.set_budget(BudgetRule("acme/nlp/s"))  # a budget under it names it too
    assert ledger.views.unknown_scope("acme/nlp/other") is None
    assert ledger.views.unknown_scope("acme/nlpp/s").endswith("did you mean acme/nlp?")

    # a job never makes a team: rows of a job recorded without the check let nothing in
    ledger.queue.request(new_job("acme/legacy/s1"))
    ledger.queue.request(new_job("acme/legacy"))
    for scope in ("acme/legacy/s2", "acme/legacy"):
        assert ledger.views.unknown_scope(scope).startswith(f"team acme/legacy of scope {scope} ")


def test_a_team_that_is_the_last_level_must_exist_where_the_org_has_teams(ledger, acme):
    """Budgets on `acme` and `acme/vision`: a job in `acme/visoin` is refused as one in
    `acme/visoin/agent-8` is, nothing reserved; one refused leaves nothing that lets the
    deeper scope in. An org that has no team keeps its two-level scopes as sessions."""
    before = (ledger.views.jobs(), ledger.views.status())
    for team, scope in (
        ("acme/visoin", "acme/visoin"),
        ("acme/visoin", "acme/visoin/agent-8"),
        ("acme/brand-new", "acme/brand-new"),
    ):
        with pytest.raises(AdmissionRefused) as refused:
            acme.admit(_job(), scope)
        assert refused.value.state_name == "UnknownScope"
        assert refused.value.reason.startswith(f"team {team} of scope {scope} does not exist")
    assert (ledger.views.jobs(), ledger.views.status()) == before
    assert _run(acme, "acme/vision")["state"] == "settled"  # the team itself
    ledger.config.set_budget(BudgetRule("solo", hourly_cap_cents=10_000, period_budget_micro=10**9))
    assert _run(acme, "solo/agent-8")["state"] == "settled"  # no team in solo: a session
    assert ledger.views.unknown_scope("solo/agent-9") is None
    assert ledger.views.unknown_scope("solo/agent-8/x") is None  # its accepted job's rows name it
    assert ledger.views.unknown_scope("solo/agent-7/x") is not None  # deeper: a team it needs
    pool = Pool("solo", "lab", 1, (8, 64, 256), ("local:box8",), "H100")
    ledger.config.set_pool(pool, [TeamQuota("lab", "solo/ml", proportional(pool, 8))])
    for scope in ("solo/agent-9", "solo/agent-8", "solo/agent-8/x"):  # solo now has a team
        team = "/".join(scope.split("/")[:2])
        assert ledger.views.unknown_scope(scope).startswith(f"team {team} of scope {scope} ")


def test_run_gpu_job_and_gpu_task_end_in_the_named_state(prefect_api, prices, tmp_path):
    """The Prefect doors go through the same gate: a Failed state named `UnknownScope`."""
    from prefect import flow

    from prefect_gpu_budget import GpuBudget, SpendLedger, gpu_task, run_gpu_job
    from prefect_gpu_budget.admission.ledger import Ledger

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    GpuBudget(scope="acme", hourly_cap_usd=100, period_budget_usd=100).apply(ledger)
    GpuBudget(scope="acme/vision", hourly_cap_usd=10).apply(ledger)
    block = SpendLedger(database_url=url)
    job = _job(command=[sys.executable, "-c", "print('ran')"])

    @gpu_task(instance_type="local:box", max_runtime="1m", ledger=block)
    def body() -> str:
        return "ran"

    @flow
    def sweep():
        by_job = run_gpu_job(job, scope="acme/visoin/agent-8", ledger=block, return_state=True)
        by_task = body.with_options(gpu={"scope": "acme/visoin/agent-8"})(return_state=True)
        fine = run_gpu_job(job, scope="acme/vision/agent-8", ledger=block)
        return by_job, by_task, fine

    by_job, by_task, fine = sweep()
    for state in (by_job, by_task):
        assert state.name == "UnknownScope" and state.message == TYPO, state
    assert fine.outcome == "completed"
    assert {r["scope"] for r in ledger.views.jobs()} == {"acme/vision/agent-8"}  # nothing else
