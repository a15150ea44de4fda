"""`budget set`, `budget show` and `status`: the budgets and where each scope stands."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any, NoReturn

import typer

from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.cli.capacity import print_pool
from prefect_gpu_budget.cli.common import console, current_ledger, fail
from prefect_gpu_budget.cli.tables import Col, print_table
from prefect_gpu_budget.units import BudgetInputError, fmt_usd, org_of, to_decimal_usd


def _optional_usd(value: str | None, field: str) -> Decimal | None | str:
    if value is None:
        return "keep"
    if value.strip().lower() == "none":
        return None
    return to_decimal_usd(value, field)


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
    from prefect_gpu_budget.models import BudgetSettings
    from prefect_gpu_budget.units import validate_scope

    validate_scope(scope)
    known = {r.scope for r in current_ledger().config.budgets()}
    if not new:
        _refuse_near_miss(scope, known)
    changes: dict[str, Any] = {}
    for key, value in (
        ("hourly_cap_usd", _optional_usd(hourly_cap, "hourly_cap")),
        ("period_budget_usd", _optional_usd(period_budget, "period_budget")),
    ):
        if value != "keep":
            changes[key] = value
    given = {
        "period": period,
        "timezone": tz,
        "on_limit": on_limit,
        "max_wait": max_wait,
        "reservation_mode": reservation_mode,
        "notify_block": notify,
    }
    changes.update({k: v for k, v in given.items() if v is not None})
    if "hourly_cap_usd" in changes:  # one line before opening the ledger
        BudgetSettings(scope=scope, hourly_cap_usd=changes["hourly_cap_usd"])

    def merge(current):
        fields: dict[str, Any] = {"scope": scope}
        if current is not None:
            fields.update(BudgetSettings.fields_of(current))
        fields.update(changes)
        if fields.get("hourly_cap_usd") is None and fields.get("period_budget_usd") is None:
            raise BudgetInputError("budget", "give --hourly-cap, --period-budget or both")
        return BudgetSettings(**fields).rule()

    rule = current_ledger().config.update_budget(scope, merge, template=session_template)
    _warn_cap_rounded(changes.get("hourly_cap_usd"), rule)
    _warn_parent_binds(rule)
    if session_template:
        console.print(f"session template set for [bold]{scope}/*[/]: {_describe(rule)}")
        return
    console.print(f"budget set for [bold]{scope}[/]: {_describe(rule)}")
    _resize_prefect_limit(rule)


def _resize_prefect_limit(rule: Any) -> None:
    """Show a new cap in the Prefect UI now, not at the scope's next admission."""
    from prefect_gpu_budget.settings import prefect_api_auth, prefect_api_url

    api = prefect_api_url()
    if rule.hourly_cap_cents is None or not api:
        return
    from prefect_gpu_budget.admission.limits import limit_name, resize_over_http

    why = resize_over_http(rule.scope, rule.hourly_cap_cents, api, prefect_api_auth())
    if why:
        typer.echo(
            f"warning: Prefect's limit {limit_name(rule.scope)} keeps its old cap until the "
            f"next admission in {rule.scope}: {why}",
            err=True,
        )


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


def _refuse_near_miss(scope: str, known: set[str]) -> None:
    """A typo makes a new org or team: `acme/visoin/agent-7` beside `acme/vision`. A scope
    whose org or team has no budget yet, and whose name is close to a known one, is refused
    with what it may have meant (`--new` creates it all the same)."""
    from prefect_gpu_budget.units import near, scope_path

    if scope in known:
        return
    for path in scope_path(scope)[:2]:  # the org, then the team
        if path in known:
            continue
        peers = {k for k in known if k.count("/") == path.count("/")}
        close = near(path, peers)
        if close:
            fail(f"scope: {path} has no budget; did you mean {close[0]}? (--new creates it)")


def _warn_cap_rounded(given: Any, rule: Any) -> None:
    """A cap is kept in whole cents per hour, rounded down (Prefect's limit counts cents): say
    so when the cap given was not, above all when it rounds to nothing and admits no job."""
    from prefect_gpu_budget.units import usd_to_micro

    if given is None or rule.hourly_cap_cents is None:
        return
    wanted = usd_to_micro(given)
    if wanted == rule.hourly_cap_cents * 10_000:
        return
    kept = fmt_usd(rule.hourly_cap_cents * 10_000)
    tail = ": no job will be admitted in it" if rule.hourly_cap_cents == 0 else ""
    typer.echo(
        f"warning: the cap ${given}/h of {rule.scope} is kept as {kept}/h (caps are "
        f"whole cents per hour, rounded down){tail}",
        err=True,
    )


def _warn_parent_binds(rule) -> None:
    """A cap or budget above its parent's is allowed, but the parent binds: say so."""
    from prefect_gpu_budget.units import scope_path

    for parent in reversed(current_ledger().config.path_budgets(rule.scope)):
        if parent.scope == rule.scope or parent.scope not in scope_path(rule.scope):
            continue
        mine, theirs = rule.hourly_cap_cents, parent.hourly_cap_cents
        if mine is not None and theirs is not None and mine > theirs:
            typer.echo(
                f"warning: the cap {fmt_usd(mine * 10_000)}/h of {rule.scope} is above the "
                f"{fmt_usd(theirs * 10_000)}/h of {parent.scope}, which binds",
                err=True,
            )
        mine, theirs = rule.period_budget_micro, parent.period_budget_micro
        if (
            mine is not None
            and theirs is not None
            and mine > theirs
            and rule.period == parent.period
        ):
            typer.echo(
                f"warning: the {rule.period} budget {fmt_usd(mine)} of {rule.scope} is above "
                f"the {fmt_usd(theirs)} of {parent.scope}, which binds",
                err=True,
            )


def _describe(rule) -> str:
    parts = []
    if rule.hourly_cap_cents is not None:
        parts.append(f"cap {fmt_usd(rule.hourly_cap_cents * 10_000)}/h")
    if rule.period_budget_micro is not None:
        parts.append(f"{fmt_usd(rule.period_budget_micro)} per {rule.period} ({rule.timezone})")
    parts.append(f"on limit {rule.on_limit}")
    parts.append("max wait forever" if rule.max_wait_s == 0 else f"max wait {rule.max_wait_s:.0f}s")
    parts.append(rule.reservation_mode)
    return ", ".join(parts)


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
        [(rule.scope, _describe(rule)) for rule in rules]
        + [(f"{rule.scope}/* (template)", _describe(rule)) for rule in templates],
    )


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
    "holds its rate and reservation, and no limit holds it"
)
"""What `(+N starting)` means, said under a table that shows it."""


def status(
    scope: str = typer.Argument(None), as_json: bool = typer.Option(False, "--json")
) -> None:
    """Per scope: hourly cap and running rate, period spend, running and queued jobs."""
    rows = current_ledger().views.status(scope)
    if scope is not None and not rows:
        no_such_scope("status", scope)
    if as_json:
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
        return
    print_table(
        _STATUS_COLUMNS,
        [
            (
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
            for r in rows
        ],
    )
    if any(r["admitted"] for r in rows):
        console.print(STARTING_NOTE, markup=False, highlight=False)
    waiting = current_ledger().views.jobs(scope, states=("queued",))
    for job in waiting:
        console.print(
            f"[yellow]waiting[/] {job['id'][:8]} {job['scope']} {job['instance_type']}: {job['reason']}"
        )
    orgs = sorted({org_of(r["scope"]) for r in rows})
    for pool in (p for org in orgs for p in current_ledger().views.capacity_status(org)):
        print_pool(pool)


def _remaining(row: dict[str, Any]) -> str:
    """`$765.31 / $2,000.00`: what is left of the period budget, and the budget (`-`: none)."""
    if row["period_budget_micro"] is None:
        return "-"
    return f"{fmt_usd(row['remaining_micro'])} / {fmt_usd(row['period_budget_micro'])}"
