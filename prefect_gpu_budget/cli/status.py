"""`status`: where each scope stands against its budgets, its waiting jobs and its pools; and
the exit of a command given a scope that has neither a budget nor a job."""

from __future__ import annotations

import json
from typing import Any, NoReturn

import typer

from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.cli.app import app
from prefect_gpu_budget.cli.common import console, current_ledger, fail
from prefect_gpu_budget.cli.tables import Col, print_pool, print_table
from prefect_gpu_budget.placement.recorded import choice_line
from prefect_gpu_budget.units import fmt_usd, org_of


def budgeted_under(scope: str) -> bool:
    return any(
        r.scope == scope or r.scope.startswith(scope + "/")
        for r in current_ledger().config.budgets()
    )


def no_such_scope(command: str, scope: str) -> NoReturn:
    """A scope with no budget and no jobs: exit 2, naming the known scopes nearby."""
    from prefect_gpu_budget.units import near

    known = {r.scope for r in current_ledger().config.budgets()}
    close = near(scope, known) or sorted(k for k in known if k.count("/") == scope.count("/"))[:5]
    hint = f"; did you mean {close[0]}?" if near(scope, known) else ""
    if not hint and close:
        hint = f"; known: {', '.join(close)}"
    fail(f"{command}: no budget and no jobs in {scope}{hint}")


_STATUS_COLUMNS = (
    Col("scope"),
    Col("rate / cap", "pair", drop=2),
    Col("period", "text", drop=8),
    Col("settled", drop=3),
    Col("reserved", drop=4),
    Col("remaining / budget", "pair", drop=1),
    Col("running", "name", drop=6),
    Col("queued", drop=7),
)
"""What a narrow terminal leaves out first: when the period began, then the job counts, then
the money, the parts of what is spent (reserved, settled) before what is left of the budget.
The money wraps at its ` / ` before any of it is left out."""

STARTING_NOTE = (
    "starting: admitted and not started yet (its launch, or a cloud finding capacity); it "
    "holds its rate and reservation, and no limit blocks it"
)
"""What `(+N starting)` means, said under a table that shows it."""


@app.command()
def status(
    scope: str = typer.Argument(None), as_json: bool = typer.Option(False, "--json")
) -> None:
    """Per scope: hourly cap and running rate, period spend, running and queued jobs."""
    rows = current_ledger().views.status(scope)
    if scope is not None and not rows:
        no_such_scope("status", scope)
    if as_json:
        _print_json(rows)
        return
    print_table(_STATUS_COLUMNS, [_status_row(r) for r in rows])
    if any(r["admitted"] for r in rows):
        console.print(STARTING_NOTE, markup=False, highlight=False)
    _print_waiting_and_pools(scope, rows)


def _print_json(rows: list[dict[str, Any]]) -> None:
    from prefect_gpu_budget.agents.views import budget_view

    typer.echo(
        json.dumps(
            [
                {  # the names of these figures, the gateway's own (`budget_view`)
                    k: v for k, v in budget_view(r).items() if k != "period_end"
                }
                for r in rows
            ],
            indent=2,
        )
    )


def _status_row(r: dict[str, Any]) -> tuple[str, ...]:
    return (
        r["scope"],
        f"{fmt_usd(r['running_rate_micro'])} / "
        + ("-" if r["hourly_cap_micro"] is None else fmt_usd(r["hourly_cap_micro"])),
        f"{r['period']} from {periods.fmt_instant(r['period_start'], r['timezone'])}",
        fmt_usd(r["settled_micro"]),
        fmt_usd(r["reserved_micro"]),
        _remaining(r),
        str(r["running"]) + (f" (+{r['admitted']} starting)" if r["admitted"] else ""),
        str(r["queued"]),
    )


def _print_waiting_and_pools(scope: str | None, rows: list[dict[str, Any]]) -> None:
    """Under the table: each job waiting and why, where each job that asked for accelerators
    was placed (`ledger --json` gives every offering considered), then the pools of the orgs
    shown."""
    live = current_ledger().views.jobs(scope, states=("queued", "admitted", "running"))
    for job in live:
        if job["state"] == "queued":
            console.print(
                f"[yellow]waiting[/] {job['id'][:8]} {job['scope']} {job['instance_type']}: "
                f"{job['reason']}"
            )
        placed = choice_line(job.get("choice"))
        if placed:
            console.print(
                f"placed {job['id'][:8]} {job['scope']}: {placed}", markup=False, highlight=False
            )
    orgs = sorted({org_of(r["scope"]) for r in rows})
    for pool in (p for org in orgs for p in current_ledger().views.capacity_status(org)):
        print_pool(pool)


def _remaining(row: dict[str, Any]) -> str:
    """`$765.31 / $2,000.00`: what is left of the period budget, and the budget (`-`: none)."""
    if row["period_budget_micro"] is None:
        return "-"
    return f"{fmt_usd(row['remaining_micro'])} / {fmt_usd(row['period_budget_micro'])}"
