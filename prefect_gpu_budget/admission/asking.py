"""What the gate records of a job asking to be admitted (`asking`): the job priced, and the
ledger's row of it (`NewJob`), holder and launcher named."""

from __future__ import annotations

from prefect_gpu_budget.admission.ledger import NewJob, holder_id
from prefect_gpu_budget.admission.prices import price_job
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.pricing.catalog import Catalog, Quote
from prefect_gpu_budget.units import rate_cents


def asking(
    job: GpuJob,
    scope: str,
    catalog: Catalog | None,
    *,
    flow_run_id: str | None = None,
    launcher: str = "local",
) -> tuple[Quote, NewJob]:
    """A job asking to be admitted in `scope`: its price (`price_job`, taken once) and what the
    gate records of it."""
    quote, share = price_job(job, catalog)
    return quote, NewJob(
        scope=scope,
        name=job.name or job.instance_type,
        instance_type=job.instance_type,
        provisioning=job.provisioning,
        nodes=job.nodes,
        rate_micro_per_hour=quote.rate_micro_per_hour,
        rate_cents=rate_cents(quote.rate_micro_per_hour),
        priority=job.priority if isinstance(job.priority, int) else 0,
        priority_class=job.priority if isinstance(job.priority, str) else None,
        max_runtime_s=job.reserve_runtime_s,
        expected_runtime_s=job.expected_runtime,
        holder=holder_id(),
        launcher=launcher,
        on_limit=job.on_limit,
        max_wait_s=job.max_wait,
        flow_run_id=flow_run_id,
        pool=job.pool,
        node_gpus=share.gpus,
        node_vcpu=share.vcpu,
        node_memory_gib=share.memory_gib,
        partial=not share.whole,
        grant=job.grant,
        choice=job.choice,
    )
