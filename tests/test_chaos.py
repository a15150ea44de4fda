"""Chaos: admitters and job holders SIGKILLed at random moments and at exact steps lose nothing
(a short run of `python -m benchmarks.chaos` on SQLite and on PostgreSQL, each against its own
real `prefect server start`, whose lease repossessor returns the slots of leases nobody
recorded), and the ledger audit those runs rely on finds what it should.

The two backends' runs go at once (each ends by waiting ~80 s for every lease to expire). The
PostgreSQL run uses a database of its own (see tests/support/postgres.py),
created if missing; without a PostgreSQL server it fails, it never skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefect_gpu_budget.admission.audit import audit, promise1_violations
from prefect_gpu_budget.admission.ledger import Ledger, holder_id, period_spend
from prefect_gpu_budget.admission.reconcile import reconcile
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.admission.rules.timing import UNRECORDED_LEASE_S
from tests.support.jobs import new_job
from tests.support.postgres import database_url, require_postgres

ROOT = Path(__file__).resolve().parents[1]
CHAOS_PG_URL = database_url("chaos", "GPU_BUDGET_CHAOS_PG_URL")
PHASES = ("before_reserve", "after_reserve", "running", "settling")
END_FIGURES = (
    "orphans_left",
    "double_charges",
    "missing_charges",
    "slot_mismatch_cents",
    "invariant_violations",
    "awaiting_lease_expiry_left",
    "slots_held_past_deadline_cents",
    "second_settles_charged",
    "jobs_outlived_holder",
    "worker_errors",
    "stuck_workers",
    "overshoot_micro",
    "unmetered_micro",
)
"""Figures that must be zero: the end state, once every lease expired, over the whole ledger;
overshoot and unmetered spend over the fault runs (guaranteed mode: the money bound)."""
RUN_FIGURES = (
    "orphans_left",
    "double_charges",
    "missing_charges",
    "slot_mismatch_cents",
    "invariant_violations",
)
"""And after each run's reconcile (slot differences that rows awaiting lease expiry explain
are counted apart, as transient)."""
RUNS = 12
"""Random kills, three per phase (about one in ten lands just after its phase)."""
POINTS = ("<ask", "<ensure", "<record_lease", "<release", "<settle", "<acquire")
"""Exact kill points, in runs after the random ones: the request committed (and admitted); the
admission before any lease; the lease recorded; the slots handed back, the ledger not yet
settled; both done; last, Prefect's lease granted but its id never recorded, so that its
slots are still held when the end starts waiting for lease expiry."""
RATE_ON_PATH = 3 * 360
"""A victim's rate in every capped scope on its path (org, team, session) in cents/h."""
FAULTS = ("stall", "escape")
"""One run of each fault that is not a kill: a ledger locked as a job starts, and children
that escape their job."""
TIMEOUT_S = 420


@pytest.fixture(scope="module")
def chaos_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, str]]:
    """Both backends' short runs at once, each with its own Prefect server: (exit status,
    stdout, stderr) by backend."""
    tmp = tmp_path_factory.mktemp("chaos")
    require_postgres(CHAOS_PG_URL)  # created here, so this run drops it at its end
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    urls = {"sqlite": f"sqlite:///{tmp / 'ledger.db'}", "postgresql": CHAOS_PG_URL}
    procs = {}
    for backend, url in urls.items():
        command = [sys.executable, "-m", "benchmarks.chaos", "--json"]
        command += ["--runs", str(RUNS), "--park-at", ",".join(POINTS)]
        command += ["--faults", ",".join(FAULTS), "--url", url, "--seed", "7"]
        out, err = (tmp / f"{backend}.json").open("w"), (tmp / f"{backend}.log").open("w")
        procs[backend] = subprocess.Popen(command, stdout=out, stderr=err, cwd=ROOT, env=env)
        out.close()
        err.close()
    deadline = time.monotonic() + TIMEOUT_S - 30
    results = {}
    for backend, proc in procs.items():
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        results[backend] = (
            proc.returncode,
            (tmp / f"{backend}.json").read_text(),
            (tmp / f"{backend}.log").read_text(),
        )
    return results


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_random_and_exact_kills_lose_nothing(
    backend: str, chaos_runs: dict[str, tuple[int, str, str]]
) -> None:
    if backend == "postgresql":
        require_postgres(CHAOS_PG_URL)
    returncode, stdout, stderr = chaos_runs[backend]
    assert stdout.strip(), f"chaos crashed (exit {returncode}):\n{stderr[-4000:]}"
    out = json.loads(stdout)
    assert out["backend"] == backend
    assert out["prefect_server"].startswith("prefect server start")
    assert out["runs"] == RUNS + len(POINTS)
    random_runs, exact_runs = out["by_run"][:RUNS], out["by_run"][RUNS:]

    # the faults happened: every exact point hit by its kill, most random kills in their
    # phase (the running phase only by those), every phase covered
    assert [run["position"] for run in exact_runs] == list(POINTS)
    assert all(run["injected"] for run in exact_runs), exact_runs
    random_faults = sum(run["injected"] for run in random_runs)
    assert random_faults == sum(out["random_faults_by_phase"].values()) >= RUNS - 4
    assert out["random_faults_by_phase"]["running"] >= 1, out["kill_points"]
    assert all(out["faults_by_phase"][p] >= 1 for p in PHASES), out["kill_points"]
    assert out["faults_injected"] == sum(out["faults_by_phase"].values())
    assert out["faults_injected"] == random_faults + len(POINTS)
    assert out["fault_runs"] == len(FAULTS)
    assert out["faults_by_kind"] == dict.fromkeys(FAULTS, 1), out["by_fault_run"]

    # nothing lost: the end state over the whole ledger, and after each run's reconcile
    lost = {k: out[k] for k in END_FIGURES}
    assert lost == dict.fromkeys(END_FIGURES, 0), (lost, out["messages"])
    each = {k: out["after_each_run"][k] for k in RUN_FIGURES}
    assert each == dict.fromkeys(RUN_FIGURES, 0), (each, out["messages"])
    assert out["lost"] == {}
    assert returncode == 0, stderr[-4000:]

    # ... and that was checked, not assumed
    end, wait = out["end"], out["end"]["wait"]
    assert out["jobs"] == end["jobs"] >= 2 * out["runs"]  # the others' rows at least
    # every run's org, team and sessions
    assert end["capped_scopes_checked"] == 4 * (out["runs"] + out["fault_runs"])
    assert end["prefect_slots_held"] == end["ledger_running_rate_cents"] == 0
    by_point = dict(zip(POINTS, exact_runs, strict=True))
    # admitted, no lease: the ledger keeps counting what Prefect never granted (transient)
    assert by_point["<ensure"]["reconciled"] == ["awaiting-lease-expiry"]
    assert by_point["<ensure"]["slot_transient_cents"] == RATE_ON_PATH
    # a lease granted, its id lost: Prefect holds the slots, the ledger the rate, until expiry
    assert by_point["<acquire"]["reconciled"] == ["awaiting-lease-expiry"]
    assert by_point["<acquire"]["unrecorded_lease_slots_cents"] == RATE_ON_PATH
    assert by_point["<acquire"]["slot_transient_cents"] == 0
    assert out["slot_mismatch_transient_cents"] >= RATE_ON_PATH
    # slots handed back, ledger not settled: reconcile settles it; the lease is recorded
    assert by_point["<release"]["reconciled"] == ["settled"]
    assert by_point["<record_lease"]["reconciled"] == ["settled"]
    assert by_point["<settle"]["reconciled"] == []
    # the end waited for the unrecorded lease's expiry: the server's repossessor returned its
    # slots, then reconcile settled the rows it had held open
    assert wait["awaiting_rows_at_start"] >= 2
    assert wait["unrecorded_lease_slots_at_start"] >= RATE_ON_PATH
    assert wait["slots_returned_after_s"] is not None
    assert wait["reconciled"].get("settled", 0) >= 2
    assert wait["waited_s"] >= wait["deadline_after_s"] > 0


# -- the audit ---------------------------------------------------------------------------------


def _row(job_id: str, admitted: float, settled: float | None, **extra: object) -> dict:
    """A ledger row as `Ledger.views.jobs` returns it: $3.60/h for a minute, reserved $0.06."""
    return {
        "id": job_id,
        "scope": "p1/t",
        "state": "settled" if settled is not None else "running",
        "rate_cents": 360,
        "rate_micro_per_hour": 3_600_000,
        "reserved_micro": 60_000,
        "reserve_seconds": 60.0,
        "max_runtime_s": 60.0,
        "admitted_at": admitted,
        "started_at": admitted,
        "ended_at": settled,
        "settled_at": settled,
        "actual_micro": None if settled is None else 1_000 * int(settled - admitted),
        **extra,
    }


def test_promise1_replay_finds_over_admission() -> None:
    now = time.time()
    cap = [BudgetRule("p1", hourly_cap_cents=720)]
    one_after_another = [_row(f"j{i}", now + 10 * i, now + 10 * i + 5) for i in range(4)]
    assert promise1_violations(one_after_another, cap) == []
    at_cap = [_row("a", now, now + 30), _row("b", now + 1, None)]
    assert promise1_violations(at_cap, cap) == []
    three = [*at_cap, _row("c", now + 2, now + 3)]
    [found] = promise1_violations(three, cap)
    assert "running rate of p1 1080 cents/h > cap 720" in found
    # a settlement stamped at the same instant as an admission frees its room first
    assert promise1_violations([*at_cap, _row("c", now + 30, None)], cap) == []

    budget = [BudgetRule("p1/t", period_budget_micro=100_000, period="month")]
    assert promise1_violations(at_cap, budget)  # two reservations of $0.06 > $0.10
    settled_small = [_row("a", now, now + 2), _row("b", now + 3, None)]
    assert promise1_violations(settled_small, budget) == []  # $0.002 settled + $0.06 held


def test_audit_finds_orphans_and_double_charges(tmp_path: Path) -> None:
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    ledger.config.set_budget(BudgetRule("au", hourly_cap_cents=720, period_budget_micro=10**6))
    job_id, decision = ledger.queue.request(new_job("au/t", holder=holder_id()))
    assert decision.verdict == "admit"
    started = time.time() - 10
    ledger.settlements.mark_started(job_id, started)
    ledger.settlements.settle(job_id, ended_at=started + 10, outcome="completed")  # exactly $0.01
    assert audit(ledger).ok

    with ledger.db.engine.begin() as conn:  # book the settlement a second time
        conn.execute(
            period_spend.update()
            .where(period_spend.c.scope == "au")
            .values(settled_micro=period_spend.c.settled_micro + 10_000)
        )
    found = audit(ledger)
    assert (found.double_charges, found.missing_charges) == (1, 0)
    assert "ledger holds $0.02, its settled jobs cost $0.01" in found.messages[0]

    dead = f"{os.uname().nodename}:{2**22 + 7}:1"  # above pid_max: never alive
    ledger.queue.request(new_job("au/t", holder=dead))
    found = audit(ledger, scope="au/t")  # in a capped scope, no lease recorded: it may hold one
    assert (found.orphans_left, found.awaiting_lease_expiry) == (0, 1)
    later = time.time() + UNRECORDED_LEASE_S + 1  # that lease's latest expiry is past
    assert audit(ledger, scope="au/t", now=later).orphans_left == 1
    assert [r.action for r in reconcile(ledger, now=later)] == ["settled"]
    assert audit(ledger, scope="au/t", now=later).orphans_left == 0
    ledger.db.dispose()


def test_audit_compares_prefect_slots_with_the_ledger(prefect_api: str, tmp_path: Path) -> None:
    from prefect_gpu_budget.admission.limits import RateLimits

    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    ledger.config.set_budget(BudgetRule("sl", hourly_cap_cents=720))
    limits = RateLimits()
    limits.ensure([("sl", 720)])
    job_id, _ = ledger.queue.request(new_job("sl/t", holder=holder_id()))
    lease = limits.acquire(["sl"], 360)
    assert lease is not None
    ledger.settlements.record_lease(job_id, lease)
    assert audit(ledger, limits).slot_mismatch_cents == 0
    outside = limits.acquire(["sl"], 100)  # slots the ledger knows nothing about
    assert outside is not None
    found = audit(ledger, limits)
    assert found.slot_mismatch_cents == 100
    assert "sl: Prefect holds 460 slots, ledger runs 360 cents/h" in found.messages
    limits.release(outside)
    ledger.settlements.settle(job_id, ended_at=time.time(), outcome="completed")
    assert audit(ledger, limits).slot_mismatch_cents == 360  # settled, lease not handed back
    limits.release(lease)
    assert audit(ledger, limits).ok
    limits.close()
    ledger.db.dispose()


def test_audit_counts_rows_awaiting_lease_expiry_apart(prefect_api: str, tmp_path: Path) -> None:
    from prefect_gpu_budget.admission.limits import RateLimits

    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    ledger.config.set_budget(BudgetRule("aw", hourly_cap_cents=720))
    limits = RateLimits()
    limits.ensure([("aw", 720)])
    dead = f"{os.uname().nodename}:{2**22 + 9}:1"  # above pid_max: never alive
    job_id, decision = ledger.queue.request(new_job("aw/t", holder=dead))
    assert decision.verdict == "admit"

    def slots(found) -> tuple[int | None, int | None, int | None]:
        return found.slot_mismatch_cents, found.slot_transient_cents, found.slot_unrecorded_cents

    # admitted, its holder dead before recording a lease: Prefect may not have granted one
    found = audit(ledger, limits)
    assert (found.orphans_left, found.awaiting_lease_expiry) == (0, 1)
    assert slots(found) == (0, 360, 0)
    assert found.ok
    lease = limits.acquire(["aw"], 360)  # or it did, and nobody knows the lease's id
    assert lease is not None
    assert slots(audit(ledger, limits)) == (0, 0, 360)
    extra = limits.acquire(["aw"], 100)  # more than the row explains
    assert extra is not None
    found = audit(ledger, limits)
    assert slots(found) == (100, 0, 360)
    assert (
        "aw: Prefect holds 460 slots, ledger runs 360 cents/h (360 of it awaiting lease expiry)"
        in found.messages
    )
    limits.release(extra)

    # past the lease's latest expiry reconcile settles the row; slots still held then (this
    # test server has no repossessor) are a mismatch
    later = time.time() + UNRECORDED_LEASE_S + 1
    assert [r.action for r in reconcile(ledger, limits, now=later)] == ["settled"]
    found = audit(ledger, limits, now=later)
    assert (found.orphans_left, found.awaiting_lease_expiry) == (0, 0)
    assert slots(found) == (360, 0, 0)
    limits.release(lease)
    assert audit(ledger, limits, now=later).ok
    limits.close()
    ledger.db.dispose()
