"""What the CLI's tests share: a command run as a user runs it, and commands raced in real
processes, all released at once."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.blocks import GpuBudget


def cli_run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prefect_gpu_budget.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def cli_in_child(barrier, argv: list[str]) -> None:  # noqa: ANN001 - a multiprocessing Barrier
    from prefect_gpu_budget.cli import main

    sys.argv = ["prefect-gpu-budget", *argv]
    barrier.wait(timeout=120)
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    os._exit(code)


def race(url: str, commands: list[list[str]]) -> list[int]:
    """Run each CLI command in its own process, all released at once; their exit codes."""
    import prefect_gpu_budget.cli  # noqa: F401 - imported once here, inherited by the children

    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(len(commands))
    procs = [
        ctx.Process(target=cli_in_child, args=(barrier, ["--ledger-url", url, *argv]))
        for argv in commands
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=300)
    return [proc.exitcode for proc in procs]


def start(url: str) -> Ledger:
    ledger = Ledger(url)
    ledger.config.set_budget(
        GpuBudget(scope="acme", hourly_cap_usd=1000, period_budget_usd=1000).rule()
    )
    return ledger
