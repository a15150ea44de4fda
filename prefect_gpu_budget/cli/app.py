"""The root Typer app every command group and top-level command registers on: its help, and
the options every command reads (`--ledger-url`, `--version`)."""

from __future__ import annotations

import typer

from prefect_gpu_budget.cli.common import set_ledger_url

app = typer.Typer(
    help="Spend bounds for GPU jobs: hourly caps and period budgets, checked before jobs start.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.callback()(set_ledger_url)
