"""Agent grants (admission/ledger/grants.py): a token binds one session with a budget of its
own or its team's template, only its hash is kept, and a revocation ends the session's jobs."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from prefect_gpu_budget.admission.ledger import agent_grants
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.units import BudgetInputError
from tests.support.jobs import new_job


def test_a_grant_binds_one_bounded_session_and_keeps_only_its_hash(ledger):
    with pytest.raises(BudgetInputError, match="no budget"):
        ledger.grants.grant_agent("acme/lab/s1")  # neither a budget nor a template
    with pytest.raises(BudgetInputError, match="one session"):
        ledger.grants.grant_agent("acme/lab")
    ledger.config.set_session_template(BudgetRule("acme/lab", hourly_cap_cents=360))
    token = ledger.grants.grant_agent("acme/lab/s1")
    scope, grant = ledger.grants.agent_grant(token)
    assert scope == "acme/lab/s1" and ledger.grants.grant_scope(grant) == scope
    with ledger.db.read() as conn:
        stored = conn.execute(sa.select(agent_grants.c.token_sha256)).scalars().all()
    assert stored == [grant] and token not in stored


def test_a_revocation_refuses_the_token_and_ends_the_sessions_jobs(ledger):
    ledger.config.set_budget(BudgetRule("acme", hourly_cap_cents=100))
    ledger.config.set_budget(BudgetRule("acme/lab/s1", hourly_cap_cents=100))
    token = ledger.grants.grant_agent("acme/lab/s1")
    _, running = ledger.queue.request(new_job("acme/lab/s1", rate_cents=100))
    _, queued = ledger.queue.request(new_job("acme/lab/s1", rate_cents=100))
    assert (running.verdict, queued.verdict) == ("admit", "wait")
    assert ledger.grants.revoke_agent("acme/lab/s1") == (1, 1, 1)
    with pytest.raises(BudgetInputError, match="unknown or revoked"):
        ledger.grants.agent_scope(token)
