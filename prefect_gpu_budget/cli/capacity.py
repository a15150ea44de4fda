"""`capacity`: an org's capacity pools, each team's quota and use in them, and the queue."""

from __future__ import annotations

import json

import typer

from prefect_gpu_budget.cli.app import app
from prefect_gpu_budget.cli.common import console, current_ledger
from prefect_gpu_budget.cli.tables import print_pool


@app.command()
def capacity(
    org: str = typer.Argument(..., help="The org whose pools to show."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Per capacity pool: each team's quota, used, borrowed and lent, and the queue."""
    from prefect_gpu_budget.units import validate_scope

    ledger = current_ledger()
    pools = ledger.views.capacity_status(validate_scope(org, "org"))
    if as_json:
        typer.echo(json.dumps(pools, indent=2))
        return
    for pool in pools:
        print_pool(pool)
    if not pools:
        console.print(f"no capacity pools in {org}")
    classes = ledger.config.priority_classes(org)
    console.print("priority classes: " + ", ".join(f"{c['name']}={c['value']}" for c in classes))
