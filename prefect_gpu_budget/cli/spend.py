"""`spend`: what each budgeted scope has spent in its current period (day, week or month, in
its budget's time zone), as a table, `--json` or `--csv`."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

import typer

from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.cli.app import app
from prefect_gpu_budget.cli.common import current_ledger, fail
from prefect_gpu_budget.cli.tables import Col, print_table
from prefect_gpu_budget.units import fmt_usd, iso, usd

FIELDS = (
    "scope",
    "period",
    "period_start",
    "period_end",
    "settled_usd",
    "reserved_usd",
    "spent_usd",
    "period_budget_usd",
    "remaining_usd",
)
"""The columns of `spend --json` and `--csv`: spent is settled plus reserved, what the budget
counts."""


def _row(r: dict[str, Any]) -> dict[str, Any]:
    return {
        "scope": r["scope"],
        "period": r["period"],
        "period_start": iso(r["period_start"]),
        "period_end": iso(r["period_end"]),
        "settled_usd": usd(r["settled_micro"]),
        "reserved_usd": usd(r["reserved_micro"]),
        "spent_usd": usd(r["settled_micro"] + r["reserved_micro"]),
        "period_budget_usd": usd(r["period_budget_micro"]),
        "remaining_usd": usd(r["remaining_micro"]),
    }


@app.command()
def spend(
    scope: str = typer.Argument(None, help="A scope (and the scopes under it); default all."),
    period: str = typer.Option(None, help="Only scopes whose budget is per day, week or month."),
    as_json: bool = typer.Option(False, "--json"),
    as_csv: bool = typer.Option(False, "--csv", help="CSV on stdout, one row a scope."),
) -> None:
    """Spend per scope in its budget's current period: settled, reserved, their sum, the
    budget and what is left (`bill drift` sets it beside the cloud's bill)."""
    if period is not None and period not in ("day", "week", "month"):
        fail(f"period: must be day, week or month, got {period!r}")
    if as_json and as_csv:
        fail("--json and --csv: give one")
    rows = [
        r for r in current_ledger().views.status(scope) if period is None or r["period"] == period
    ]
    if scope is not None and not rows:
        from prefect_gpu_budget.cli.status import no_such_scope

        no_such_scope("spend", scope)
    if as_json:
        typer.echo(json.dumps([_row(r) for r in rows], indent=2))
    elif as_csv:
        _print_csv(rows)
    else:
        print_table(_SPEND_COLUMNS, [_table_row(r) for r in rows])


def _print_csv(rows: list[dict[str, Any]]) -> None:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(_row(r) for r in rows)  # scopes are a-z 0-9 - _ /: no formula
    typer.echo(out.getvalue(), nl=False)


_SPEND_COLUMNS = (
    Col("scope"),
    Col("period", "text", drop=3),
    Col("settled", drop=2),
    Col("reserved", drop=1),
    Col("spent"),
    Col("remaining / budget", "pair"),
)


def _table_row(r: dict[str, Any]) -> tuple[str, ...]:
    return (
        r["scope"],
        f"{r['period']} from {periods.fmt_instant(r['period_start'], r['timezone'])}",
        fmt_usd(r["settled_micro"]),
        fmt_usd(r["reserved_micro"]),
        fmt_usd(r["settled_micro"] + r["reserved_micro"]),
        "-"
        if r["period_budget_micro"] is None
        else f"{fmt_usd(r['remaining_micro'])} / {fmt_usd(r['period_budget_micro'])}",
    )
