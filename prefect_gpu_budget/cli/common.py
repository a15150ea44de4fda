"""What the commands share: the console, one-line failures, the ledger of this invocation,
and the figures' formats."""

from __future__ import annotations

import sys
from typing import Any, NoReturn

import typer

from prefect_gpu_budget import settings


class _Console:
    """rich's console, loaded on first print: `--json` output never imports rich."""

    _rich: Any = None

    def rich(self) -> Any:
        if self._rich is None:
            from rich.console import Console

            # piped output is read by scripts and agents: never wrap it at 80 columns
            wide = None if sys.stdout.isatty() else settings.piped_columns()
            _Console._rich = Console(width=wide)
        return self._rich

    def print(self, *args: Any, **kwargs: Any) -> None:
        self.rich().print(*args, **kwargs)


console = _Console()
_state: dict[str, Any] = {"ledger_url": None}


def fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def given_ledger_url() -> str | None:
    """The --ledger-url of this invocation (or its environment variable), if any."""
    return _state["ledger_url"]


def shown_url(url: str) -> str:
    """A ledger URL as it may be shown: without its password."""
    import sqlalchemy as sa

    return sa.engine.make_url(url).render_as_string(hide_password=True)


def current_ledger():
    from prefect_gpu_budget import settings
    from prefect_gpu_budget.admission.ledger import open_ledger

    return open_ledger(settings.ledger_url(_state["ledger_url"]))


PASSWORD_ON_ARGV = (
    "--ledger-url: a URL with a password shows in `ps` and the shell's history: give it in "
    "PREFECT_GPU_BUDGET_LEDGER_URL (or, for `agents serve`, in a file only you can read: "
    "--ledger-url-file PATH)"
)


def _show_version(asked: bool) -> None:
    if asked:
        from importlib.metadata import version

        typer.echo(f"prefect-gpu-budget {version('prefect-gpu-budget')}")
        raise typer.Exit(0)


# the callback of the whole app: the --ledger-url option every command reads, and --version
def set_ledger_url(
    ctx: typer.Context,
    _version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_show_version, help="Show the version."
    ),
    ledger_url: str = typer.Option(
        None,
        "--ledger-url",
        envvar="PREFECT_GPU_BUDGET_LEDGER_URL",
        help="Ledger database URL (default: SQLite under PREFECT_HOME); one with a password "
        "only through the environment, never on the command line.",
        show_envvar=True,
    ),
) -> None:
    from click.core import ParameterSource

    from prefect_gpu_budget import settings

    typed = ctx.get_parameter_source("ledger_url") == ParameterSource.COMMANDLINE
    if ledger_url and typed and settings.url_has_password(ledger_url):
        fail(PASSWORD_ON_ARGV)
    _state["ledger_url"] = ledger_url


def spend_ledger():
    from prefect_gpu_budget import settings
    from prefect_gpu_budget.blocks.ledger import SpendLedger

    return SpendLedger(database_url=settings.ledger_url(_state["ledger_url"]))


def limits_if_configured():
    """Prefect limits only when a server is configured; never start a temporary one for this."""
    from prefect_gpu_budget.settings import prefect_api_url

    if not prefect_api_url():
        return None
    from prefect_gpu_budget.admission.limits import RateLimits

    return RateLimits()
