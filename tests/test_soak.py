"""The soak benchmark, short: agent processes submit, cancel and finish jobs for half a minute.

`python -m benchmarks.soak` runs as a subprocess: 5 agent processes, the ledger on PostgreSQL (a
database of this run, see tests/support/postgres.py), a real Prefect server on PostgreSQL (a database of
the soak's own, dropped at its end). Asserted: no errors,
the ledger consistent and every Prefect slot given back, memory flat, connections, descriptors
and threads not growing, every connection returned. The latency ratio is reported but not
asserted: half a minute on a shared machine says nothing about p95 drift; the long run
(`--minutes 30`) holds that target.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefect_gpu_budget.testing.stats import host_and_db, per_minute_p95
from tests.support.postgres import database_url, require_postgres

PG_URL = database_url("soak", "GATE_SOAK_PG_URL")
ROOT = Path(__file__).resolve().parents[1]
RSS_GROWTH_MIB = 2.0
"""Per agent, start window to end window (~25 s, ~40 jobs): about 0.3 MiB is seen; a leak of
50 KiB per job would pass it."""


@pytest.mark.timeout(300)
def test_short_soak_stays_flat_and_consistent() -> None:
    require_postgres(PG_URL)
    args = ["--minutes", "0.6", "--agents", "5", "--edge", "0.25", "--url", PG_URL, "--json"]
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # its own server
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak", *args],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
        cwd=ROOT,
    )
    assert proc.stdout.strip(), f"soak crashed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    out = json.loads(proc.stdout)
    assert proc.returncode == (1 if out["missed"] else 0)

    totals, ledger = out["totals"], out["ledger"]
    assert out["errors"] == [] and totals["errors"] == 0
    assert out["agent_exit_codes"] == [0] * 5
    assert totals["rejected"] == totals["starved"] == totals["stuck"] == 0
    # the mix happened: jobs ran, waited, were withdrawn and cancelled while waiting
    assert totals["completed"] > 50
    assert totals["admitted"] > totals["admitted_without_wait"] > 0
    assert totals["withdrawn"] > 0
    assert totals["interrupted"] + totals["timed_out"] > 0

    assert ledger["problems"] == []
    assert set(ledger["audit"].values()) == {0}  # the audit's checks ran, and found nothing
    assert ledger["by_state"].keys() <= {"settled", "cancelled", "timed_out"}
    assert ledger["leaked_slots"] == {}, (
        "Prefect slots still taken after every job settled; jobs settled as cancelled after "
        f"the ledger admitted them: {ledger['cancelled_after_admission']}"
    )

    for agent in out["agents"]:
        assert agent["samples"] >= 20
        assert agent["rss_growth_mib"] is not None
        assert agent["rss_growth_mib"] <= RSS_GROWTH_MIB, agent
        assert agent["final"]["pool_out"] == 0, agent
    # the end window's median does not pass the first half's maximum (pool, fds, threads
    # summed over agents, with the slack benchmarks/soak/checks.flat gives; the gate's
    # PostgreSQL backends exactly)
    for name, figure in out["flat"].items():
        assert figure["end"] is not None and figure["ok"], (name, figure)
    assert out["flat"]["pg_backends"]["end"] > 0  # the count is real: agents hold connections

    assert set(out["missed"]) <= {"latency_p95_ratio"}
    # measured, not judged: enough samples at both ends for the figure to mean something
    admit = out["latency"]["admit"]
    assert admit["start"]["n"] >= 10 and admit["end"]["n"] >= 10


def test_the_minute_trend_tells_a_steady_climb_from_one_noisy_minute() -> None:
    def run(p95_of_minute: list[float]) -> dict:
        samples = [(60.0 * m + s, ms) for m, ms in enumerate(p95_of_minute) for s in range(60)]
        return per_minute_p95(samples, 0.0, 60.0 * len(p95_of_minute))

    climb = run([40.0 + m for m in range(30)])  # +1 ms a minute: a leak
    noisy = run([40.0] * 12 + [100.0] + [40.0] * 17)  # one bad minute on the host
    assert climb["per_minute_p95_ms"][:2] == [40.0, 41.0]
    assert climb["trend_pct"] == pytest.approx(100 * 29 / 54.5)
    assert abs(noisy["trend_pct"]) < 10
    assert run([40.0] * 30)["trend_pct"] == 0


def test_host_and_db_figures_are_per_minute_deltas() -> None:
    def mark(minute: int) -> dict:
        # cumulative counters: 100 jiffies a minute, 3 of them stolen from minute 5 on; 1,000
        # ledger transactions a minute, each reading one row more than the minute before;
        # Prefect flat at 25 rows
        steal = 3 * max(0, minute - 4)
        ledger = [1000 * minute, sum(1000 * (20 + k) for k in range(minute))]
        return {
            "t": 60.0 * minute,
            "cpu": (steal, 100 * minute),
            "db": {"ledger": ledger, "prefect": [500 * minute, 500 * 25 * minute]},
        }

    parent = [mark(m) for m in range(11)]
    parent.insert(3, {"t": 150.0, "pg": 16})  # a plain sample in between is skipped
    out = host_and_db(parent, t0=60.0)  # the first minute is warm-up
    assert out["steal_pct"]["per_minute"] == [0, 0, 0, 3, 3, 3, 3, 3, 3]
    assert out["ledger_rows_per_xact"]["per_minute"] == [21 + k for k in range(9)]
    assert out["ledger_rows_per_xact"]["trend_pct"] == pytest.approx(100 * 8 / 25)
    assert out["prefect_rows_per_xact"]["per_minute"] == [25] * 9
    assert out["prefect_rows_per_xact"]["trend_pct"] == 0


def test_flat_tells_a_leak_in_every_agent_from_sockets_in_flight() -> None:
    from benchmarks.soak.checks import flat

    def agents(early: int, end: int, pool_end: int = 1) -> list[dict]:
        figure = {"end": end, "early_max": early}
        return [{"pool": {"end": pool_end, "early_max": 1}, "fds": figure, "threads": figure}] * 5

    pg = {"end": 10, "early_max": 10}
    calm = flat(agents(8, 10), pg)  # two more sockets and threads in flight in every agent
    assert calm["fds"]["ok"] and calm["threads"]["ok"] and calm["pool"]["ok"]
    leak = flat(agents(8, 11), pg)  # a dozen jobs, one descriptor lost in every four
    assert not leak["fds"]["ok"] and not leak["threads"]["ok"]
    assert not flat(agents(8, 8, pool_end=2), pg)["pool"]["ok"]  # the pool is held exactly
