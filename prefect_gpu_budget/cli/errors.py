"""How `main` reports what went wrong: bad input in one line, and the word for a command
typed that does not exist."""

from __future__ import annotations

import difflib
import sys
from typing import NoReturn

from prefect_gpu_budget.extras import MissingExtra
from prefect_gpu_budget.units import BudgetInputError

ASKED_FOR = {
    "cost": "spend",
    "costs": "spend",
    "spent": "spend",
    "usage": "spend",
    "budgets": "budget show",
    "jobs": "ledger",
    "list": "ledger",
    "price": "prices list",
}
"""Words a user types for a command that has another name."""


def suggestion(typed: str, commands: list[str], group: str = "") -> str:
    """` Did you mean `prefect-gpu-budget spend`?` for a command that does not exist (in
    `group`, a command group's name, or at the top), or nothing."""
    word = (ASKED_FOR.get(typed) if not group else None) or next(
        iter(difflib.get_close_matches(typed, commands, 1)), None
    )
    return (
        f" Did you mean `prefect-gpu-budget {group + ' ' if group else ''}{word}`?" if word else ""
    )


def user_error(exc: BaseException) -> bool:
    """Bad input: ours, pydantic's (never raised unless pydantic was imported), or a feature
    whose extra is not installed."""
    pydantic = sys.modules.get("pydantic")
    return isinstance(exc, (BudgetInputError, MissingExtra)) or (
        pydantic is not None and isinstance(exc, pydantic.ValidationError)
    )


def unknown_command(exc: Exception, message: str) -> str:
    """The command meant, for `No such command 'costs'.` where click names none."""
    ctx = getattr(exc, "ctx", None)
    if not message.startswith("No such command '") or "Did you mean" in message or ctx is None:
        return ""
    group = ctx.command_path[len(ctx.find_root().command_path) :].strip()  # `prices`, or none
    return suggestion(message.split("'")[1], list(ctx.command.list_commands(ctx)), group)


def report(exc: Exception) -> NoReturn:
    """Exit for what a command raised: bad input and usage errors in one line with code 2;
    anything else in one line (its URLs without passwords) with code 1."""
    import typer

    if user_error(exc):
        from prefect_gpu_budget.job import one_line

        typer.echo(f"error: {one_line(exc)}", err=True)
        sys.exit(2)
    if hasattr(exc, "format_message"):
        _usage_error(exc)
    from prefect_gpu_budget.units import redact_urls

    first = str(exc).splitlines()[0] if str(exc) else ""
    from prefect_gpu_budget.settings import NO_SERVER

    if "ephemeral Prefect API server" in first or first == NO_SERVER:
        typer.echo(f"error: {NO_SERVER}", err=True)
        sys.exit(1)
    typer.echo(f"error: {type(exc).__name__}: {redact_urls(first)}", err=True)
    sys.exit(1)


def _usage_error(exc: Exception) -> NoReturn:
    """click's usage error, as one line naming the parameter (and the command meant)."""
    import typer

    lines = exc.format_message().splitlines()  # type: ignore[attr-defined]
    if not lines:  # a group named alone: its help is printed already
        sys.exit(2)
    param = getattr(getattr(exc, "param", None), "name", None)
    message = lines[0]
    if param and param not in message:
        message = f"{param}: {message}"
    message += unknown_command(exc, message)
    typer.echo(f"error: {message}", err=True)
    sys.exit(2)
