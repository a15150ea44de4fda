"""`prefect-gpu-budget`: budgets, status, ledger, quotes, reconcile and the demo.

User errors print one line on stderr and exit with code 2, writing nothing.

This module builds the command tree, in the order `--help` lists it; the commands live in the
modules named for what they touch. The ledger and catalog commands import neither Prefect nor
pandas, matplotlib or a cloud SDK: the commands that need them (`runs`, `prices refresh`,
`agent serve`) import them inside themselves.
"""

from __future__ import annotations

import atexit
import gc
import sys

import typer

from prefect_gpu_budget.cli.agents import agent_grant, agent_limits_cmd, agent_revoke, agents_serve
from prefect_gpu_budget.cli.bill import bill_accept, bill_drift, bill_forget, bill_import
from prefect_gpu_budget.cli.budgets import budget_set, budget_show, status
from prefect_gpu_budget.cli.capacity import (
    capacity,
    pool_quota,
    pool_set,
    priority_list,
    priority_remove,
    priority_set,
)
from prefect_gpu_budget.cli.common import console, fail, set_ledger_url
from prefect_gpu_budget.cli.jobs import cancel_cmd, ledger_cmd, reconcile_cmd
from prefect_gpu_budget.cli.prices import (
    prices_export_local,
    prices_import_local,
    prices_list,
    prices_refresh,
    prices_set_local,
    quote,
)
from prefect_gpu_budget.cli.runs import demo, deploy, forecast, serve, sweep
from prefect_gpu_budget.cli.spend import spend, suggestion
from prefect_gpu_budget.extras import MissingExtra
from prefect_gpu_budget.units import BudgetInputError

__all__ = ["app", "console", "fail", "main"]

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
bill_app = typer.Typer(
    help="The cloud's own bill: import it, and see it against the settlements.",
    no_args_is_help=True,
)
app.add_typer(priority_app, name="priority")
app.add_typer(bill_app, name="bill")

app.callback()(set_ledger_url)
budget_app.command("set")(budget_set)
budget_app.command("show")(budget_show)
app.command()(status)
app.command()(spend)
app.command()(capacity)
priority_app.command("set")(priority_set)
priority_app.command("remove")(priority_remove)
priority_app.command("list")(priority_list)
pool_app.command("set")(pool_set)
pool_app.command("quota")(pool_quota)
app.command("ledger")(ledger_cmd)
app.command("cancel")(cancel_cmd)
app.command()(quote)
prices_app.command("set-local")(prices_set_local)
prices_app.command("import-local")(prices_import_local)
prices_app.command("export-local")(prices_export_local)
prices_app.command("refresh")(prices_refresh)
prices_app.command("list")(prices_list)
agent_app.command("grant")(agent_grant)
agent_app.command("revoke")(agent_revoke)
agent_app.command("limits")(agent_limits_cmd)
agent_app.command("serve")(agents_serve)
app.command("reconcile")(reconcile_cmd)
bill_app.command("import")(bill_import)
bill_app.command("drift")(bill_drift)
bill_app.command("forget")(bill_forget)
bill_app.command("accept")(bill_accept)
app.command()(demo)
app.command()(sweep)
app.command()(forecast)
app.command()(serve)
app.command()(deploy)


def _user_error(exc: BaseException) -> bool:
    """Bad input: ours, pydantic's (never raised unless pydantic was imported), or a feature
    whose extra is not installed."""
    pydantic = sys.modules.get("pydantic")
    return isinstance(exc, (BudgetInputError, MissingExtra)) or (
        pydantic is not None and isinstance(exc, pydantic.ValidationError)
    )


def _unknown_command(exc: Exception, message: str) -> str:
    """The command meant, for `No such command 'costs'.` where click names none."""
    ctx = getattr(exc, "ctx", None)
    if not message.startswith("No such command '") or "Did you mean" in message or ctx is None:
        return ""
    group = ctx.command_path[len(ctx.find_root().command_path) :].strip()  # `prices`, or none
    return suggestion(message.split("'")[1], list(ctx.command.list_commands(ctx)), group)


def main() -> None:
    """Console entry point: one-line errors with exit code 2 for bad input."""
    # A short command's process spent a quarter to a third of its time exiting: the collector's
    # last pass at exit walked every object SQLAlchemy and typer made (0.1-0.25 s on this
    # project's machine). Frozen at exit, they are not walked; nothing is left to collect then,
    # and an in-process caller is unaffected until its own exit.
    atexit.unregister(gc.freeze)  # once, however often an in-process caller runs main
    atexit.register(gc.freeze)
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
            lines = exc.format_message().splitlines()
            if not lines:  # a group named alone: its help is printed already
                sys.exit(2)
            param = getattr(getattr(exc, "param", None), "name", None)
            message = lines[0]
            if param and param not in message:
                message = f"{param}: {message}"
            message += _unknown_command(exc, message)
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
