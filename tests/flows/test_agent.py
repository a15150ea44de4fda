"""Agent isolation in the ledger: a token binds an agent to one session, and nothing else."""

from __future__ import annotations

import pytest

from prefect_gpu_budget.admission.ledger import agent_grants
from prefect_gpu_budget.admission.policy import BudgetRule
from prefect_gpu_budget.flows.agent import agent_spec, cancel_own_job
from prefect_gpu_budget.units import BudgetInputError
from tests.admission.test_ledger import _job

SPEC = {
    "name": "s",
    "job": {"instance_type": "local:box", "max_runtime": "1m"},
    "command": ["true"],
    "grid": {"lr": [0.1]},
}


def test_a_token_names_one_session_and_only_its_hash_is_kept(ledger):
    token = ledger.grant_agent("acme/vision/agent-7")
    assert ledger.agent_scope(token) == "acme/vision/agent-7"
    with ledger.engine.connect() as conn:
        stored = [tuple(r) for r in conn.execute(agent_grants.select())]
    assert stored and token not in repr(stored)
    for bad in ("", "gpub_forged", token + "x", "' OR 1=1 --"):
        with pytest.raises(BudgetInputError, match="unknown or revoked"):
            ledger.agent_scope(bad)
    assert ledger.revoke_agent("acme/vision/agent-7") == 1
    with pytest.raises(BudgetInputError, match="unknown or revoked"):
        ledger.agent_scope(token)


@pytest.mark.parametrize("scope", ["acme", "acme/vision", "acme/../x/y", "Acme/v/a"])
def test_tokens_are_granted_for_sessions_only(ledger, scope):
    with pytest.raises(BudgetInputError, match="scope"):
        ledger.grant_agent(scope)


def test_an_agent_spec_stays_in_its_session():
    assert agent_spec(SPEC, "acme/vision/agent-7").scope == "acme/vision/agent-7"
    for other in ("acme/vision", "acme/vision/agent-8", "acme"):
        with pytest.raises(BudgetInputError, match="may spend only in acme/vision/agent-7"):
            agent_spec({**SPEC, "scope": other}, "acme/vision/agent-7")
    with pytest.raises(ValueError, match="hourly_cap_usd"):  # no budget rides in on a spec
        agent_spec({**SPEC, "hourly_cap_usd": 1000}, "acme/vision/agent-7")


def test_an_agent_cancels_its_own_queued_jobs_and_no_one_elses(ledger):
    ledger.set_budget(BudgetRule("acme", hourly_cap_cents=360))
    ledger.request(_job("acme/vision/agent-7"))  # takes the whole cap
    mine, _ = ledger.request(_job("acme/vision/agent-7"))
    theirs, _ = ledger.request(_job("acme/vision/agent-8"))
    with pytest.raises(BudgetInputError, match="no job"):
        cancel_own_job(ledger, theirs, "acme/vision/agent-7")
    with pytest.raises(BudgetInputError, match="no job"):
        cancel_own_job(ledger, "not-a-job", "acme/vision/agent-7")
    assert ledger.job(theirs)["state"] == "queued"
    cancel_own_job(ledger, mine, "acme/vision/agent-7")
    assert ledger.job(mine)["state"] == "cancelled"
