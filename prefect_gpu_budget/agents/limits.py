"""What agents may do, in one place: the limits on a team's agents, the check of an agent's
spec against them and against what the worker can run, and stopping an agent's own job.

Used by the gateway (REST and MCP, `agents.door`) before anything starts, and by the
`agent-sweep` flow again (so a run started around the gateway is held to the same rules).
Imports no Prefect and no flow module.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from sqlalchemy.exc import NoResultFound

from prefect_gpu_budget.admission.admin_settings import AgentLimits
from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.stopping import stop_job
from prefect_gpu_budget.priorities import resolve
from prefect_gpu_budget.settings import agent_results_root
from prefect_gpu_budget.sweeps.spec import SweepSpec, load_spec, preflight
from prefect_gpu_budget.units import BudgetInputError, fmt_duration, org_of, shown

STOPPED_BY_AGENT = "stopped by its agent"
"""The reason on an agent's job that it stopped while it ran."""


def agent_spec(
    spec: SweepSpec | dict[str, Any],
    scope: str,
    limits: AgentLimits,
    classes: Mapping[str, int] | None = None,
) -> SweepSpec:
    """The agent's spec homed in its session and held to its team's limits (`classes`: its
    org's priority classes by value, `Ledger.config.priority_values`); anything else is refused
    with the field and the rule (`BudgetInputError`), before anything is reserved. Four steps:
    1. homed in the session; 2. its callable, launcher and size granted; 3. its trials' job
    (shape, priority, wait) within the limits; 4. its results kept under the session's."""
    loaded = _homed(spec, scope, limits)
    launcher = _check_grants(loaded, limits)
    _check_job(loaded, launcher, limits, classes, scope)
    path = PurePosixPath(loaded.results_dir)
    if path.is_absolute() or ".." in path.parts or "\\" in loaded.results_dir:
        raise BudgetInputError(
            "results_dir", f"must be a relative path without '..', got {shown(loaded.results_dir)}"
        )
    return loaded


def _homed(spec: SweepSpec | dict[str, Any], scope: str, limits: AgentLimits) -> SweepSpec:
    """The spec loaded in the session `scope` (its own scope must be that one), its jobs
    waiting at most the team's max_wait unless they say otherwise."""
    if isinstance(spec, dict) and "scope" not in spec:
        spec = {**spec, "scope": scope}
    if isinstance(spec, dict) and isinstance(spec.get("job"), dict):
        spec = {**spec, "job": {"max_wait": limits.max_wait, **spec["job"]}}
    loaded = load_spec(spec)
    if loaded.scope != scope:
        raise BudgetInputError(
            "spec.scope", f"this agent may spend only in {scope}, not in {loaded.scope}"
        )
    return loaded


def _check_grants(loaded: SweepSpec, limits: AgentLimits) -> str:
    """The spec's callable and launcher are granted to the team's agents, and its trials and
    parallelism within their limits; its launcher's name."""
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
    return launcher


def _check_job(
    loaded: SweepSpec,
    launcher: str,
    limits: AgentLimits,
    classes: Mapping[str, int] | None,
    scope: str,
) -> None:
    """The trials' job: a whole machine on the local launcher, a priority and a wait within
    the team's limits."""
    job = loaded.job_for({name: 0 for name in loaded.params()}, "check")
    if launcher == "local" and (job.gpus, job.vcpu, job.memory_gib) != (None, None, None):
        raise BudgetInputError(  # priced as a part, nothing would hold it to that part
            "job.gpus",
            "an agent's job runs on the local launcher's whole machine: nothing here holds a "
            "sandboxed job to a part of its GPUs, so a part (gpus, vcpu, memory_gib) is not "
            "priced as one",
        )
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


def agent_results(session: str) -> Path:
    """Where an agent session's sweeps keep their results (a fixed root an admin sets). The
    root is the worker's alone (0700): the sessions' users, which run the agents' jobs, read no
    session's results from the disk (agents read their own through the gateway)."""
    from prefect_gpu_budget.sandbox.users import private_folder

    return private_folder(agent_results_root(), parents=True).joinpath(*session.split("/"))


def runnable(spec: SweepSpec) -> None:
    """Refuse (`BudgetInputError`, naming the field) what the flow would refuse before its
    first trial (`sweeps.spec.preflight`) on the launcher the agent's trials run on. Checked with
    this process's settings: run the gateway with the agent worker's
    (`PREFECT_GPU_BUDGET_AGENT_*`, `PREFECT_GPU_BUDGET_LOCAL_MACHINE`)."""
    try:
        launcher = sandboxed_launcher(spec)
    except Exception as exc:  # a block that is not there, or will not load
        raise BudgetInputError(
            "launcher", f"{shown(spec.launcher)} cannot be used: {type(exc).__name__}"
        ) from None
    if launcher is None:
        raise BudgetInputError("launcher", f"no launcher {shown(spec.launcher)} here")
    preflight(spec, launcher)


def sandboxed_launcher(spec: SweepSpec) -> Any:
    """The launcher an agent's trials run on: a granted block, or sandboxed local processes."""
    from prefect_gpu_budget.launchers.local import LocalLauncher
    from prefect_gpu_budget.launchers.registry import launcher_for
    from prefect_gpu_budget.sandbox.launcher import Sandbox

    if spec.launcher is not None:
        return launcher_for(spec.launcher)
    return LocalLauncher(sandbox=Sandbox.from_env())


def stop_own_job(ledger: Ledger, job_id: str, scope: str) -> str:
    """Stop a job of session `scope` (`admission.stopping.stop_job`): `cancelled` or
    `stopping`; another session's job is refused untouched (`LookupError`), an ended one is a
    `BudgetInputError`."""
    try:
        row = ledger.views.job(job_id)
    except NoResultFound:
        row = None
    if row is None or row["scope"] != scope:
        raise LookupError(f"no job {job_id[:36]!r} in {scope}")
    became = stop_job(ledger, job_id, scope, STOPPED_BY_AGENT)
    if became is None:
        raise BudgetInputError("job_id", f"job {job_id[:8]} is {row['state']}: it has ended")
    return became
