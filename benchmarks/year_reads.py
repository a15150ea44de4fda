"""The reads `benchmarks.year` times, each in a child process of its own per ledger: the
decision (`Ledger.queue.request`), the commands through the CLI's own app in-process, and the
spend report flow; and a job of the run's own (`new_job`) on its local machine `LOCAL`."""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.year_fill import Shape

LOCAL = "year"
"""The run's local machine (`local:year`, $2.50 an hour)."""


def new_job(scope: str, rate: int) -> Any:
    from prefect_gpu_budget.admission.ledger import NewJob, holder_id
    from prefect_gpu_budget.units import rate_cents

    return NewJob(
        scope=scope,
        name="year-now",
        instance_type=f"local:{LOCAL}",
        provisioning="on-demand",
        nodes=1,
        rate_micro_per_hour=rate,
        rate_cents=rate_cents(rate),
        priority=0,
        max_runtime_s=3610.0,
        expected_runtime_s=None,
        holder=holder_id(),
    )


# -- the timed reads, each in a child process --------------------------------------------------


def _cli(url: str, argv: list[str]) -> Callable[[], None]:
    from typer.testing import CliRunner

    from prefect_gpu_budget.cli import app

    runner = CliRunner()

    def run() -> None:
        done = runner.invoke(app, ["--ledger-url", url, *argv], catch_exceptions=False)
        if done.exit_code != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {done.exit_code}: {done.output[-300:]}")

    return run


def _decision(url: str, shape: Shape) -> Callable[[], float]:
    from prefect_gpu_budget.admission.ledger import Ledger

    ledger = Ledger(url, create=False)
    scope = shape.session(11)

    def run() -> float:
        """The decision's own seconds (`request`); the job is then started and settled."""
        began = time.perf_counter()
        job_id, decision = ledger.queue.request(new_job(scope, 2_500_000))
        took = time.perf_counter() - began
        if decision.verdict != "admit":
            raise RuntimeError(decision.reason)
        ledger.settlements.mark_started(job_id, time.time())
        ledger.settlements.settle(job_id, ended_at=time.time(), outcome="completed", scope=scope)
        return took

    return run


def _spend_report(url: str, team: str, out: str) -> Callable[[], None]:
    from prefect_gpu_budget.blocks import SpendLedger
    from prefect_gpu_budget.flows.spend_report import spend_report

    def run() -> None:
        spend_report(scope=team, hours=24.0, ledger=SpendLedger(database_url=url), out_dir=out)

    return run


def read_fn(name: str, target: Target, tmp: Path) -> Callable[[], float | None]:
    url, shape, deep_id = target.url, target.shape, target.deep_id
    spec = tmp / "sweep.yaml"
    argv = {
        "status": ["status", "--json"],
        "ledger": ["ledger", "--json", "--limit", "200"],
        "ledger_deep": ["ledger", "--json", "--limit", "200", "--before", deep_id],
        "ledger_team": ["ledger", shape.team(3), "--json", "--limit", "200"],
        "forecast": ["forecast", str(spec), "--json"],
        "bill_drift": ["bill", "drift", "--json"],
        "spend": ["spend", "--json"],
    }
    if name in argv:
        return _cli(url, argv[name])
    if name == "decision":
        return _decision(url, shape)
    return _spend_report(url, target.report_team, str(tmp / "reports"))


@dataclass(frozen=True)
class Target:
    """One ledger a read is timed on."""

    url: str
    shape: Shape
    deep_id: str
    report_team: str
    """The team whose spend report is timed (`benchmarks.year.report_team`)."""


def _child(name: str, targets: list[Target], tmp: Path, runs: int, pipe: Any) -> None:
    """Time the read on each target, the targets in turn run by run, after one warm run
    each."""
    try:
        fns = [read_fn(name, t, tmp) for t in targets]
        for fn in fns:
            fn()  # warm: the ledger opened, the statements built
        runs = max(runs, 30) if name == "decision" else runs  # a few ms each
        samples: list[list[float]] = [[] for _ in fns]
        for _ in range(runs):
            for fn, mine in zip(fns, samples, strict=True):
                began = time.perf_counter()
                own = fn()  # a read that times itself says so
                mine.append(time.perf_counter() - began if own is None else own)
        pipe.send({"s": samples})
    except Exception as exc:  # reported as the read's figure
        pipe.send({"error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    pipe.close()
    os._exit(0)


def _timed(name: str, targets: list[Target], tmp: Path, runs: int, cap_s: float) -> Any:
    """The child's answer, or None past `cap_s` (the child killed)."""
    ctx = mp.get_context("fork")
    mine, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(name, targets, tmp, runs, theirs))
    proc.start()
    if not mine.poll(cap_s):
        proc.kill()
        proc.join()
        return None
    got = mine.recv()
    proc.join()
    return got


def _figure(got: Any, samples: list[float] | None, cap_s: float) -> dict[str, Any]:
    if got is None:
        return {"over_s": cap_s}
    if "error" in got:
        return {"error": got["error"]}
    assert samples is not None
    return {"median_s": statistics.median(samples), "max_s": max(samples)}


def time_read(
    name: str, targets: dict[str, Target], tmp: Path, runs: int, cap_s: float
) -> dict[str, dict[str, Any]]:
    """Median seconds of the read on each ledger: each in a child process of its own (the
    CLI's in-process state is one ledger's), in two rounds of `runs` runs, the ledgers in turn
    and in the other order in the second round, so a change of the machine's load falls on
    both alike; past `cap_s` a ledger's child is killed and its read said to be over it."""
    samples: dict[str, list[float]] = {n: [] for n in targets}
    failed: dict[str, dict[str, Any]] = {}
    for order in (list(targets), list(targets)[::-1]):
        for n in order:
            if n in failed:
                continue
            got = _timed(name, [targets[n]], tmp, runs, cap_s)
            if got is None or "error" in got:
                failed[n] = _figure(got, None, cap_s)
            else:
                samples[n] += got["s"][0]
    return {n: failed.get(n) or _figure({}, samples[n], cap_s) for n in targets}
