"""The flows agents call: a sweep and a cancel, bound to the agent's own session by its token.

An admin grants a token per session (`prefect-gpu-budget agent grant acme/vision/agent-7`).
These flows take no scope and no budget: the scope comes from the token, the session's budget
from what the admin set or its team's session template. So an agent can spend only in its own
session, cannot raise a cap or create a budget, and cannot touch another session's jobs.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from prefect import flow, get_run_logger
from pydantic import SecretStr
from sqlalchemy.exc import NoResultFound

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.blocks.ledger import SpendLedger
from prefect_gpu_budget.flows.sweep import SweepSpec, gpu_sweep, load_spec
from prefect_gpu_budget.units import BudgetInputError


def _secret(token: SecretStr | str) -> str:
    return token.get_secret_value() if isinstance(token, SecretStr) else str(token)


def agent_spec(spec: SweepSpec | dict[str, Any] | str, scope: str) -> SweepSpec:
    """The agent's spec homed in its session; a spec naming any other scope is refused."""
    if isinstance(spec, dict) and "scope" not in spec:
        spec = {**spec, "scope": scope}
    loaded = load_spec(spec)
    if loaded.scope != scope:
        raise BudgetInputError(
            "spec.scope", f"this agent may spend only in {scope}, not in {loaded.scope}"
        )
    return loaded


@flow(name="agent-sweep")
def agent_sweep(spec: dict[str, Any], agent_token: SecretStr) -> pd.DataFrame:
    """A GPU sweep in the calling agent's own session (the scope comes from its token).

    No ledger parameter on purpose: an agent must not point the gate at a ledger of its own.
    The ledger is the deployment's (`PREFECT_GPU_BUDGET_LEDGER_URL` or the default).
    """
    scope = SpendLedger().ledger().agent_scope(_secret(agent_token))
    return gpu_sweep(agent_spec(spec, scope))


def cancel_own_job(ledger: Ledger, job_id: str, scope: str) -> str:
    """Cancel a queued job of session `scope`; another session's job is refused untouched."""
    try:
        row = ledger.job(job_id)
    except NoResultFound:
        row = None
    if row is None or row["scope"] != scope:
        raise BudgetInputError("job_id", f"no job {job_id[:36]!r} in {scope}")
    if not ledger.cancel_queued(job_id, scope, "cancelled by its agent"):
        raise BudgetInputError(
            "job_id", f"job {job_id[:8]} is {row['state']}: only a queued job can be cancelled"
        )
    return job_id


@flow(name="agent-cancel")
def agent_cancel(job_id: str, agent_token: SecretStr) -> str:
    """Cancel one of the calling agent's own queued jobs."""
    led = SpendLedger().ledger()
    scope = led.agent_scope(_secret(agent_token))
    cancel_own_job(led, job_id, scope)
    get_run_logger().info("cancelled job %s in %s", job_id[:8], scope)
    return job_id
