"""The daily import of the cloud's bill (`bill-import/daily`), and what an import tells: a
closed period over its budget by the bill, and a job's bill held for an admin to accept, each as
a Prefect event and a notification.

The flow reads a `BillingExport` block (by name, `default` unless told) for the periods the
providers may still restate (`billing.trueup.periods_to_read`), imports each whole
(`billing.imports.import_export`), and publishes the drift per scope as a table artifact.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.events import emit_event

from prefect_gpu_budget.billing.imports import import_export
from prefect_gpu_budget.billing.results import (
    BillImport,
    HeldBill,
    OverByBill,
    held_line,
    over_line,
    summary,
)
from prefect_gpu_budget.billing.trueup import periods_to_read
from prefect_gpu_budget.blocks.billing import BillingExport
from prefect_gpu_budget.blocks.ledger import SpendLedger
from prefect_gpu_budget.units import micro_to_usd

OVER_BY_BILL_EVENT = "gpu-budget.period.over-by-bill"
HELD_EVENT = "gpu-budget.bill.held"


def _notify(ledger: Any, scope: str, body: str, subject: str) -> None:
    """A notification through the nearest budget on `scope`'s path that names a block."""
    from prefect.blocks.core import Block

    targets = [r.notify_block for r in reversed(ledger.config.path_budgets(scope))]
    targets = [t for t in targets if t]
    if targets:
        Block.load(targets[0]).notify(body=body, subject=subject)


def _announce(
    ledger: Any,
    event: str,
    kind: str,
    what: str,
    scope: str,
    payload: dict,
    line: str,
    subject: str,
) -> None:
    """A Prefect event on the resource `gpu-budget.<kind>.<what>` of `scope`, and `line` as a
    notification through the nearest budget on its path that names a notification block."""
    emit_event(
        event=event,
        resource={
            "prefect.resource.id": f"gpu-budget.{kind}.{what}",
            "prefect.resource.name": what,
            "gpu-budget.scope": scope,
        },
        payload=payload,
    )
    _notify(ledger, scope, line, subject)


def announce_held(ledger: Any, held: list[HeldBill]) -> None:
    """For each job's bill held for an admin (far past its reservation): a Prefect event and
    a notification, saying how to accept it (`prefect-gpu-budget bill accept JOB`)."""
    for item in held:
        payload = {"billed_usd": micro_to_usd(item.billed_micro), "reason": item.reason}
        subject = f"GPU budget: a bill held in {item.scope}"
        _announce(
            ledger, HELD_EVENT, "job", item.job_id, item.scope, payload, held_line(item), subject
        )


def announce_over_by_bill(ledger: Any, marks: list[OverByBill]) -> None:
    """For each closed period the bill put over its budget: a Prefect event, and a
    notification through the nearest budget on its path that names a notification block."""
    for mark in marks:
        payload = {
            "period_start": mark.period_start,
            "period_end": mark.period_end,
            "budget_usd": micro_to_usd(mark.budget_micro),
            "spent_usd": micro_to_usd(mark.spent_micro),
        }
        subject = f"GPU budget: {mark.scope} over by the bill"
        _announce(
            ledger,
            OVER_BY_BILL_EVENT,
            "scope",
            mark.scope,
            mark.scope,
            payload,
            over_line(mark),
            subject,
        )


@flow(name="gpu-budget-bill-import")
def bill_import(
    export: str = "default",
    periods: list[str] | None = None,
    ledger: SpendLedger | None = None,
) -> list[dict[str, Any]]:
    """Import the bill of `periods` (default: the current one, and the last one for 15 days
    after it closed) from the `BillingExport` block named `export`; a missing block is said in
    the logs, and nothing is imported."""
    logger = get_run_logger()
    try:
        block = BillingExport.load(export)
    except ValueError:
        logger.warning(
            "no BillingExport block named %r: save one (kind aws-cur2, gcp-billing or file) to "
            "true the ledger up from the cloud's bill",
            export,
        )
        return []
    led = (ledger or SpendLedger()).ledger()
    wanted = periods or periods_to_read(time.time())
    done = import_export(block.source(), wanted, led.bills, block.provisional_hours)
    for item in done:
        _tell(led, item)
    _publish_drift(led)
    return [
        item.__dict__ | {"over_by_bill": [m.__dict__ for m in item.over_by_bill]} for item in done
    ]


def _tell(ledger: Any, done: BillImport) -> None:
    """What an import did, in the logs; each period over by bill and each figure held, also as
    an event and a notification."""
    logger = get_run_logger()
    logger.info(summary(done))
    for mark in done.over_by_bill:
        logger.warning(over_line(mark))
    announce_over_by_bill(ledger, done.over_by_bill)
    for held in done.held:
        logger.warning(held_line(held))
    announce_held(ledger, done.held)


def _publish_drift(ledger: Any) -> None:
    """The drift per scope, settled against billed, as the table artifact `gpu-bill-drift`."""
    drift = ledger.bills.drift()
    rows = [
        {
            "scope": scope,
            "settled_usd": micro_to_usd(t["settled_micro"]),
            "billed_usd": micro_to_usd(t["billed_micro"]),
            "drift_usd": micro_to_usd(t["drift_micro"]),
            "provisional_jobs": t["provisional"],
        }
        for scope, t in sorted(drift["scopes"].items())
    ]
    if rows:
        create_table_artifact(rows, key="gpu-bill-drift", description="Settled vs billed")
