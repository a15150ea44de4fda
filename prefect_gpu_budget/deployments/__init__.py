"""Deployments: a nightly sweep, a daily spend report, the cloud's bill imported daily,
reconcile every few minutes.

`prefect-gpu-budget serve` runs them in one process (`flow.serve`); `prefect-gpu-budget deploy`
registers them on a work pool; `prefect.yaml` beside this file does the same for `prefect deploy`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect.schedules import Cron, Interval

from prefect_gpu_budget.flows.agent import agent_sweep
from prefect_gpu_budget.flows.bill_import import bill_import
from prefect_gpu_budget.flows.reconcile import reconcile_flow
from prefect_gpu_budget.flows.spend_report import spend_report
from prefect_gpu_budget.sweeps.flow import gpu_sweep
from prefect_gpu_budget.sweeps.spec import SweepSpec

SWEEP = "sweep"
REPORT = "daily"
RECONCILE = "every-5-minutes"
AGENT = "agents"
EXAMPLE_SPEC = Path(__file__).with_name("nightly-sweep.yaml")


ROOT = Path(__file__).resolve().parents[2]
"""The folder that holds the package: a worker on this machine loads the flows from here."""


def _flows(from_source: bool) -> tuple[Any, ...]:
    flows = (
        (gpu_sweep, "sweeps/flow.py:gpu_sweep"),
        (spend_report, "flows/spend_report.py:spend_report"),
        (reconcile_flow, "flows/reconcile.py:reconcile_flow"),
        (agent_sweep, "flows/agent.py:agent_sweep"),
        (bill_import, "flows/bill_import.py:bill_import"),
    )
    if not from_source:
        return tuple(flow for flow, _ in flows)
    return tuple(
        flow.from_source(source=str(ROOT), entrypoint=f"prefect_gpu_budget/{entry}")
        for flow, entry in flows
    )


def deployments(
    sweep_spec: str | Path = EXAMPLE_SPEC,
    sweep_cron: str = "0 2 * * *",
    report_cron: str = "0 7 * * *",
    reconcile_every_s: int = 300,
    from_source: bool = False,
    bill_cron: str = "0 6 * * *",
) -> list[Any]:
    """The deployments, ready for `prefect.serve` (or, `from_source`, for a work pool).

    The sweep's schedule carries its own parameters (the spec). `agent-sweep/agents` is started
    by the agent gateway with the agent's session and grant (agents hold no Prefect access).
    `gpu-budget-bill-import/daily` reads the `BillingExport` block named `default` (none saved:
    it says so and imports nothing).
    """
    spec = SweepSpec.from_yaml(sweep_spec).model_dump(mode="json")
    sweep, report, reconcile, agent_run, bill = _flows(from_source)
    return [
        sweep.to_deployment(
            name=SWEEP,
            parameters={"spec": spec},
            schedules=[Cron(sweep_cron, timezone="UTC", parameters={"spec": spec})],
            description="A GPU sweep under budget, for admins and schedules (agents use the gateway).",
        ),
        report.to_deployment(name=REPORT, schedules=[Cron(report_cron, timezone="UTC")]),
        reconcile.to_deployment(name=RECONCILE, schedules=[Interval(reconcile_every_s)]),
        agent_run.to_deployment(
            name=AGENT, description="A GPU sweep in an agent's session, started by the gateway."
        ),
        bill.to_deployment(
            name=REPORT,
            schedules=[Cron(bill_cron, timezone="UTC")],
            description="The cloud's bill, imported from the BillingExport block `default`.",
        ),
    ]


def serve(**kwargs: Any) -> None:
    """Run the deployments in this process until stopped (polls the Prefect API for runs)."""
    from prefect import serve as prefect_serve

    prefect_serve(*deployments(**kwargs))


def deploy(work_pool: str, **kwargs: Any) -> list[Any]:
    """Register the deployments on a work pool, running this package's installed source."""
    from prefect.deployments.runner import deploy as prefect_deploy

    return list(
        prefect_deploy(
            *deployments(from_source=True, **kwargs),
            work_pool_name=work_pool,
            build=False,
            push=False,
        )
    )
