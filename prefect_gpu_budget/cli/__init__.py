"""`prefect-gpu-budget`: budgets, status, ledger, quotes, reconcile and the demo.

User errors print one line on stderr and exit with code 2, writing nothing.

Each command group is a module that owns its Typer app (`budget`, `prices`, `agent`, `pool`,
`priority`, `bill`); each top-level command registers itself on the root app of `cli/app.py`
from the module named for what it does. The import order below is the order `--help` lists
them in. The ledger and catalog commands import neither Prefect nor pandas, matplotlib or a
cloud SDK: the commands that need them (`runs`, `prices refresh`, `agent serve`) import them
inside themselves.
"""

from __future__ import annotations

import atexit
import gc
import sys

import typer

# isort: off
# the top-level commands, registered as their modules load, in the order `--help` lists them:
# where the scopes stand, the jobs, the prices, the runs
from prefect_gpu_budget.cli import status  # noqa: F401
from prefect_gpu_budget.cli import spend  # noqa: F401
from prefect_gpu_budget.cli import capacity  # noqa: F401
from prefect_gpu_budget.cli import jobs  # noqa: F401
from prefect_gpu_budget.cli import quote  # noqa: F401
from prefect_gpu_budget.cli import runs  # noqa: F401

# isort: on
from prefect_gpu_budget.cli.agent import agent_app
from prefect_gpu_budget.cli.app import app
from prefect_gpu_budget.cli.bill import bill_app
from prefect_gpu_budget.cli.budget import budget_app
from prefect_gpu_budget.cli.common import console, fail
from prefect_gpu_budget.cli.errors import report
from prefect_gpu_budget.cli.pool import pool_app
from prefect_gpu_budget.cli.prices import prices_app
from prefect_gpu_budget.cli.priority import priority_app

__all__ = ["app", "console", "fail", "main"]

app.add_typer(budget_app)
app.add_typer(prices_app)
app.add_typer(agent_app)
app.add_typer(agent_app, name="agents", hidden=True)  # `agents serve` reads better
app.add_typer(pool_app)
app.add_typer(priority_app)
app.add_typer(bill_app)


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
        report(exc)
    if isinstance(code, int) and code:
        sys.exit(code)
