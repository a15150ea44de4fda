"""`budget set` and `budget show`: a scope's hourly cap and period budget."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import typer

from prefect_gpu_budget.cli.common import console, current_ledger
from prefect_gpu_budget.cli.tables import Col, print_table
from prefect_gpu_budget.units import fmt_usd, to_decimal_usd

budget_app = typer.Typer(name="budget", help="Set and show budgets.", no_args_is_help=True)


def _optional_usd(value: str | None, field: str) -> Decimal | None | str:
    if value is None:
        return "keep"
    if value.strip().lower() == "none":
        return None
    return to_decimal_usd(value, field)


def _changes(hourly_cap: str | None, period_budget: str | None, **given: Any) -> dict[str, Any]:
    """The fields a `budget set` gives: the options left out keep their current values."""
    changes: dict[str, Any] = {}
    for key, value in (
        ("hourly_cap_usd", _optional_usd(hourly_cap, "hourly_cap")),
        ("period_budget_usd", _optional_usd(period_budget, "period_budget")),
    ):
        if value != "keep":
            changes[key] = value
    changes.update({k: v for k, v in given.items() if v is not None})
    return changes


@budget_app.command("set")
def budget_set(
    scope: str = typer.Argument(..., help="org, org/team or org/team/session."),
    hourly_cap: str = typer.Option(None, help="USD per hour ('none' removes the cap)."),
    period_budget: str = typer.Option(None, help="USD per period ('none' removes it)."),
    period: str = typer.Option(None, help="day, week or month."),
    tz: str = typer.Option(None, "--timezone", help="Time zone of the period (default UTC)."),
    on_limit: str = typer.Option(None, help="queue or reject."),
    max_wait: str = typer.Option(None, help="Longest wait, like '6h'; 0 waits forever."),
    reservation_mode: str = typer.Option(None, help="guaranteed or estimate."),
    notify: str = typer.Option(None, help="Notification block 'type-slug/name'."),
    session_template: bool = typer.Option(
        False,
        "--session-template",
        help="For a team: the budget each of its sessions gets when it first runs a job.",
    ),
    new: bool = typer.Option(
        False, "--new", help="Create a new org or team even if its name is close to a known one."
    ),
) -> None:
    """Create or change a scope's budget (options not given keep their current values).

    Only the options given change, inside the transaction that holds the org's lock: two
    concurrent changes to different fields both survive, and a bad value writes nothing."""
    from prefect_gpu_budget.admission.budgets import set_budget
    from prefect_gpu_budget.units import validate_scope

    validate_scope(scope)  # before the ledger is opened: a bad scope writes nothing
    changes = _changes(
        hourly_cap,
        period_budget,
        period=period,
        timezone=tz,
        on_limit=on_limit,
        max_wait=max_wait,
        reservation_mode=reservation_mode,
        notify_block=notify,
    )
    done = set_budget(current_ledger(), scope, changes, template=session_template, new=new)
    for warning in done.warnings:
        typer.echo(f"warning: {warning}", err=True)
    if session_template:
        console.print(f"session template set for [bold]{scope}/*[/]: {describe(done.rule)}")
        return
    console.print(f"budget set for [bold]{scope}[/]: {describe(done.rule)}")


def describe(rule) -> str:
    parts = []
    if rule.hourly_cap_cents is not None:
        parts.append(f"cap {fmt_usd(rule.hourly_cap_cents * 10_000)}/h")
    if rule.period_budget_micro is not None:
        parts.append(f"{fmt_usd(rule.period_budget_micro)} per {rule.period} ({rule.timezone})")
    parts.append(f"on limit {rule.on_limit}")
    parts.append("max wait forever" if rule.max_wait_s == 0 else f"max wait {rule.max_wait_s:.0f}s")
    parts.append(rule.reservation_mode)
    return ", ".join(parts)


@budget_app.command("show")
def budget_show(
    scope: str = typer.Argument(None), as_json: bool = typer.Option(False, "--json")
) -> None:
    """List budgets (under SCOPE if given)."""
    rules = [
        r
        for r in current_ledger().config.budgets()
        if scope is None or r.scope == scope or r.scope.startswith(scope + "/")
    ]
    if as_json:
        typer.echo(json.dumps([r.__dict__ for r in rules], indent=2))
        return
    templates = current_ledger().config.session_templates()
    print_table(
        (Col("scope"), Col("budget", "text")),
        [(rule.scope, describe(rule)) for rule in rules]
        + [(f"{rule.scope}/* (template)", describe(rule)) for rule in templates],
    )
