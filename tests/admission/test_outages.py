"""Dependencies that go away and come back: the Prefect server restarted in the middle of a
sweep, PostgreSQL (a cluster of the test's own) restarted in the middle of admissions. Nothing
is lost or duplicated, no slot leaks, the gate says clearly what is down while it is down, and
recovers on its own."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from prefect_gpu_budget.admission.gate import Gate
from prefect_gpu_budget.admission.holding import GateEvents
from prefect_gpu_budget.admission.ledger import ACTIVE, Ledger
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.pricing.catalog import set_local_price
from prefect_gpu_budget.testing.postgres import ensure_database, name_of
from tests.support.postgres import PrivateCluster, private_cluster
from tests.support.prefect_server import PrefectServer, http, wait_for

SPEC = """
name: restart
scope: acme/sweeps
job: {instance_type: "local:box", max_runtime: 60s, kill_grace: 1s}
command: [%(python)s, -c, "import time; time.sleep(2)", "{i}"]
grid: {i: [0, 1, 2, 3, 4, 5]}
parallelism: 6
results_dir: %(results)s
"""


@pytest.mark.timeout(600)
def test_prefect_server_restarted_in_the_middle_of_a_sweep(tmp_path: Path):
    server = PrefectServer(tmp_path / "home").start()
    try:
        prices = set_local_price("box", "3.6", path=tmp_path / "prices.csv")
        ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
        ledger.config.set_budget(
            BudgetRule("acme", hourly_cap_cents=720, period_budget_micro=10**9)
        )
        spec = tmp_path / "spec.yaml"
        spec.write_text(
            SPEC % {"python": json.dumps(sys.executable), "results": str(tmp_path / "results")}
        )
        sweep = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"from prefect_gpu_budget.sweeps.flow import gpu_sweep; gpu_sweep({str(spec)!r})",
            ],  # noqa: E501
            env=server.client_env(
                PREFECT_GPU_BUDGET_LEDGER_URL=ledger.url,
                PREFECT_GPU_BUDGET_PRICES=str(prices),
                PREFECT_LOGGING_LEVEL="INFO",
            ),
            stdout=(tmp_path / "sweep.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        wait_for(
            lambda: ledger.views.jobs("acme/sweeps", states=("running",)), 180, "a running trial"
        )
        server.stop()  # two trials hold slots; the others wait for the cap
        time.sleep(3)
        server.start()
        assert sweep.wait(timeout=400) == 0, (tmp_path / "sweep.log").read_text()[-3000:]

        rows = ledger.views.jobs("acme/sweeps")
        assert sorted(r["name"] for r in rows) == [f"restart/{i:04d}" for i in range(6)]
        assert all(r["state"] == "settled" and r["outcome"] == "completed" for r in rows), [
            (r["name"], r["state"], r["outcome"], r["reason"]) for r in rows
        ]
        limits = http(f"{server.api}/v2/concurrency_limits/filter", {})
        ours = {c["name"]: c["active_slots"] for c in limits if c["name"].startswith("gpu-budget")}
        assert ours and all(active == 0 for active in ours.values()), ours
    finally:
        server.stop()


@pytest.mark.timeout(600)
def test_postgresql_restarted_in_the_middle_of_admissions(prices):
    """On a cluster of the test's own: the shared server is never stopped."""
    with private_cluster() as cluster:
        url = f"{cluster.server}/gpu_budget_outage"
        ensure_database(url)
        _admit_through_a_restart(cluster, url)


def _admit_through_a_restart(cluster: PrivateCluster, url: str) -> None:
    ledger = Ledger(url)
    ledger.config.set_budget(BudgetRule("acme", hourly_cap_cents=1080, period_budget_micro=10**9))
    ledger.config.set_budget(BudgetRule("acme/agents"))  # the agents' team; the org's limits bind
    messages: list[str] = []
    gate = Gate(ledger, events=GateEvents(warning=messages.append), poll_s=0.05)
    job = GpuJob(instance_type="local:race", max_runtime="60s", kill_grace="1s")
    done: list[str] = []
    errors: list[BaseException] = []

    def agent(index: int) -> None:
        try:
            for _ in range(5):
                admission = gate.admit(job, f"acme/agents/a{index}")
                gate.holding.started(admission, time.time(), f"test:{index}")
                time.sleep(0.3)
                gate.holding.settle(admission, ended_at=time.time(), outcome="completed")
                done.append(admission.job_id)
        except BaseException as exc:  # reported below
            errors.append(exc)

    agents = [threading.Thread(target=agent, args=(i,)) for i in range(6)]
    for thread in agents:
        thread.start()
    wait_for(lambda: len(done) >= 3, 120, "the first settlements")
    cluster.stop()  # three jobs run, three wait, while the database is gone
    time.sleep(4)
    cluster.start()
    for thread in agents:
        thread.join(timeout=300)
    assert not errors, errors
    assert len(done) == 30 == len(set(done))

    rows = ledger.views.jobs()
    assert len(rows) == 30 and {r["id"] for r in rows} == set(done)  # none lost, none twice
    assert not [r for r in rows if r["state"] in ACTIVE]
    org, team = ledger.views.status("acme")  # charged once each: the period's sum is the jobs' sum
    assert (org["scope"], team["scope"]) == ("acme", "acme/agents")
    assert org["settled_micro"] == sum(r["actual_micro"] for r in rows) > 0
    assert org["reserved_micro"] == 0 and org["running"] == 0
    assert any("the ledger's database is unreachable" in m for m in messages), messages
    assert any("back after" in m for m in messages), messages
    assert not [m for m in messages if "postgres@" in m or name_of(url) in m]
    ledger.db.dispose()
