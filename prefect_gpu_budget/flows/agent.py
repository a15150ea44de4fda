"""The flow that runs an agent's sweep in its own session (`agent-sweep/agents`).

Agents never call this flow themselves: they reach the gateway (`prefect_gpu_budget.agents`)
with their token, and the gateway, a trusted client of a Prefect API closed to agents, starts
`agent-sweep/agents` with the session and the grant's id (never the token). The spec is checked
against the team's `AgentLimits` twice, by the same rules (`agents.limits`): at the gateway (so a
bad spec is a 422 and nothing starts) and here (so a run started around the gateway is held to
them too). Trials run sandboxed (`sandbox.launcher`), and each one queues only while the grant
is live.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from prefect_gpu_budget.admission.admin_settings import limits_for
from prefect_gpu_budget.agents.limits import (
    agent_results,
    agent_spec,
    runnable,
    sandboxed_launcher,
)
from prefect_gpu_budget.blocks.ledger import SpendLedger
from prefect_gpu_budget.sweeps.flow import run_sweep
from prefect_gpu_budget.units import BudgetInputError


@flow(name="agent-sweep", task_runner=ThreadPoolTaskRunner(max_workers=64))
def agent_sweep(spec: dict[str, Any], session: str, grant: str) -> pd.DataFrame:
    """A GPU sweep in an agent's session, started by the gateway.

    No ledger or launcher parameter on purpose: an agent must not point the gate at a ledger of
    its own. The ledger is the deployment's (`PREFECT_GPU_BUDGET_LEDGER_URL` or the default).
    """
    led = SpendLedger().ledger()
    if led.grants.grant_scope(grant) != session:
        raise BudgetInputError("grant", f"no live agent grant for {session}")
    checked = agent_spec(
        spec, session, limits_for(led.grants, session), led.config.priority_values(session)
    )
    runnable(checked)
    return run_sweep(
        checked, None, sandboxed_launcher(checked), grant=grant, results_root=agent_results(session)
    )
