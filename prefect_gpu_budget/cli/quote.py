"""`quote`: what a job shape costs, priced from the dated catalog as the gate prices it."""

from __future__ import annotations

import typer

from prefect_gpu_budget.cli.app import app
from prefect_gpu_budget.cli.common import console
from prefect_gpu_budget.units import fmt_usd

ACCELERATORS = typer.Option(
    None,
    help="Accelerators instead of a machine (H100:8, or {H100:8, H200:8}): every offering of "
    "the saved launchers and pools, and the one the gate would choose.",
)
SCOPE = typer.Option(
    None, help="With --accelerators: the budgets and pool quota the offering must fit."
)
RESUMABLE = typer.Option(
    False, help="With --accelerators: the job resumes from a checkpoint when interrupted."
)


@app.command()
def quote(
    instance_type: str = typer.Argument(
        None, help="cloud:type, e.g. aws:p4d.24xlarge (or --accelerators instead)."
    ),
    nodes: int = typer.Option(1, min=1, max=1024),
    hours: str = typer.Option("1", help="Runtime in hours (or a duration like '90m')."),
    provisioning: str = typer.Option("on-demand", help="on-demand, spot or flex-start."),
    gpus: int = typer.Option(None, help="A part of each machine: its GPUs."),
    vcpu: int = typer.Option(None, help="A part of each machine: its vCPU."),
    memory_gib: int = typer.Option(None, help="A part of each machine: its memory, GiB."),
    accelerators: str = ACCELERATORS,
    deadline: str = typer.Option(None, help="With --accelerators: the latest end, e.g. 12h."),
    max_wait: str = typer.Option(None, help="With --accelerators: the longest wait to start."),
    scope: str = SCOPE,
    resumable: bool = RESUMABLE,
    as_json: bool = typer.Option(False, "--json", help="With --accelerators: JSON."),
) -> None:
    """Price a job shape from the dated catalog (a whole machine, or a part of one), as the
    gate and `forecast` price it (`admission.prices.price_job`); or, with --accelerators, show
    where the gate would place it and why."""
    from prefect_gpu_budget.units import cost_micro, parse_duration

    seconds = parse_duration(
        hours if not hours.replace(".", "", 1).isdigit() else f"{hours}h", "hours"
    )
    if accelerators is not None:
        from prefect_gpu_budget.cli.placement import quote_placement

        asked = {"deadline": deadline, "max_wait": max_wait, "vcpu": vcpu}
        quote_placement(
            accelerators,
            nodes,
            seconds,
            scope,
            resumable,
            as_json,
            {**asked, "memory_gib": memory_gib},
        )
        return
    if instance_type is None:
        from prefect_gpu_budget.units import BudgetInputError

        raise BudgetInputError("instance_type", "name a machine (cloud:type) or --accelerators")
    from prefect_gpu_budget.admission.prices import price_job
    from prefect_gpu_budget.pricing.catalog import Machines

    if gpus is None and vcpu is None and memory_gib is None:
        q, part = price_job(Machines(instance_type, nodes, provisioning))
    else:  # the job model (pydantic) only for a part: a whole machine's quote stays quick
        from prefect_gpu_budget.job import GpuJob

        q, part = price_job(
            GpuJob(
                instance_type=instance_type,
                nodes=nodes,
                provisioning=provisioning,
                max_runtime=seconds,
                gpus=gpus,
                vcpu=vcpu,
                memory_gib=memory_gib,
            )
        )
    per_node = f"{q.row.gpus}x {q.row.gpu_model} per node"
    if part is not None and not part.whole:
        per_node = f"{part.fraction} of each node's price (of {per_node})"
    console.print(
        f"{q.describe()}  {per_node}\n"
        f"{seconds / 3600:g} h: {fmt_usd(cost_micro(q.rate_micro_per_hour, seconds, round_up=True))}"
        f"  (price from {q.row.source}, {q.row.as_of})"
    )
    for warning in q.warnings:
        console.print(f"[yellow]warning:[/] {warning}")
