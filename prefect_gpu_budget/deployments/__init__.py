"""Deployments: a nightly sweep, a daily spend report, the cloud's bill imported daily,
reconcile every few minutes.

`prefect-gpu-budget serve` runs them in one process (`flow.serve`); `prefect-gpu-budget deploy`
registers them on a work pool; `prefect.yaml` beside this file does the same for `prefect deploy`.

Both register the same names (`gpu-sweep/sweep`, ...), and Prefect's upsert keeps what it is not
told: a deployment served after `deploy` kept the work pool, and its runs, missing the served
code's path, crashed. So each makes the deployments its own, in place (their id and runs kept):
serving one clears its work pool, pull steps and storage (`ServedDeployment`), deploying one
that was served puts it back on the pool, and each says so in one line.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import DeploymentUpdate
from prefect.deployments.runner import RunnerDeployment
from prefect.exceptions import ObjectNotFound
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

log = logging.getLogger(__name__)


class ServedDeployment(RunnerDeployment):
    """A deployment this process serves. Registering it (`aapply`, what `prefect.serve` and
    the runner call) first takes over a deployment of its name that `deploy` put on a work pool:
    Prefect's upsert would keep that one's work pool, storage and path (pull steps it clears),
    and the served runs would load the flow from no path."""

    async def aapply(self, *args: Any, **kwargs: Any) -> UUID:
        await self._take_over()
        return await super().aapply(*args, **kwargs)

    async def _take_over(self) -> None:
        """Clear the work pool, queue, pull steps, storage and job variables of the deployment
        of this name, and set the served flow's path, saying so; none there: nothing."""
        async with get_client() as client:
            try:
                found = await client.read_deployment_by_name(self.full_name)
            except ObjectNotFound:
                return
            if not (found.work_pool_name or found.pull_steps or found.storage_document_id):
                return
            where = (
                f"to work pool {found.work_pool_name}"
                if found.work_pool_name
                else "with pull steps or storage"
            )
            log.warning("%s was deployed %s; serving takes it over here", self.full_name, where)
            update = DeploymentUpdate(
                work_pool_name=None,  # explicitly none: the server unroutes it from the pool
                work_queue_name=None,
                pull_steps=None,
                storage_document_id=None,
                job_variables={},
                path=self._path,  # what Prefect gives a served deployment it creates
                entrypoint=self.entrypoint,
            )
            await client.update_deployment(found.id, update)


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

    def build(flow: Any, **options: Any) -> RunnerDeployment:
        if from_source:
            return flow.to_deployment(**options)
        return ServedDeployment.from_flow(flow, **options)  # as `flow.to_deployment` does

    return [
        build(
            sweep,
            name=SWEEP,
            parameters={"spec": spec},
            schedules=[Cron(sweep_cron, timezone="UTC", parameters={"spec": spec})],
            description="A GPU sweep under budget, for admins and schedules (agents use the gateway).",
        ),
        build(report, name=REPORT, schedules=[Cron(report_cron, timezone="UTC")]),
        build(reconcile, name=RECONCILE, schedules=[Interval(reconcile_every_s)]),
        build(
            agent_run,
            name=AGENT,
            description="A GPU sweep in an agent's session, started by the gateway.",
        ),
        build(
            bill,
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
    """Register the deployments on a work pool, running this package's installed source. One
    that `serve` registered becomes the pool's (Prefect's upsert sets the pool and pull steps);
    a line says so, as a `serve` still running would run its runs too."""
    from prefect.deployments.runner import deploy as prefect_deploy

    built = deployments(from_source=True, **kwargs)
    _say_served(built, work_pool)
    return list(
        prefect_deploy(
            *built,
            work_pool_name=work_pool,
            build=False,
            push=False,
        )
    )


def _say_served(found: list[Any], work_pool: str) -> None:
    """One line for each of `found` that is on the server served (no work pool, no pull steps)."""
    with get_client(sync_client=True) as client:
        for deployment in found:
            try:
                there = client.read_deployment_by_name(deployment.full_name)
            except ObjectNotFound:
                continue
            if not (there.work_pool_name or there.pull_steps or there.storage_document_id):
                log.warning(
                    "%s was served; work pool %s takes it over (stop a `serve` still running, "
                    "or it runs its runs too)",
                    deployment.full_name,
                    work_pool,
                )
