"""`prefect-gpu-budget`: budgets, status, ledger, quotes, reconcile and the demo.

User errors print one line on stderr and exit with code 2, writing nothing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any, NoReturn

import typer

from prefect_gpu_budget.admission import periods
from prefect_gpu_budget.admission.timing import STALE_AFTER_S
from prefect_gpu_budget.extras import MissingExtra
from prefect_gpu_budget.units import (
    BudgetInputError,
    fmt_usd,
    micro_to_usd,
    org_of,
    to_decimal_usd,
)

app = typer.Typer(
    help="Spend bounds for GPU jobs: hourly caps and period budgets, checked before jobs start.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
budget_app = typer.Typer(help="Set and show budgets.", no_args_is_help=True)
prices_app = typer.Typer(help="The price catalog.", no_args_is_help=True)
app.add_typer(budget_app, name="budget")
agent_app = typer.Typer(
    help="Agents: tokens that bind each to its own session, their limits, and their gateway.",
    no_args_is_help=True,
)
app.add_typer(prices_app, name="prices")
app.add_typer(agent_app, name="agent")
app.add_typer(agent_app, name="agents", hidden=True)  # `agents serve` reads better
pool_app = typer.Typer(help="Capacity pools and team quotas.", no_args_is_help=True)
app.add_typer(pool_app, name="pool")
priority_app = typer.Typer(help="An org's own priority classes.", no_args_is_help=True)
app.add_typer(priority_app, name="priority")


class _Console:
    """rich's console, loaded on first print: `--json` output never imports rich."""

    _rich: Any = None

    def rich(self) -> Any:
        if self._rich is None:
            from rich.console import Console

            # piped output is read by scripts and agents: never wrap it at 80 columns
            wide = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS") or 200)
            _Console._rich = Console(width=wide)
        return self._rich

    def print(self, *args: Any, **kwargs: Any) -> None:
        self.rich().print(*args, **kwargs)


def _table(*columns: str) -> Any:
    from rich.table import Table

    return Table(*columns)


console = _Console()
_state: dict[str, Any] = {"ledger_url": None}


def fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _ledger():
    from prefect_gpu_budget import settings
    from prefect_gpu_budget.admission.ledger import open_ledger

    return open_ledger(settings.ledger_url(_state["ledger_url"]))


def _iso(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, timezone.utc).isoformat()


def _usd(micro: int | None) -> float | None:
    return None if micro is None else micro_to_usd(micro)


@app.callback()
def _main(
    ledger_url: str = typer.Option(
        None,
        "--ledger-url",
        envvar="PREFECT_GPU_BUDGET_LEDGER_URL",
        help="Ledger database URL (default: SQLite under PREFECT_HOME).",
        show_envvar=True,
    ),
) -> None:
    _state["ledger_url"] = ledger_url


def _optional_usd(value: str | None, field: str) -> Decimal | None | str:
    if value is None:
        return "keep"
    if value.strip().lower() == "none":
        return None
    return to_decimal_usd(value, field)


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
    from prefect_gpu_budget.models import BudgetSettings
    from prefect_gpu_budget.units import validate_scope

    validate_scope(scope)
    known = {r.scope for r in _ledger().budgets()}
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

    rule = _ledger().update_budget(scope, merge, template=session_template)
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


def _budgeted_under(scope: str) -> bool:
    return any(r.scope == scope or r.scope.startswith(scope + "/") for r in _ledger().budgets())


def _no_such_scope(command: str, scope: str) -> NoReturn:
    """A scope with no budget and no jobs: exit 2, naming the known scopes nearby."""
    from prefect_gpu_budget.units import near

    known = {r.scope for r in _ledger().budgets()}
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


def _warn_parent_binds(rule) -> None:
    """A cap or budget above its parent's is allowed, but the parent binds: say so."""
    from prefect_gpu_budget.units import scope_path

    for parent in reversed(_ledger().path_budgets(rule.scope)):
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


@budget_app.command("show")
def budget_show(
    scope: str = typer.Argument(None), as_json: bool = typer.Option(False, "--json")
) -> None:
    """List budgets (under SCOPE if given)."""
    rules = [
        r
        for r in _ledger().budgets()
        if scope is None or r.scope == scope or r.scope.startswith(scope + "/")
    ]
    if as_json:
        typer.echo(json.dumps([r.__dict__ for r in rules], indent=2))
        return
    table = _table("scope", "budget")
    for rule in rules:
        table.add_row(rule.scope, _describe(rule))
    for rule in _ledger().session_templates():
        table.add_row(f"{rule.scope}/* (template)", _describe(rule))
    console.print(table)


@app.command()
def status(
    scope: str = typer.Argument(None), as_json: bool = typer.Option(False, "--json")
) -> None:
    """Per scope: hourly cap and running rate, period spend, running and queued jobs."""
    rows = _ledger().status(scope)
    if scope is not None and not rows:
        _no_such_scope("status", scope)
    if as_json:
        typer.echo(
            json.dumps(
                [
                    {  # the names of these figures; the spend report and the gateway use them
                        "scope": r["scope"],
                        "hourly_cap_usd": _usd(r["hourly_cap_micro"]),
                        "running_rate_usd_per_hour": _usd(r["running_rate_micro"]),
                        "period": r["period"],
                        "period_start": _iso(r["period_start"]),
                        "period_budget_usd": _usd(r["period_budget_micro"]),
                        "settled_usd": _usd(r["settled_micro"]),
                        "reserved_usd": _usd(r["reserved_micro"]),
                        "remaining_usd": _usd(r["remaining_micro"]),
                        "running": r["running"],
                        "queued": r["queued"],
                    }
                    for r in rows
                ],
                indent=2,
            )
        )
        return
    table = _table(
        "scope", "rate / cap", "period", "settled", "reserved", "remaining", "running", "queued"
    )
    for r in rows:
        cap = "-" if r["hourly_cap_micro"] is None else fmt_usd(r["hourly_cap_micro"])
        table.add_row(
            r["scope"],
            f"{fmt_usd(r['running_rate_micro'])} / {cap}",
            f"{r['period']} from {periods.fmt_instant(r['period_start'], r['timezone'])}",
            fmt_usd(r["settled_micro"]),
            fmt_usd(r["reserved_micro"]),
            "-" if r["remaining_micro"] is None else fmt_usd(r["remaining_micro"]),
            str(r["running"]),
            str(r["queued"]),
        )
    console.print(table)
    waiting = _ledger().jobs(scope, states=("queued",))
    for job in waiting:
        console.print(
            f"[yellow]waiting[/] {job['id'][:8]} {job['scope']} {job['instance_type']}: {job['reason']}"
        )
    orgs = sorted({org_of(r["scope"]) for r in rows})
    for pool in (p for org in orgs for p in _ledger().capacity_status(org)):
        _print_pool(pool)


def _res(r: tuple[int, int, int], model: str = "") -> str:
    return f"{r[0]} {model} / {r[1]} vCPU / {r[2]} GiB".replace("  ", " ")


def _print_pool(pool: dict) -> None:
    table = _table("team", "quota", "used", "borrowed", "lent", "borrow / lend / weight")
    for t in pool["teams"]:
        table.add_row(
            t["team"],
            _res(t["quota"], pool["gpu_model"]),
            _res(t["used"]),
            str(t["borrowed"][0]),
            str(t["lent"][0]),
            f"{t['borrow_pct']}% / {t['lend_pct']}% / {t['weight']}",
        )
    console.print(
        f"pool {pool['org']}/{pool['pool']} ({pool['kind']}, {pool['nodes']} x "
        f"{_res(pool['node'], pool['gpu_model'])}): {pool['used'][0]} of {pool['total'][0]} "
        "accelerators in use"
    )
    if pool["teams"]:
        console.print(table)
    for q in pool["queue"]:
        console.print(f"[yellow]queued[/] {q['job_id'][:8]} {q['scope']}: {q['reason']}")


@app.command()
def capacity(
    org: str = typer.Argument(..., help="The org whose pools to show."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Per capacity pool: each team's quota, used, borrowed and lent, and the queue."""
    from prefect_gpu_budget.units import validate_scope

    ledger = _ledger()
    pools = ledger.capacity_status(validate_scope(org, "org"))
    if as_json:
        typer.echo(json.dumps(pools, indent=2))
        return
    for pool in pools:
        _print_pool(pool)
    if not pools:
        console.print(f"no capacity pools in {org}")
    classes = ledger.priority_classes(org)
    console.print("priority classes: " + ", ".join(f"{c['name']}={c['value']}" for c in classes))


@priority_app.command("set")
def priority_set(
    org: str = typer.Argument(...),
    name: str = typer.Argument(..., help="The class's name, as jobs give it in `priority`."),
    value: int = typer.Option(..., help="-1000..1000: higher is admitted first."),
    description: str = typer.Option("", help="What the class is for."),
) -> None:
    """Define (or redefine) a priority class of an org; jobs recorded from now on that name it
    get its value."""
    _ledger().set_priority_class(org, name, value, description)
    console.print(f"priority class {name} of {org}: {value}")


@priority_app.command("remove")
def priority_remove(org: str = typer.Argument(...), name: str = typer.Argument(...)) -> None:
    """Remove an org's own class (jobs already recorded keep their priority)."""
    if not _ledger().remove_priority_class(org, name):
        fail(f"name: {org} has no priority class {name!r} of its own")
    console.print(f"priority class {name} of {org} removed")


@priority_app.command("list")
def priority_list(
    org: str = typer.Argument(...), as_json: bool = typer.Option(False, "--json")
) -> None:
    """Every class a job of the org may name, highest first, and who defined it."""
    from prefect_gpu_budget.units import validate_scope

    classes = _ledger().priority_classes(validate_scope(org, "org"))
    if as_json:
        typer.echo(json.dumps(classes, indent=2))
        return
    for c in classes:
        line = f"{c['value']:>6}  {c['name']:<24} {c['defined_by']}"
        console.print(f"{line}  {c['description']}".rstrip())


@pool_app.command("set")
def pool_set(
    org: str = typer.Argument(...),
    name: str = typer.Argument(...),
    nodes: int = typer.Option(..., help="Machines (or quota units) in the pool."),
    gpus_per_node: int = typer.Option(...),
    vcpu_per_node: int = typer.Option(0),
    memory_gib_per_node: int = typer.Option(0),
    gpu_model: str = typer.Option(""),
    instance_type: list[str] = typer.Option([], help="Jobs on this type run here (repeat)."),
    kind: str = typer.Option("inventory", help="inventory or quota."),
    backfill: bool = typer.Option(False, help="Let small jobs pass a blocked big one."),
) -> None:
    """Create or replace a capacity pool; its team quotas stay as they are."""
    from prefect_gpu_budget.models import PoolSettings

    block = PoolSettings(
        org=org,
        name=name,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        vcpu_per_node=vcpu_per_node,
        memory_gib_per_node=memory_gib_per_node,
        gpu_model=gpu_model,
        instance_types=instance_type,
        kind=kind,
        backfill=backfill,
    )
    from prefect_gpu_budget.pricing.catalog import default_catalog

    catalog = default_catalog()
    for instance in instance_type:  # a job of an unpriced type could never be quoted
        rows = [row for row in catalog.rows() if row.key == instance]
        if not any(row.priced for row in rows):  # a price for any provisioning will do
            # says why: the nearest known type, or the reason the catalog has no figure
            catalog.quote(instance, provisioning=rows[0].provisioning if rows else "on-demand")
    _ledger().set_pool(block.pool())  # its quotas stay: a concurrent `pool quota` survives
    console.print(f"pool {org}/{name}: {nodes} x {gpus_per_node} {gpu_model}".rstrip())


@pool_app.command("quota")
def pool_quota(
    team: str = typer.Argument(..., help="org/team"),
    pool: str = typer.Option(..., help="The pool's name."),
    gpus: int = typer.Option(..., help="Accelerators guaranteed to the team."),
    vcpu: int = typer.Option(None, help="Default: in proportion to --gpus."),
    memory_gib: int = typer.Option(None, help="Default: in proportion to --gpus."),
    borrow_pct: int = typer.Option(0),
    lend_pct: int = typer.Option(100),
    weight: int = typer.Option(50),
) -> None:
    """Set one team's quota in a pool (HyperPod-style: vCPU and memory follow the GPUs)."""
    from prefect_gpu_budget.models import TeamShare
    from prefect_gpu_budget.units import validate_scope

    org = org_of(validate_scope(team, "team"))
    share = TeamShare(
        team=team,
        gpus=gpus,
        vcpu=vcpu,
        memory_gib=memory_gib,
        borrow_pct=borrow_pct,
        lend_pct=lend_pct,
        weight=weight,
    )
    from prefect_gpu_budget.admission.quota import TeamQuota, proportional

    def make(target):
        return TeamQuota(
            pool,
            team,
            proportional(target, gpus, share.vcpu, share.memory_gib),
            borrow_pct,
            lend_pct,
            weight,
        )

    # read, change and write in one locked transaction: a concurrent change to another team's
    # quota, or to the pool, survives
    target, new = _ledger().set_team_quota(org, pool, make)
    console.print(f"{team} in {org}/{pool}: {_res(new.quota, target.gpu_model)}")


@app.command("ledger")
def ledger_cmd(
    scope: str = typer.Argument(None),
    as_json: bool = typer.Option(False, "--json"),
    limit: int = typer.Option(200, help="Newest N jobs."),
) -> None:
    """Every job from request to settlement."""
    if limit <= 0:
        fail(f"limit: must be at least 1 (the newest N jobs), got {limit}")
    rows = _ledger().jobs(scope, limit=limit)
    if scope is not None and not rows and not _budgeted_under(scope):
        _no_such_scope("ledger", scope)
    out = [
        {
            "id": r["id"],
            "scope": r["scope"],
            "name": r["name"],
            **_sweep_trial(r["name"]),
            "instance_type": r["instance_type"],
            "nodes": r["nodes"],
            "rate_usd_per_hour": _usd(r["rate_micro_per_hour"]),
            "reserved_usd": _usd(r["reserved_micro"]),
            "actual_usd": _usd(r["actual_micro"]),
            "state": r["state"],
            "outcome": r["outcome"] or _UNRUN.get(r["state"]),
            "reason": r["reason"],
            "flow_run_id": r["flow_run_id"],
            "requested_at": _iso(r["requested_at"]),
            "admitted_at": _iso(r["admitted_at"]),
            "ended_at": _iso(r["ended_at"]),
            "settled_at": _iso(r["settled_at"]),
        }
        for r in rows
    ]
    if as_json:
        typer.echo(json.dumps(out, indent=2))
        return
    table = _table(
        "id",
        "scope",
        "job",
        "instance",
        "rate/h",
        "reserved",
        "actual",
        "state",
        "requested",
        "run",
    )
    for raw, r in zip(rows, out, strict=True):
        table.add_row(
            r["id"][:8],
            r["scope"],
            r["name"],
            f"{r['instance_type']} x{r['nodes']}",
            fmt_usd(raw["rate_micro_per_hour"]),
            fmt_usd(raw["reserved_micro"]),
            "-" if raw["actual_micro"] is None else fmt_usd(raw["actual_micro"]),
            r["state"] + (f" ({r['outcome']})" if r["outcome"] else ""),
            (r["requested_at"] or "")[:19],
            (r["flow_run_id"] or "")[:8],
        )
    console.print(table)


_UNRUN = {"rejected": "refused", "timed_out": "timed_out", "cancelled": "cancelled"}
"""The outcome of a job that ended without running, by its state."""


def _sweep_trial(name: str) -> dict[str, Any]:
    """A sweep's trial is named `SWEEP/NNNN`: the ledger's link back to the trials table."""
    sweep_name, _, index = name.rpartition("/")
    if sweep_name and len(index) == 4 and index.isdigit():
        return {"sweep": sweep_name, "trial": int(index)}
    return {"sweep": None, "trial": None}


@app.command()
def quote(
    instance_type: str = typer.Argument(..., help="cloud:type, e.g. aws:p4d.24xlarge."),
    nodes: int = typer.Option(1, min=1, max=1024),
    hours: str = typer.Option("1", help="Runtime in hours (or a duration like '90m')."),
    provisioning: str = typer.Option("on-demand", help="on-demand, spot or flex-start."),
    gpus: int = typer.Option(None, help="A part of each machine: its GPUs."),
    vcpu: int = typer.Option(None, help="A part of each machine: its vCPU."),
    memory_gib: int = typer.Option(None, help="A part of each machine: its memory, GiB."),
) -> None:
    """Price a job shape from the dated catalog (a whole machine, or a part of one)."""
    from prefect_gpu_budget.pricing.catalog import default_catalog
    from prefect_gpu_budget.units import cost_micro, parse_duration

    seconds = parse_duration(
        hours if not hours.replace(".", "", 1).isdigit() else f"{hours}h", "hours"
    )
    q = default_catalog().quote(instance_type, nodes, provisioning)
    per_node = f"{q.row.gpus}x {q.row.gpu_model} per node"
    if gpus is not None or vcpu is not None or memory_gib is not None:
        from prefect_gpu_budget.job import GpuJob

        asked = GpuJob(
            instance_type=instance_type,
            max_runtime=seconds,
            gpus=gpus,
            vcpu=vcpu,
            memory_gib=memory_gib,
        )
        q, part = asked.priced(q)
        if not part.whole:
            per_node = f"{part.fraction} of each node's price (of {per_node})"
    console.print(
        f"{q.describe()}  {per_node}\n"
        f"{seconds / 3600:g} h: {fmt_usd(cost_micro(q.rate_micro_per_hour, seconds, round_up=True))}"
        f"  (price from {q.row.source}, {q.row.as_of})"
    )
    for warning in q.warnings:
        console.print(f"[yellow]warning:[/] {warning}")


@prices_app.command("set-local")
def prices_set_local(
    name: str = typer.Argument(..., help="The NAME in local:NAME."),
    usd_per_hour: str = typer.Option(..., help="What an hour of this machine costs you."),
    gpus: int = typer.Option(1, help="GPUs the machine has."),
    vcpu: int = typer.Option(0, help="vCPU a job on it takes of a pool's machine (0: unknown)."),
    memory_gib: int = typer.Option(0, help="Memory a job on it takes, GiB (0: unknown)."),
) -> None:
    """Price a local machine so jobs on `local:NAME` can be admitted."""
    from prefect_gpu_budget.pricing.catalog import set_local_price

    path = set_local_price(name, usd_per_hour, gpus, vcpu=vcpu, memory_gib=memory_gib)
    console.print(f"local:{name} priced at ${usd_per_hour}/h in {path}")


@prices_app.command("refresh")
def prices_refresh(
    aws: bool = typer.Option(False, "--aws", help="AWS Price List API and EC2 spot history."),
    gcp: bool = typer.Option(False, "--gcp", help="GCP Cloud Billing Catalog API."),
    aws_credentials: str = typer.Option(None, help="AwsCredentials block name (default: env)."),
    gcp_credentials: str = typer.Option(None, help="GcpCredentials block name (default: env)."),
    aws_region: str = typer.Option("us-east-1"),
    gcp_region: str = typer.Option("us-central1"),
    gcp_endpoint: str = typer.Option(None, help="Billing API endpoint, for a private one."),
) -> None:
    """Read current prices from the clouds, write a dated catalog over the shipped one, and
    print what changed. Quotes use the newest refreshed catalog from then on."""
    from prefect_gpu_budget.pricing.catalog import Catalog
    from prefect_gpu_budget.pricing.refresh import changes, write_refresh

    if not (aws or gcp):
        fail("choose --aws and/or --gcp")
    if gcp:
        from prefect_gpu_budget.pricing import gcp as gcp_prices

        gcp_prices._sdk()  # a missing extra before any prices are read
    rows = []
    if aws:
        from prefect_aws import AwsCredentials

        from prefect_gpu_budget.pricing.aws import refresh_aws

        creds = AwsCredentials.load(aws_credentials) if aws_credentials else AwsCredentials()
        rows += refresh_aws(creds, region=aws_region)
    if gcp:
        from prefect_gcp import GcpCredentials

        from prefect_gpu_budget.pricing.gcp import PriceRefreshError, refresh_gcp

        creds = GcpCredentials.load(gcp_credentials) if gcp_credentials else GcpCredentials()
        try:
            rows += refresh_gcp(creds, region=gcp_region, api_endpoint=gcp_endpoint)
        except PriceRefreshError as exc:
            fail(str(exc))
    old = Catalog.load()
    found = changes(old, rows)
    path = write_refresh(old, rows)
    for change in found:
        console.print(change.describe())
    console.print(f"{len(rows)} prices read, {len(found)} changed; catalog written to {path}")


@prices_app.command("list")
def prices_list() -> None:
    """The catalog rows, with their sources and dates."""
    from prefect_gpu_budget.pricing.catalog import default_catalog

    table = _table("instance", "provisioning", "GPUs", "USD/h", "as of", "source")
    for row in default_catalog().rows():
        table.add_row(
            row.key,
            row.provisioning,
            f"{row.gpus}x {row.gpu_model}",
            "no figure" if row.usd_per_hour is None else str(row.usd_per_hour),
            f"{row.as_of}{'' if row.verified or not row.priced else ' (unverified)'}",
            row.source,
        )
    console.print(table)


@agent_app.command("grant")
def agent_grant(
    scope: str = typer.Argument(..., help="The agent's session, org/team/session."),
) -> None:
    """Print a new token for an agent: with it, the agent gateway lets it run sweeps and cancel
    jobs in this session only. Shown once; only its hash is stored. The session needs a budget
    of its own or its team's session template."""
    typer.echo(_ledger().grant_agent(scope))


@agent_app.command("revoke")
def agent_revoke(
    scope: str = typer.Argument(..., help="The session whose tokens to revoke."),
) -> None:
    """Revoke every token granted for a session and cancel its queued jobs at once; its
    running sweeps admit nothing more (running jobs finish)."""
    from prefect_gpu_budget.units import validate_scope

    revoked, cancelled = _ledger().revoke_agent(validate_scope(scope))
    if not revoked:
        fail(f"scope: no live agent token for {scope!r} (unknown session, or revoked already)")
    console.print(f"{revoked} token(s) revoked for {scope}; {cancelled} queued job(s) cancelled")


@agent_app.command("limits")
def agent_limits_cmd(
    team: str = typer.Argument(..., help="The team, org/team, whose sessions' agents to bound."),
    launcher: list[str] = typer.Option(
        None, help="A launcher agents may name: 'local' or 'kind:block' (repeat; default local)."
    ),
    callable_: list[str] = typer.Option(
        None, "--callable", help="A 'module:function' trial agents may call (repeat)."
    ),
    max_priority: int = typer.Option(None, help="Highest priority an agent's job may ask for."),
    max_wait: str = typer.Option(None, help="Longest max_wait an agent's job may ask for."),
    max_sweeps: int = typer.Option(None, help="Sweeps a session may run at once."),
    max_queued: int = typer.Option(None, help="Jobs a session may have queued at once."),
    max_trials: int = typer.Option(None, help="Trials in one sweep."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Show, or change, the ceilings on what a team's agents may ask for (the defaults until
    set: local launcher only, no callables, priority 0, max_wait 1h, 2 sweeps, 16 queued jobs,
    100 trials a sweep)."""
    from prefect_gpu_budget.models import AgentLimits
    from prefect_gpu_budget.units import validate_scope

    led = _ledger()
    team = validate_scope(team)
    given = {
        "launchers": launcher or None,
        "callables": callable_ or None,
        "max_priority": max_priority,
        "max_wait": max_wait,
        "max_sweeps": max_sweeps,
        "max_queued": max_queued,
        "max_trials": max_trials,
    }
    changes = {k: v for k, v in given.items() if v is not None}
    limits = AgentLimits(team=team, **{**(led.agent_limits(team) or {}), **changes})
    if changes:
        led.set_agent_limits(team, limits.stored())
    if as_json:
        typer.echo(json.dumps(limits.model_dump(mode="json")))
        return
    for key, value in limits.model_dump(mode="json").items():
        console.print(f"{key}: {', '.join(value) if isinstance(value, list) else value}")


@agent_app.command("serve")
def agents_serve(
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8080, help="Port to listen on."),
) -> None:
    """Run the agent gateway: the HTTP API agents use with their token (OpenAPI at /docs).
    It starts sweeps on the Prefect API of this process's settings, which agents must not
    reach: close that server with PREFECT_SERVER_API_AUTH_STRING and give this process
    PREFECT_API_AUTH_STRING."""
    from prefect_gpu_budget.gateway import serve as serve_gateway

    serve_gateway(host, port)


@app.command("reconcile")
def reconcile_cmd(
    stale_after: str = typer.Option(
        f"{STALE_AFTER_S:g}s", help="Silence after which a holder on another host counts as gone."
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Settle reservations whose holders are gone; safe to run often and concurrently."""
    from prefect_gpu_budget.admission.reconcile import reconcile
    from prefect_gpu_budget.units import parse_duration

    done = reconcile(
        _ledger(), _limits_if_configured(), stale_after=parse_duration(stale_after, "stale_after")
    )
    if as_json:
        typer.echo(
            json.dumps([{**d.__dict__, "actual_usd": micro_to_usd(d.actual_micro)} for d in done])
        )
        return
    for d in done:
        console.print(f"{d.job_id[:8]} {d.scope}: {d.action} ({fmt_usd(d.actual_micro)})")
    console.print(f"{len(done)} job(s) reconciled")


@app.command()
def demo(
    out: str = typer.Option("gpu-budget-demo", help="Folder for the CSV, plot and demo ledger."),
    trials: int = typer.Option(
        12, min=1, max=12, help="About this many trials (learning rates x widths)."
    ),
    seconds: float = typer.Option(2.5, help="Length of each trial."),
) -> None:
    """Run a small real sweep under a budget whose caps bite (no server or GPU needed)."""
    from prefect_gpu_budget.flows.demo import run_demo

    run_demo(out, seconds=seconds, trials=trials)


@app.command()
def sweep(
    spec_path: str = typer.Argument(..., metavar="SWEEP", help="The sweep spec YAML."),
    scope: str = typer.Option(None, help="Run it under this scope instead of the spec's."),
) -> None:
    """Run a sweep from its YAML spec: progress as trials finish, the results table at the end,
    and the run's page in the Prefect UI."""
    import threading

    from prefect_gpu_budget.flows.demo import start_temporary_server
    from prefect_gpu_budget.flows.sweep import gpu_sweep, load_spec

    spec = load_spec(spec_path, scope)  # a bad spec fails here, before any server starts
    start_temporary_server()
    ledger = _ledger()
    total, started = len(spec.trials()), time.time()
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["state"] = gpu_sweep(
                spec,
                ledger=_spend_ledger(),
                return_state=True,
            )
        except BaseException as exc:  # shown below, after the progress bar
            outcome["error"] = exc

    worker = threading.Thread(target=run, name="sweep", daemon=True)
    worker.start()
    _show_progress(worker, ledger, spec, total, started)
    if "error" in outcome:
        raise outcome["error"]
    state = outcome["state"]
    df = state.result(raise_on_failure=False)
    if not hasattr(df, "to_string"):
        fail(f"sweep {spec.name} ended {state.name}: {state.message}", code=1)
    columns = [c for c in df.columns if c not in ("job_id", "runtime_s")]
    typer.echo(df[columns].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    typer.echo(f"results: {df.attrs.get('results_dir')}")
    from prefect_gpu_budget.settings import prefect_api_url

    if prefect_api_url():
        from prefect.settings import PREFECT_UI_URL

        ui = PREFECT_UI_URL.value()
        if ui:
            typer.echo(f"run: {ui}/runs/flow-run/{state.state_details.flow_run_id}")


def _spend_ledger():
    from prefect_gpu_budget import settings
    from prefect_gpu_budget.blocks.ledger import SpendLedger

    return SpendLedger(database_url=settings.ledger_url(_state["ledger_url"]))


def _show_progress(worker: Any, ledger: Any, spec: Any, total: int, started: float) -> None:
    """A progress bar of the sweep's trials that have ended, read from the ledger."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from prefect_gpu_budget.admission.ledger import ACTIVE

    prefix = f"{spec.name}/"
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console.rich(),
        transient=False,
    ) as bar:
        task = bar.add_task(f"sweep {spec.name}", total=total)
        while worker.is_alive():
            worker.join(timeout=1.0)
            rows = [
                r
                for r in ledger.jobs(spec.scope)
                if r["name"] and r["name"].startswith(prefix) and r["requested_at"] >= started
            ]
            ended = sum(r["state"] not in ("queued", *ACTIVE) for r in rows)
            waiting = sum(r["state"] == "queued" for r in rows)
            bar.update(
                task,
                completed=min(ended, total),
                description=f"sweep {spec.name}" + (f" ({waiting} waiting)" if waiting else ""),
            )
        bar.update(task, completed=total)


@app.command()
def forecast(
    sweep: str = typer.Argument(..., help="The sweep spec YAML."),
    scope: str = typer.Option(None, help="Run it under this scope instead of the spec's."),
    plot: str = typer.Option(None, help="Write the predicted spend plot (PNG) here."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Predict a sweep's makespan, spend and waits under the current caps, budgets and ledger."""
    from prefect_gpu_budget.forecast import forecast as predict
    from prefect_gpu_budget.forecast import plot as draw
    from prefect_gpu_budget.sweep_spec import load_spec

    spec = load_spec(sweep, scope)
    ledger = _ledger()
    result = predict(spec, ledger)
    if plot:
        path_rules = [r for r in ledger.path_budgets(spec.scope) if r.period_budget_micro]
        draw(result, Path(plot), path_rules[-1] if path_rules else None)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "trials": result.trials,
                    "admitted": result.admitted,
                    "spend_usd": micro_to_usd(result.spend_micro),
                    "makespan_s": round(result.makespan_s, 1),
                    "waiting": result.waiting,
                    "mean_wait_s": round(result.mean_wait_s, 1),
                    "stopped_by": result.stopped_by,
                }
            )
        )
        return
    console.print(result.describe())


@app.command()
def serve(
    sweep: str = typer.Option(
        None, help="Sweep spec YAML for the sweep deployment (default: the example)."
    ),
    sweep_cron: str = typer.Option("0 2 * * *", help="When the sweep runs (UTC)."),
    report_cron: str = typer.Option("0 7 * * *", help="When the spend report runs (UTC)."),
    reconcile_every: int = typer.Option(300, help="Seconds between reconcile runs."),
) -> None:
    """Serve the sweep, spend-report and reconcile deployments from this process."""
    from prefect_gpu_budget.deployments import EXAMPLE_SPEC
    from prefect_gpu_budget.deployments import serve as serve_all

    serve_all(
        sweep_spec=sweep or EXAMPLE_SPEC,
        sweep_cron=sweep_cron,
        report_cron=report_cron,
        reconcile_every_s=reconcile_every,
    )


@app.command()
def deploy(
    work_pool: str = typer.Option(..., help="The work pool that runs the flows."),
    sweep: str = typer.Option(None, help="Sweep spec YAML for the sweep deployment."),
    sweep_cron: str = typer.Option("0 2 * * *"),
    report_cron: str = typer.Option("0 7 * * *"),
    reconcile_every: int = typer.Option(300),
) -> None:
    """Register the deployments on a work pool."""
    from prefect_gpu_budget.deployments import EXAMPLE_SPEC
    from prefect_gpu_budget.deployments import deploy as deploy_all

    ids = deploy_all(
        work_pool,
        sweep_spec=sweep or EXAMPLE_SPEC,
        sweep_cron=sweep_cron,
        report_cron=report_cron,
        reconcile_every_s=reconcile_every,
    )
    console.print(f"{len(ids)} deployments registered on work pool {work_pool}")


def _limits_if_configured():
    """Prefect limits only when a server is configured; never start a temporary one for this."""
    from prefect_gpu_budget.settings import prefect_api_url

    if not prefect_api_url():
        return None
    from prefect_gpu_budget.admission.limits import RateLimits

    return RateLimits()


def _user_error(exc: BaseException) -> bool:
    """Bad input: ours, pydantic's (never raised unless pydantic was imported), or a feature
    whose extra is not installed."""
    pydantic = sys.modules.get("pydantic")
    return isinstance(exc, (BudgetInputError, MissingExtra)) or (
        pydantic is not None and isinstance(exc, pydantic.ValidationError)
    )


def main() -> None:
    """Console entry point: one-line errors with exit code 2 for bad input."""
    try:
        code = app(standalone_mode=False)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(1)
    except Exception as exc:  # usage errors from the option parser, and anything unexpected
        if _user_error(exc):
            from prefect_gpu_budget.job import one_line

            typer.echo(f"error: {one_line(exc)}", err=True)
            sys.exit(2)
        if hasattr(exc, "format_message"):
            param = getattr(getattr(exc, "param", None), "name", None)
            message = exc.format_message().splitlines()[0]
            if param and param not in message:
                message = f"{param}: {message}"
            typer.echo(f"error: {message}", err=True)
            sys.exit(2)
        from prefect_gpu_budget.units import redact_urls

        first = str(exc).splitlines()[0] if str(exc) else ""
        from prefect_gpu_budget.settings import NO_SERVER

        if "ephemeral Prefect API server" in first or first == NO_SERVER:
            typer.echo(f"error: {NO_SERVER}", err=True)
            sys.exit(1)
        typer.echo(f"error: {type(exc).__name__}: {redact_urls(first)}", err=True)
        sys.exit(1)
    if isinstance(code, int) and code:
        sys.exit(code)


if __name__ == "__main__":
    main()
