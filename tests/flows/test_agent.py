"""What agents may run: a token binds an agent to one session, its team's limits bound its
specs, and a grant is checked at every admission."""

from __future__ import annotations

import hashlib

import pytest

from prefect_gpu_budget.admission.admin_settings import AgentLimits, limits_for
from prefect_gpu_budget.admission.ledger import agent_grants
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.agents.limits import agent_spec, stop_own_job
from prefect_gpu_budget.units import BudgetInputError
from tests.support.jobs import new_job

SESSION = "acme/vision/agent-7"
SPEC = {
    "name": "s",
    "job": {"instance_type": "local:box", "max_runtime": "1m"},
    "command": ["true"],
    "grid": {"lr": [0.1]},
}
LIMITS = AgentLimits(team="acme/vision")


@pytest.fixture
def bounded(ledger):
    """A ledger whose team acme/vision gives each session a small template budget."""
    ledger.config.set_session_template(BudgetRule("acme/vision", hourly_cap_cents=720))
    return ledger


def test_a_token_names_one_session_and_only_its_hash_is_kept(bounded):
    token = bounded.grants.grant_agent(SESSION)
    scope, grant = bounded.grants.agent_grant(token)
    assert scope == SESSION and grant == hashlib.sha256(token.encode()).hexdigest()
    assert bounded.grants.grant_scope(grant) == SESSION
    with bounded.db.engine.connect() as conn:
        stored = [tuple(r) for r in conn.execute(agent_grants.select())]
    assert stored and token not in repr(stored)
    for bad in ("", "gpub_forged", token + "x", "' OR 1=1 --"):
        with pytest.raises(BudgetInputError, match="unknown or revoked"):
            bounded.grants.agent_scope(bad)
    assert bounded.grants.revoke_agent(SESSION) == (1, 0, 0)
    with pytest.raises(BudgetInputError, match="unknown or revoked"):
        bounded.grants.agent_scope(token)
    assert bounded.grants.grant_scope(grant) is None


@pytest.mark.parametrize("scope", ["acme", "acme/vision", "acme/../x/y", "Acme/v/a"])
def test_tokens_are_granted_for_sessions_only(bounded, scope):
    with pytest.raises(BudgetInputError, match="scope"):
        bounded.grants.grant_agent(scope)


def test_no_token_for_a_session_bounded_only_by_its_org(ledger):
    ledger.config.set_budget(BudgetRule("acme", hourly_cap_cents=100_000))
    with pytest.raises(BudgetInputError, match="no budget and acme/nlp no session template"):
        ledger.grants.grant_agent("acme/nlp/agent-1")
    ledger.config.set_budget(BudgetRule("acme/nlp/agent-1", hourly_cap_cents=360))
    assert ledger.grants.grant_agent("acme/nlp/agent-1").startswith("gpub_")


def test_an_agent_spec_stays_in_its_session():
    assert agent_spec(SPEC, SESSION, LIMITS).scope == SESSION
    for other in ("acme/vision", "acme/vision/agent-8", "acme"):
        with pytest.raises(BudgetInputError, match="may spend only in acme/vision/agent-7"):
            agent_spec({**SPEC, "scope": other}, SESSION, LIMITS)
    with pytest.raises(ValueError, match="hourly_cap_usd"):  # no budget rides in on a spec
        agent_spec({**SPEC, "hourly_cap_usd": 1000}, SESSION, LIMITS)


def _job(**changes: object) -> dict:
    return {**SPEC, "job": {**SPEC["job"], **changes}}


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({**SPEC, "command": None, "callable": "os:system"}, "callable"),
        ({**SPEC, "launcher": "sagemaker:nlp-team"}, "launcher"),
        ({**SPEC, "launcher": "vertex:other"}, "launcher"),
        (_job(priority=1000), "job.priority"),
        (_job(priority="high"), "job.priority"),
        (_job(max_wait=0), "job.max_wait"),
        (_job(max_wait="2h"), "job.max_wait"),
        ({**SPEC, "grid": {"lr": list(range(101))}}, "grid"),
        ({**SPEC, "parallelism": 17}, "parallelism"),
        ({**SPEC, "results_dir": "/etc"}, "results_dir"),
        ({**SPEC, "results_dir": "a/../../b"}, "results_dir"),
        ({**SPEC, "command": ["echo", "{lr:>400000000}"]}, "command"),
        # a 64 kB spec whose trial command grows to 337 MB
        ({**SPEC, "command": ["echo", "{lr}" * 10_900], "grid": {"lr": ["x" * 31_000]}}, "command"),
        # a part of the local machine would be priced as a part and run on all of it
        (_job(gpus=0, vcpu=1), "job.gpus"),
        (_job(gpus=1), "job.gpus"),
    ],
)
def test_an_agent_spec_beyond_its_teams_limits_is_refused(spec, field):
    with pytest.raises(ValueError, match=field):
        agent_spec(spec, SESSION, LIMITS)


def test_an_orgs_own_class_counts_at_its_value_against_the_agents_ceiling():
    classes = {"urgent": 500, "scavenger": -500}
    with pytest.raises(ValueError, match="job.priority: at most 0 for agents of acme/vision"):
        agent_spec(_job(priority="urgent"), SESSION, LIMITS, classes)
    assert agent_spec(_job(priority="scavenger"), SESSION, LIMITS, classes)
    with pytest.raises(ValueError, match="no priority class 'urgent' in acme"):
        agent_spec(_job(priority="urgent"), SESSION, LIMITS)


def test_an_admin_widens_what_agents_may_ask_for():
    wide = AgentLimits(
        team="acme/vision",
        launchers=["local", "sagemaker:vision"],
        callables=["tests.flows.trial_fns:quadratic"],
        max_priority=100,
        max_wait="6h",
        max_trials=200,
    )
    assert agent_spec({**SPEC, "launcher": "sagemaker:vision"}, SESSION, wide)
    assert agent_spec(
        {**SPEC, "command": None, "callable": "tests.flows.trial_fns:quadratic"}, SESSION, wide
    )
    assert agent_spec(_job(priority="high", max_wait="6h"), SESSION, wide).job.priority == "high"
    assert agent_spec({**SPEC, "grid": {"lr": list(range(200))}}, SESSION, wide)
    spec = agent_spec(SPEC, SESSION, wide)  # no max_wait given: the ceiling, never forever
    assert spec.job_for({"lr": 0.1}, "x").max_wait == 6 * 3600


def test_limits_are_kept_per_team_in_the_ledger(ledger):
    assert limits_for(ledger.grants, SESSION) == LIMITS  # the defaults until an admin sets some
    ledger.grants.set_agent_limits(
        "acme/vision", AgentLimits(team="acme/vision", max_sweeps=5).stored()
    )
    assert limits_for(ledger.grants, SESSION).max_sweeps == 5
    assert limits_for(ledger.grants, "acme/nlp/agent-1").max_sweeps == 2
    with pytest.raises(BudgetInputError, match="team"):
        ledger.grants.set_agent_limits("acme", {})


def test_a_grant_is_checked_at_every_admission(bounded):
    token = bounded.grants.grant_agent(SESSION)
    _, grant = bounded.grants.agent_grant(token)
    running, admitted = bounded.queue.request(new_job(SESSION, grant=grant))
    queued, waiting = bounded.queue.request(
        new_job(SESSION, grant=grant, rate_micro_per_hour=7_200_000, rate_cents=720)
    )
    assert admitted.verdict == "admit" and waiting.verdict == "wait"
    assert bounded.grants.revoke_agent(SESSION) == (1, 1, 1)
    assert bounded.views.job(queued)["state"] == "cancelled"
    assert bounded.views.stop_asked(running) == "stopped"  # its holder stops it, as an owner's
    assert bounded.views.job(running)["reason"] == "its agent's grant was revoked"
    late, refused = bounded.queue.request(new_job(SESSION, grant=grant))
    assert refused.verdict == "reject" and "revoked" in refused.reason
    assert (
        bounded.views.job(late)["state"] == "rejected"
        and bounded.views.job(late)["reserved_micro"] == 0
    )
    _, forged = bounded.queue.request(new_job("acme/vision/agent-8", grant=grant))
    assert forged.verdict == "reject", "a grant spends in its own session only"


def test_a_session_queues_at_most_its_agents_limit(bounded):
    bounded.grants.set_agent_limits(
        "acme/vision", AgentLimits(team="acme/vision", max_queued=2).stored()
    )
    _, grant = bounded.grants.agent_grant(bounded.grants.grant_agent(SESSION))
    verdicts = [
        bounded.queue.request(
            new_job(SESSION, grant=grant, rate_micro_per_hour=7_200_000, rate_cents=720)
        )[1]
        for _ in range(4)
    ]
    assert [d.verdict for d in verdicts] == ["admit", "wait", "wait", "reject"]
    assert "2 queued jobs" in verdicts[-1].reason


def test_an_agent_cancels_its_own_queued_jobs_and_no_one_elses(ledger):
    ledger.config.set_budget(BudgetRule("acme", hourly_cap_cents=360))
    ledger.queue.request(new_job(SESSION))  # takes the whole cap
    mine, _ = ledger.queue.request(new_job(SESSION))
    theirs, _ = ledger.queue.request(new_job("acme/vision/agent-8"))
    for job_id in (theirs, "not-a-job"):
        with pytest.raises(LookupError, match="no job"):
            stop_own_job(ledger, job_id, SESSION)
    assert ledger.views.job(theirs)["state"] == "queued"
    stop_own_job(ledger, mine, SESSION)
    assert ledger.views.job(mine)["state"] == "cancelled"
    with pytest.raises(BudgetInputError, match="it has ended"):
        stop_own_job(ledger, mine, SESSION)


def test_a_deployment_launcher_is_never_granted_to_agents():
    """Its job would run as the target worker, with its keys, and could end its own billing."""
    with pytest.raises(ValueError, match="not for agents"):
        AgentLimits(team="acme/vision", launchers=["local", "deployment:train"])
    assert AgentLimits(team="acme/vision", launchers=["local", "vertex:lab"]).launchers
