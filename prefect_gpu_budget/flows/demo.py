"""The demo: a real small sweep under a budget whose caps bite, on a temporary Prefect server.

Twelve trials of a tiny numpy network (4 learning rates x 3 widths) on `local:demo-gpu`, priced
so that the hourly cap lets two run at once and the day budget stops the tail. Each trial takes
`seconds` from its start (its `expected_runtime`), so the forecast the sweep logs first says what
its run does: at 2.5 s, 9 trials run and 3 time out waiting for the spent budget, the sweep over
only when their 30 s max wait runs out, long after its makespan; if every trial ran to its
max_runtime, the bound beside it, 2 would run.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from prefect_gpu_budget.admission.prices import default_catalog
from prefect_gpu_budget.blocks import GpuBudget, SpendLedger
from prefect_gpu_budget.pricing.catalog import set_local_price
from prefect_gpu_budget.settings import NO_SERVER
from prefect_gpu_budget.sweeps.flow import gpu_sweep
from prefect_gpu_budget.sweeps.spec import SweepSpec
from prefect_gpu_budget.units import fmt_usd, org_of

DEMO_SCOPE = "demo-lab/sweeps/agent-1"
SERVER_START_TIMEOUT_S = 180
LEARNING_RATES = [0.05, 0.2, 0.5, 1.0]
WIDTHS = [4, 16, 64]
MAX_RUNTIME_S = 10.0
"""Each trial reserves $12/h x 11 s (with its kill grace), $0.0367, of the $0.11 day budget."""


def prepare(out: Path) -> str:
    """Price the demo GPU and set the demo budgets in a fresh ledger inside `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("ledger.db", "ledger.db-wal", "ledger.db-shm"):
        (out / stale).unlink(missing_ok=True)
    os.environ["PREFECT_GPU_BUDGET_PRICES"] = str(
        set_local_price("demo-gpu", "12", gpus=1, path=out / "prices.csv")
    )
    default_catalog.cache_clear()
    url = f"sqlite:///{out / 'ledger.db'}"
    ledger = SpendLedger(database_url=url).ledger()
    GpuBudget(scope="demo-lab", hourly_cap_usd=100, period_budget_usd=50, period="month").apply(
        ledger
    )
    GpuBudget(
        scope=DEMO_SCOPE, hourly_cap_usd=30, period_budget_usd="0.11", period="day", max_wait="30s"
    ).apply(ledger)
    return url


def demo_spec(out: Path, trials: int, seconds: float) -> SweepSpec:
    widths = WIDTHS if trials > 4 else WIDTHS[:1]
    rates = LEARNING_RATES[: max(1, -(-trials // len(widths)))]
    return SweepSpec(
        name="demo",
        scope=DEMO_SCOPE,
        job={
            "instance_type": "local:demo-gpu",
            "max_runtime": MAX_RUNTIME_S,
            "expected_runtime": min(seconds, MAX_RUNTIME_S),  # what a trial takes, start-up in
            "kill_grace": "1s",
        },
        command=[
            sys.executable,
            "-m",
            "prefect_gpu_budget.flows.demo_trial",
            "--lr",
            "{lr}",
            "--width",
            "{width}",
            "--seconds",
            str(seconds),
        ],
        grid={"lr": rates, "width": widths},
        parallelism=12,
        metric="loss",
        results_dir=str(out),
    )


def start_temporary_server() -> None:
    """Start Prefect's temporary server here, unless a server is configured.

    Prefect starts it on first use and waits `PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`
    (20 s) for it; a first start migrates a new database, which takes about 15 s on two idle
    cores and longer on a busy machine. Starting the same instance here, with a longer wait, lets
    the sweep reuse it.
    """
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    )

    if PREFECT_API_URL.value():
        return
    print("starting a temporary Prefect server (the first start sets up its database)", flush=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry from it
    wait = max(SERVER_START_TIMEOUT_S, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
    server = _temporary["server"] = SubprocessASGIServer()
    try:
        server.start(timeout=wait)
    except RuntimeError as exc:
        if "ephemeral Prefect API server" not in str(exc):
            raise
        server.stop()
        raise RuntimeError(NO_SERVER) from None


_temporary: dict[str, Any] = {}


def stop_temporary_server() -> None:
    """Stop the temporary server started here, if any: what Prefect does at exit, for a command
    that leaves at once (`os._exit`)."""
    server = _temporary.pop("server", None)
    if server is not None:
        server.stop()


def remove_demo_limits() -> None:
    """Delete the Prefect limits the demo's scopes made: a demo leaves nothing in the user's
    Prefect database (its ledger lives in its own folder)."""
    from prefect.client.orchestration import get_client

    from prefect_gpu_budget.admission.limits import limit_name

    prefix = limit_name(org_of(DEMO_SCOPE))
    with get_client(sync_client=True) as client:
        found, offset = [], 0
        while page := client.read_global_concurrency_limits(limit=200, offset=offset):
            found += [x.name for x in page if x.name == prefix or x.name.startswith(prefix + ":")]
            offset += len(page)
        for name in found:
            client.delete_global_concurrency_limit_by_name(name)


def run_demo(
    out_dir: str = "gpu-budget-demo",
    seconds: float = 2.5,
    trials: int = 12,
    run: Callable[[SweepSpec, SpendLedger], pd.DataFrame] | None = None,
) -> pd.DataFrame:
    """Run the demo sweep and print its table and what it spent. `run(spec, ledger)` runs the
    sweep and returns its table (default: `gpu_sweep` here); the command runs it in the
    foreground, where Ctrl-C stops it (and removes the demo's limits, as this does after it)."""
    out = Path(out_dir).resolve()
    url = prepare(out)
    start_temporary_server()
    started = time.time()
    run = run or (lambda spec, ledger: gpu_sweep(spec, ledger=ledger))
    try:
        df = run(demo_spec(out, trials, seconds), SpendLedger(database_url=url))
    finally:
        remove_demo_limits()
    status = {s["scope"]: s for s in SpendLedger(database_url=url).ledger().views.status()}[
        DEMO_SCOPE
    ]
    print(demo_table(df))
    print("\n".join(closing_lines(df, status, out, time.time() - started)))
    return df


DEMO_DROP_FIRST = ("waited_s", "accuracy", "held_by", "loss")
"""What the demo's table leaves out first in a narrow terminal: times, then the metrics and
what held a trial; the trial, its parameters, its state and its cost stay."""


def demo_table(df: pd.DataFrame) -> str:
    """The trials as the demo shows them, fitted to the terminal (a note names what is left
    out: trials.csv has it all)."""
    from prefect_gpu_budget.frame_text import fit_frame, terminal_width

    columns = ["trial", "lr", "width", "state", "loss", "accuracy", "cost_usd", "waited_s"]
    shown = df[[c for c in columns if c in df.columns]]  # a trial that never ran has no metrics
    shown = shown.assign(held_by=df["blocked_by"].str.split(" ").str[0])  # the limit, not scope
    text, note = fit_frame(shown, terminal_width(), DEMO_DROP_FIRST)
    return text + (f"\n{note}" if note else "")


def shown_path(path: Path) -> str:
    """`path` as the user can type it here: relative to the working folder when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path.resolve())


def program() -> str:
    """How this command was called (`.venv/bin/prefect-gpu-budget`), else its name."""
    called = sys.argv[0] if sys.argv else ""
    return called if Path(called).name == "prefect-gpu-budget" else "prefect-gpu-budget"


def closing_lines(df: pd.DataFrame, status: dict[str, Any], out: Path, took_s: float) -> list:
    """What the demo spent and where it left things: its results, and its own ledger (not the
    default one) with the exact command that lists its jobs, split with a `\\` where it would
    not fit the terminal."""
    from prefect_gpu_budget.frame_text import terminal_width

    budget = fmt_usd(status["period_budget_micro"])
    stopped = int((df["state"] == "AdmissionTimeout").sum())
    results = Path(df.attrs["results_dir"])
    ledger = shown_path(out / "ledger.db")
    command = f"  {program()} --ledger-url sqlite:///{ledger} ledger"
    if len(command) > terminal_width():
        command = f"  {program()} --ledger-url \\\n    sqlite:///{ledger} ledger"
    return [
        "",
        f"spent {fmt_usd(status['settled_micro'])} of the {budget} day budget of {DEMO_SCOPE} "
        f"in {took_s:.0f}s",
        f"{stopped} trials stopped by the budget (their max wait ran out)",
        f"results: {shown_path(results / 'trials.csv')}",
        "  beside it: trials.parquet and the plots (*.png)",
        f"ledger: {ledger} (the demo's own, not the default); its jobs:",
        command,
    ]
