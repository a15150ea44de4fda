"""What agents may run, and the flow that runs it: a sweep in the agent's own session.

Agents never call this flow themselves: they reach the gateway (`prefect_gpu_budget.gateway`)
with their token, and the gateway, a trusted client of a Prefect API closed to agents, starts
`agent-sweep/agents` with the session and the grant's id (never the token). The spec is checked
against the team's `AgentLimits` twice, by the same function: at the gateway (so a bad spec is a
422 and nothing starts) and here (so a run started around the gateway is held to them too).
Trials run sandboxed (`launchers.sandbox`), and each one queues only while the grant is live.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import pandas as pd
from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner
from sqlalchemy.exc import NoResultFound

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.blocks.ledger import SpendLedger
from prefect_gpu_budget.flows.sweep import SweepSpec, load_spec, run_sweep
from prefect_gpu_budget.models import AgentLimits
from prefect_gpu_budget.priorities import resolve
from prefect_gpu_budget.settings import agent_results_root
from prefect_gpu_budget.units import BudgetInputError, fmt_duration, org_of, shown


def limits_for(ledger: Ledger, session: str) -> AgentLimits:
    """The ceilings for the agents of `session`'s team: the admin's, or the defaults."""
    team = session.rsplit("/", 1)[0]
    return AgentLimits(team=team, **(ledger.agent_limits(team) or {}))


def agent_spec(
    spec: SweepSpec | dict[str, Any],
    scope: str,
    limits: AgentLimits,
    classes: Mapping[str, int] | None = None,
) -> SweepSpec:
    """The agent's spec homed in its session and held to its team's limits (`classes`: its
    org's priority classes by value, `Ledger.priority_values`); anything else is refused with the field and the
    rule (`BudgetInputError`), before anything is reserved."""
    if isinstance(spec, dict) and "scope" not in spec:
        spec = {**spec, "scope": scope}
    if isinstance(spec, dict) and isinstance(spec.get("job"), dict):
        spec = {**spec, "job": {"max_wait": limits.max_wait, **spec["job"]}}
    loaded = load_spec(spec)
    if loaded.scope != scope:
        raise BudgetInputError(
            "spec.scope", f"this agent may spend only in {scope}, not in {loaded.scope}"
        )
    if loaded.callable is not None and loaded.callable not in limits.callables:
        raise BudgetInputError(
            "callable", f"{shown(loaded.callable)} is not among the callables agents may run"
        )
    launcher = loaded.launcher or "local"
    if launcher not in limits.launchers:
        raise BudgetInputError(
            "launcher",
            f"{shown(launcher)} is not granted to agents of {limits.team} "
            f"(they may use {', '.join(limits.launchers) or 'none'})",
        )
    trials = len(loaded.trials())
    if trials > limits.max_trials:
        raise BudgetInputError(
            "grid", f"{trials} trials; agents of {limits.team} may run at most {limits.max_trials}"
        )
    if loaded.parallelism > max(1, limits.max_queued):
        raise BudgetInputError(
            "parallelism",
            f"at most {limits.max_queued} for agents of {limits.team} (the jobs a session may "
            f"have queued), got {loaded.parallelism}",
        )
    job = loaded.job_for({name: 0 for name in loaded.params()}, "check")
    priority = job.priority
    if isinstance(priority, str):
        priority = resolve(priority, classes or {}, org_of(scope))
    if priority > limits.max_priority:
        raise BudgetInputError(
            "job.priority",
            f"at most {limits.max_priority} for agents of {limits.team}, got {job.priority}",
        )
    if not job.max_wait or job.max_wait > limits.max_wait:
        raise BudgetInputError(
            "job.max_wait",
            f"agents of {limits.team} wait at most {fmt_duration(limits.max_wait)} "
            f"(0, forever, is not theirs to ask), got {fmt_duration(job.max_wait or 0)}",
        )
    path = PurePosixPath(loaded.results_dir)
    if path.is_absolute() or ".." in path.parts or "\\" in loaded.results_dir:
        raise BudgetInputError(
            "results_dir", f"must be a relative path without '..', got {shown(loaded.results_dir)}"
        )
    return loaded


def agent_results(session: str) -> Path:
    """Where an agent session's sweeps keep their results (a fixed root an admin sets)."""
    return agent_results_root().joinpath(*session.split("/"))


def sandboxed_launcher(spec: SweepSpec) -> Any:
    """The launcher an agent's trials run on: a granted block, or sandboxed local processes."""
    from prefect_gpu_budget.launchers.local import LocalLauncher
    from prefect_gpu_budget.launchers.registry import launcher_for
    from prefect_gpu_budget.launchers.sandbox import Sandbox

    if spec.launcher is not None:
        return launcher_for(spec.launcher)
    return LocalLauncher(sandbox=Sandbox.from_env())


@flow(name="agent-sweep", task_runner=ThreadPoolTaskRunner(max_workers=64))
def agent_sweep(spec: dict[str, Any], session: str, grant: str) -> pd.DataFrame:
    """A GPU sweep in an agent's session, started by the gateway.

    No ledger or launcher parameter on purpose: an agent must not point the gate at a ledger of
    its own. The ledger is the deployment's (`PREFECT_GPU_BUDGET_LEDGER_URL` or the default).
    """
    led = SpendLedger().ledger()
    if led.grant_scope(grant) != session:
        raise BudgetInputError("grant", f"no live agent grant for {session}")
    checked = agent_spec(spec, session, limits_for(led, session), led.priority_values(session))
    return run_sweep(
        checked, None, sandboxed_launcher(checked), grant=grant, results_root=agent_results(session)
    )


def cancel_own_job(ledger: Ledger, job_id: str, scope: str) -> str:
    """Cancel a queued job of session `scope`; another session's job is refused untouched."""
    try:
        row = ledger.job(job_id)
    except NoResultFound:
        row = None
    if row is None or row["scope"] != scope:
        raise LookupError(f"no job {job_id[:36]!r} in {scope}")
    if not ledger.cancel_queued(job_id, scope, "cancelled by its agent"):
        raise BudgetInputError(
            "job_id", f"job {job_id[:8]} is {row['state']}: only a queued job can be cancelled"
        )
    return job_id
