"""`reconcile` as a flow, to schedule every few minutes: settles what crashed holders left."""

from __future__ import annotations

from prefect import flow, get_run_logger

from prefect_gpu_budget.admission.limits import RateLimits
from prefect_gpu_budget.admission.reconcile import reconcile
from prefect_gpu_budget.admission.rules.timing import STALE_AFTER_S
from prefect_gpu_budget.blocks.ledger import SpendLedger
from prefect_gpu_budget.units import fmt_usd


@flow(name="gpu-budget-reconcile")
def reconcile_flow(
    ledger: SpendLedger | None = None, stale_after_s: float = STALE_AFTER_S
) -> list[dict]:
    """Settle reservations whose holders are gone. Safe to run often and concurrently."""
    logger = get_run_logger()
    limits = RateLimits()
    try:
        done = reconcile((ledger or SpendLedger()).ledger(), limits, stale_after=stale_after_s)
    finally:
        limits.close()
    for item in done:
        logger.info(
            "%s %s: %s (%s)", item.job_id[:8], item.scope, item.action, fmt_usd(item.actual_micro)
        )
    logger.info("%d job(s) reconciled", len(done))
    return [item.__dict__ for item in done]
