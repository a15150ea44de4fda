"""The gate's job variables, one set for every gated worker type: what a pool's template
adds (`GateVariables`), what a job configuration carries (`GateConfiguration`, which turns them
into a `GpuJob`), and the rule for a run's own job variables (`overrides_refusal`), applied to
the very variables its configuration was built from (`GateConfiguration.resolve_for_flow_run`
notes them as the worker merges them): what is checked is what runs."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field, PrivateAttr

from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.pricing.catalog import Quote
from prefect_gpu_budget.units import BudgetInputError, narrowing_refusal, validate_scope

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

GATE_VARIABLES = (
    "instance_type",
    "scope",
    "max_runtime",
    "nodes",
    "priority",
    "max_wait",
    "provisioning",
    "requeue",
    "require_agent_token",
    "run_may_set",
)
"""The gate's job variables a flow run may not set itself (`scope` it may narrow), nor its
deployment allow it to (`run_may_set`)."""
RUN_VARIABLES = ("scope", "agent_token")
"""What a flow run may always set itself: `scope`, only to narrow its deployment's, and
`agent_token`, which only binds the run to its agent's session within that scope. With
`GATE_VARIABLES`, every one of `GateVariables`."""


class GateVariables(BaseModel):
    """The job variables every gated worker type adds to its pool's base job template."""

    instance_type: str | None = Field(
        default=None, description="What the run's machine is priced as, e.g. `local:a100x1`."
    )
    scope: str | None = Field(default=None, description="The budget scope the run spends in.")
    max_runtime: str | None = Field(
        default=None, description="The longest the run may take, e.g. '2h'; it is stopped then."
    )
    nodes: int = Field(default=1, description="Machines the run takes.")
    priority: str | int = Field(default=0, description="A priority class or -1000..1000.")
    max_wait: str | None = Field(
        default=None, description="The longest the run waits at the gate (default: the budget's)."
    )
    provisioning: str = Field(default="on-demand", description="on-demand, spot or flex-start.")
    requeue: bool = Field(
        default=True,
        description="Schedule the run again (it passes the gate anew) when capacity it "
        "borrowed in a pool is taken back; else it ends Preempted.",
    )
    require_agent_token: bool = Field(
        default=False,
        description="Runs must carry an agent's token (agent_token) and spend in its session.",
    )
    agent_token: str | None = Field(
        default=None,
        description="An agent's token (`prefect-gpu-budget agent grant`): the run spends in "
        "the token's session only. Set per run, by the agent or its gateway.",
    )
    run_may_set: list[str] = Field(
        default_factory=list,
        description="Job variables a flow run may set itself, e.g. ['stream_output']; a run "
        "that sets any other (command, env, ...) is refused. Never the gate's own.",
    )


class GateConfiguration(BaseModel):
    """The gate's part of a job configuration (filled from `GateVariables`)."""

    instance_type: str | None = Field(default=None)
    scope: str | None = Field(default=None)
    max_runtime: str | None = Field(default=None)
    nodes: int = Field(default=1)
    priority: str | int = Field(default=0)
    max_wait: str | None = Field(default=None)
    provisioning: str = Field(default="on-demand")
    requeue: bool = Field(default=True)
    require_agent_token: bool = Field(default=False)
    agent_token: str | None = Field(default=None)
    _run_refusal: str | None = PrivateAttr(default=None)
    """Why the flow run's own job variables may not be used ("" if they may); None until
    `resolve_for_flow_run` checked them."""

    @classmethod
    async def resolve_for_flow_run(
        cls, flow_run: FlowRun, *, client: Any, work_pool: Any, deployment: Any = None, **kw: Any
    ) -> Any:
        """The worker's configuration for `flow_run` (Prefect's merge of the run's job
        variables over its deployment's, over the pool's), with the rule for the run's own
        variables applied to the very values merged (`overrides_refusal`): read before the
        merge, which takes `env` out of them, and from the same snapshot of the run."""
        if deployment is None and flow_run.deployment_id:
            deployment = await client.read_deployment(flow_run.deployment_id)
        run_variables = copy.deepcopy(dict(flow_run.job_variables or {}))
        deployed = dict(getattr(deployment, "job_variables", None) or {})
        refusal = overrides_refusal(
            run_variables,
            deployed.get("scope") or pool_default(work_pool, "scope"),
            deployed.get("run_may_set", pool_default(work_pool, "run_may_set")) or [],
        )
        configuration = await super().resolve_for_flow_run(  # type: ignore[misc]
            flow_run, client=client, work_pool=work_pool, deployment=deployment, **kw
        )
        configuration._run_refusal = refusal
        return configuration

    @property
    def run_refusal(self) -> str | None:
        """Why the flow run's own job variables may not be used ("" if they may); None when
        this configuration was built some other way than `resolve_for_flow_run`."""
        return self._run_refusal

    def gpu_job(self, name: str) -> tuple[GpuJob, str]:
        """The job and scope this run asks for; a one-line `BudgetInputError` if unusable."""
        if not self.scope or not self.instance_type or not self.max_runtime:
            raise BudgetInputError(
                "job_variables",
                "instance_type, scope and max_runtime must be set on the pool or the deployment",
            )
        job = GpuJob(
            instance_type=self.instance_type,
            max_runtime=self.max_runtime,
            nodes=self.nodes,
            priority=self.priority,
            max_wait=self.max_wait,
            provisioning=self.provisioning,
            requeue=self.requeue,
            name=name,
        )
        return job, validate_scope(self.scope)

    def preflight(self, job: GpuJob, quote: Quote) -> None:
        """What a worker type checks of the job before it is admitted (`LaunchConfigError`)."""


def overrides_refusal(
    run_variables: dict[str, Any], deployed_scope: str | None, may_set: Any = ()
) -> str:
    """Why a flow run's own job variables may not be used ("" if they may): a run may narrow
    its deployment's scope to a sub-scope, carry an agent's token, and set what its deployment
    lists in `may_set` (its `run_may_set`); nothing else, of the gate's or of the worker
    type's (`command`, `env`, `working_dir`, `image`, ...). A list naming one of the gate's
    own variables is refused as it stands."""
    if not isinstance(may_set, (list, tuple)) or not all(isinstance(k, str) for k in may_set):
        return f"run_may_set: must be a list of job variable names, got {may_set!r:.80}"
    for key in may_set:
        if key in GATE_VARIABLES or key in RUN_VARIABLES:
            return f"run_may_set: {key} is the gate's; a run can never set it"
    for key, value in run_variables.items():
        if key == "scope":
            if why := narrowing_refusal(str(value), deployed_scope, "the deployment's"):
                return why
        elif key in GATE_VARIABLES:
            return f"job variable {key} is the deployment's to set, not a run's"
        elif key not in RUN_VARIABLES and key not in may_set:
            return (
                f"job variable {key} is the deployment's to set, not a run's (the "
                "deployment's run_may_set does not list it)"
            )
    return ""


def pool_default(work_pool: Any, key: str) -> Any:
    variables = (getattr(work_pool, "base_job_template", None) or {}).get("variables", {})
    return (variables.get("properties", {}).get(key) or {}).get("default")
