"""The deployment launcher against a real `prefect server start`, a `process` work pool, a
real `prefect worker start` subprocess and a ledger on PostgreSQL: jobs run as flow runs of
`deploy_target.py`, are billed from the flow runs' own start to max_runtime at least (their end
is nothing the job could not forge), and are cancelled at max_runtime or on abort.
"""

from __future__ import annotations

import contextvars
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.context import FlowRunContext
from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter
from prefect.events.worker import EventsWorker
from prefect.exceptions import ObjectNotFound
from prefect.states import Pending
from pydantic import ValidationError

from prefect_gpu_budget.admission.gate import Gate
from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.lifecycle import run_admitted
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.base import LaunchConfigError, Launcher, LaunchResult
from prefect_gpu_budget.launchers.deployment import DeploymentLauncher
from prefect_gpu_budget.launchers.followed_flow_run import END_NOT_OBSERVED, PROCESS_ENDED_EVENT
from prefect_gpu_budget.settings import JOB_ID_ENV, METRICS_ENV
from prefect_gpu_budget.worker_types import PROCESS_TYPE
from tests.conftest import PG_URL
from tests.support.postgres import fresh_database
from tests.support.prefect_server import PrefectServer, stop_groups, wait_for

POOL = "gpu-process"
IDLE_POOL = "gpu-idle"  # no worker polls it: its flow runs never start
GATED_POOL = "gpu-gated"  # a gated worker type's pool: a launcher must not reserve twice
LABELLED_POOL = "gpu-labelled"  # nobody polls these two: one's template sets default labels,
UNLABELLED_POOL = "gpu-unlabelled"  # the other's declares no `labels` variable
POOL_LABELS = {"cost-center": "lab"}
DEPLOYMENT_LABELS = {"team": "vision"}
SCOPE = "acme/vision/agent-7"
METRICS_FILE = "/job/metrics.jsonl"  # only handed to the job's environment, never written
HERE = Path(__file__).parent


def _templates() -> dict[str, dict[str, Any]]:
    """Process pool templates: one whose `labels` variable has a default, one without it."""
    from prefect.workers.process import ProcessWorker

    labelled = ProcessWorker.get_default_base_job_template()
    labelled["variables"]["properties"]["labels"]["default"] = POOL_LABELS
    unlabelled = ProcessWorker.get_default_base_job_template()
    del unlabelled["variables"]["properties"]["labels"], unlabelled["job_configuration"]["labels"]
    return {LABELLED_POOL: labelled, UNLABELLED_POOL: unlabelled}


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A real server, the target deployed to a process pool (and to a pool nobody polls),
    and a worker subprocess polling the first."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    tmp = tmp_path_factory.mktemp("deployment-launcher")
    server = PrefectServer(tmp / "home", durable_leases=False).start()
    api = server.api
    env = server.client_env(PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_LOGGING_LEVEL="INFO")
    procs = [server.proc]
    try:
        with (
            pytest.MonkeyPatch.context() as mp,
            temporary_settings(updates={PREFECT_API_URL: api}),
        ):
            mp.setenv("PREFECT_API_URL", api)
            with get_client(sync_client=True) as client:
                for name, kind in ((POOL, "process"), (IDLE_POOL, "process")) + (
                    (GATED_POOL, PROCESS_TYPE),
                ):
                    client.create_work_pool(WorkPoolCreate(name=name, type=kind))
                for name, template in _templates().items():
                    client.create_work_pool(
                        WorkPoolCreate(name=name, type="process", base_job_template=template)
                    )
            worker = subprocess.Popen(  # starts up while the target is deployed
                [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL]
                + ["--type", "process"],
                env=env,
                stdout=(tmp / "worker.log").open("w"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            procs.append(worker)
            target = flow.from_source(source=str(HERE), entrypoint="deploy_target.py:target")
            for name, work_pool in (
                ("sweep", POOL),
                ("idle", IDLE_POOL),
                ("gated", GATED_POOL),
                ("labelled", LABELLED_POOL),
                ("unlabelled", UNLABELLED_POOL),
            ):
                target.deploy(
                    name=name,
                    work_pool_name=work_pool,
                    job_variables={"labels": DEPLOYMENT_LABELS} if name == "labelled" else None,
                    build=False,
                    push=False,
                    print_next_steps=False,
                    ignore_warnings=True,
                )
            yield {"api": api, "tmp": tmp}
            EventsWorker.drain_all(timeout=10)  # send this process's events while the server runs
    finally:
        stop_groups(procs)


@pytest.fixture
def gate(prices: Path) -> Iterator[Gate]:
    """A gate on a PostgreSQL ledger of this test's own."""
    with fresh_database(PG_URL) as url:
        ledger = Ledger(url)
        ledger.config.set_budget(
            BudgetRule("acme", hourly_cap_cents=2000, period_budget_micro=10_000_000)
        )
        ledger.config.set_budget(BudgetRule("acme/vision"))  # SCOPE's team exists; the org's bind
        try:
            yield Gate(ledger)
        finally:
            ledger.db.dispose()


def _launcher(out: Path, seconds: float, forge: str = "", **kwargs: Any) -> DeploymentLauncher:
    out.mkdir(exist_ok=True)
    return DeploymentLauncher(
        deployment="gpu-target/sweep",
        parameters={"seconds": seconds, "out": str(out), "forge": forge},
        poll_s=0.2,
        **kwargs,
    )


def _run(
    gate: Gate, launcher: DeploymentLauncher, job: GpuJob, log: Callable[[str], None] = print
) -> tuple[LaunchResult | None, dict]:
    """What the job-running task does: admit, preflight, run, settle however it ends."""
    launcher.preflight(job, gate.quote(job))
    admission = gate.admit(job, SCOPE, launcher=launcher.kind)
    result = None
    try:
        result = launcher.run(
            job,
            admission.quote,
            on_start=lambda started, ext: gate.holding.started(admission, started, ext),
            log=log,
            env={METRICS_ENV: METRICS_FILE},
        )
    finally:
        if result is None:
            row = gate.holding.settle(admission, ended_at=time.time(), outcome="cancelled")
        else:
            row = gate.holding.settle(admission, ended_at=result.ended_at, outcome=result.outcome)
    return result, row


def _never(started: float, external_id: str) -> None:
    raise AssertionError("on_start called for a job that never started")


def _flow_run(flow_run_id: str) -> FlowRun:
    with get_client(sync_client=True) as client:
        return client.read_flow_run(UUID(flow_run_id))


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def _record(out: Path, flow_run_id: str) -> dict:
    return json.loads((out / f"{flow_run_id}.json").read_text())


@pytest.mark.timeout(180)
def test_a_job_runs_as_a_flow_run_and_is_billed_to_its_max_runtime(pool, gate, tmp_path):
    """A job that ends after a second: its end is nothing the launcher can observe that the job
    could not have forged, so it keeps its slot and is billed until max_runtime, and says so."""
    launcher = _launcher(tmp_path / "out", seconds=1.0)
    assert isinstance(launcher, Launcher)
    job = GpuJob(instance_type="local:box", max_runtime="8s", kill_grace="2s", env={"A": "1"})
    lines: list[str] = []

    @flow(name="gpu-caller")
    def caller() -> tuple[LaunchResult | None, dict, UUID, float]:
        """A sweep's flow run: the job's flow run is linked under it."""
        result, row = _run(gate, launcher, job, lines.append)
        return result, row, FlowRunContext.get().flow_run.id, time.time()

    result, row, caller_id, returned = caller()

    assert result is not None and result.outcome == "completed", lines
    flow_run = _flow_run(row["external_id"])
    assert flow_run.state.type == StateType.COMPLETED
    # run without a ledger job id in its env: no mark
    assert "labels" not in flow_run.job_variables
    assert not any(tag.startswith("gpu-budget-job") for tag in flow_run.tags)
    with get_client(sync_client=True) as client:
        parent = client.read_task_run(flow_run.parent_task_run_id)
    assert parent.flow_run_id == caller_id  # linked as a subflow of the calling run
    assert parent.task_key.endswith("run_deployment.gpu-target-sweep")
    assert row["started_at"] == flow_run.start_time.timestamp() == result.started_at
    # billed to max_runtime (or to its reported end, were that later), its slot held as long
    assert row["ended_at"] == result.ended_at
    deadline = row["started_at"] + 8.0
    assert row["ended_at"] >= max(deadline, flow_run.end_time.timestamp())
    assert returned >= deadline
    # said when nothing later was reported or seen (the rule: a busy machine may end it later)
    assert (row["ended_at"] == deadline) == (END_NOT_OBSERVED in result.detail), result.detail
    assert any(result.detail.split("; ")[-1] in line for line in lines), lines
    assert abs(row["actual_micro"] - 1000 * (row["ended_at"] - row["started_at"])) <= 1  # $3.6/h
    assert result.capacity_wait_s == pytest.approx(
        flow_run.start_time.timestamp() - flow_run.created.timestamp()
    )
    assert result.capacity_wait_s > 0
    record = _record(tmp_path / "out", row["external_id"])
    assert record["job"] == job.model_dump(mode="json", exclude={"env"})
    assert record["environ"][METRICS_ENV] == METRICS_FILE and record["environ"]["A"] == "1"
    assert any("Running" in line for line in lines) and any("Completed" in line for line in lines)

    # (d) reconcile's view of a flow run that ran: running (its end is never observed), so
    # an orphan stays metered until the max runtime its ledger row holds
    probe = launcher.probe(row["external_id"])
    assert (probe.state, probe.started_at) == ("running", row["started_at"])


@pytest.mark.timeout(180)
def test_max_runtime_cancels_the_flow_run_and_bills_only_what_ran(pool, gate, tmp_path):
    launcher = _launcher(tmp_path / "out", seconds=120.0)
    job = GpuJob(instance_type="local:box", max_runtime="4s", kill_grace="2s")
    done: list[tuple[LaunchResult | None, dict]] = []
    run = contextvars.copy_context().run  # the thread talks to this module's server too
    runner = threading.Thread(target=run, args=(lambda: done.append(_run(gate, launcher, job)),))
    runner.start()
    try:
        # (d) reconcile's view of it while it runs: running, since its real start
        [live] = wait_for(lambda: gate.ledger.views.jobs(SCOPE, ("running",)), 90, "a started job")
        probe = launcher.probe(live["external_id"])
        assert probe.state == "running" and probe.started_at == live["started_at"]
    finally:
        runner.join(timeout=120)
    [(result, row)] = done

    assert result is not None and result.outcome == "timed_out", result
    flow_run = _flow_run(row["external_id"])
    assert flow_run.state.type == StateType.CANCELLED
    assert not _alive(_record(tmp_path / "out", row["external_id"])["pid"])
    assert row["started_at"] == flow_run.start_time.timestamp()
    assert row["ended_at"] >= flow_run.end_time.timestamp()  # its process was seen until then
    assert 4.0 <= row["billed_seconds"] < 60  # stopped after max_runtime, long before its sleep


def _process_ended_events(flow_run_id: str) -> list[Any]:
    """The `prefect.worker.executed-flow-run` events that name this flow run."""
    with get_client(sync_client=True) as client:
        wanted = EventFilter(
            event=EventNameFilter(name=[PROCESS_ENDED_EVENT]),
            related=EventRelatedFilter(
                resources_in_roles=[(f"prefect.flow-run.{flow_run_id}", "flow-run")]
            ),
        )
        return client.read_events(filter=wanted, limit=5).events


class LastAlive(threading.Thread):
    """Watches processes while `runner` runs: `last`, the last moment one of them was alive."""

    def __init__(self, pids: list[int], runner: threading.Thread) -> None:
        super().__init__(daemon=True)
        self.pids, self.runner, self.last = pids, runner, 0.0
        self.start()

    def run(self) -> None:
        while self.runner.is_alive():
            if any(_alive(pid) for pid in self.pids):
                self.last = time.time()
            time.sleep(0.1)


def _in_thread(
    gate: Gate, launcher: DeploymentLauncher, job: GpuJob, done: list
) -> threading.Thread:
    run = contextvars.copy_context().run  # the thread talks to this module's server too
    runner = threading.Thread(target=run, args=(lambda: done.append(_run(gate, launcher, job)),))
    runner.start()
    return runner


@pytest.mark.timeout(240)
def test_a_final_state_forced_from_outside_is_billed_until_the_process_ends(
    pool, gate, tmp_path, caplog
):
    """Someone with API access forces the job's flow run to Completed while its process runs
    on: billing ends neither there nor at max_runtime while the process still runs here; at
    max_runtime it is called suspicious, and its worker is asked to kill it."""
    out = tmp_path / "out"
    launcher = _launcher(out, seconds=60.0)
    job = GpuJob(instance_type="local:box", max_runtime="10s", kill_grace="2s")
    done: list[tuple[LaunchResult | None, dict]] = []
    with caplog.at_level("WARNING", logger="prefect_gpu_budget.launchers.deployment"):
        runner = _in_thread(gate, launcher, job, done)
        try:
            [live] = wait_for(lambda: gate.ledger.views.jobs(SCOPE, ("running",)), 90, "a start")
            run_id = live["external_id"]
            wait_for(lambda: (out / f"{run_id}.json").exists(), 30, "the target's record")
            pid = _record(out, run_id)["pid"]
            forged = urllib.request.Request(
                f"{pool['api']}/flow_runs/{run_id}/set_state",
                data=json.dumps({"state": {"type": "COMPLETED"}, "force": True}).encode(),
                headers={"Content-Type": "application/json"},
                method="POST",
            )
            with urllib.request.urlopen(forged, timeout=30) as response:
                assert json.loads(response.read())["status"] == "ACCEPT"
            forged_at = time.time()
            assert _flow_run(run_id).state.type == StateType.COMPLETED
            watch = LastAlive([pid], runner)
        finally:
            runner.join(timeout=180)
    watch.join(timeout=10)
    last_alive = watch.last
    [(result, row)] = done

    assert result is not None and result.outcome == "timed_out", result
    assert "suspicious" in result.detail and run_id in result.detail
    assert "still run here" in result.detail
    assert row["billed_seconds"] >= 10.0 - 0.01, row  # to max_runtime, not to the forged end
    assert row["ended_at"] > forged_at
    assert row["ended_at"] >= last_alive > row["started_at"] + 10.0  # it ran past max_runtime
    assert not _alive(pid)  # its worker was asked to kill it: it did
    assert any("suspicious" in r.getMessage() and run_id in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("forge", ["end", "delete"])
@pytest.mark.timeout(240)
def test_a_job_that_forges_its_own_end_is_billed_until_it_really_stops(pool, gate, tmp_path, forge):
    """The attacker as the flow run's own code (which holds the run's API access, as every flow
    run's code does): it forces its run Completed and posts the worker's executed-flow-run
    event for it (`end`), or deletes its run (`delete`), and runs on, with a child in a session
    of its own that its worker's kill of the process group misses. Neither ends its bill: it is
    billed to max_runtime at least and until the last of its processes is gone (its worker
    kills the flow's process when it can, the launcher what is left here), and the job's
    detail says why."""
    out = tmp_path / "out"
    launcher = _launcher(out, seconds=120.0, forge=forge, cancel_wait_s=3.0)
    job = GpuJob(instance_type="local:box", max_runtime="10s", kill_grace="2s")
    done: list[tuple[LaunchResult | None, dict]] = []
    runner = _in_thread(gate, launcher, job, done)
    try:
        [live] = wait_for(lambda: gate.ledger.views.jobs(SCOPE, ("running",)), 90, "a start")
        run_id = live["external_id"]
        wait_for(lambda: (out / f"{run_id}.forged").exists(), 60, "the job to forge its end")
        forged_at = float((out / f"{run_id}.forged").read_text())
        record = _record(out, run_id)
        pids = [record["pid"], record["child"]]
        watch = LastAlive(pids, runner)
        assert all(_alive(pid) for pid in pids)  # it runs on past its forged end
        if forge == "end":
            forged = _flow_run(run_id)
            assert forged.state.type == StateType.COMPLETED
            assert live["started_at"] < forged.end_time.timestamp() <= forged_at
            events = wait_for(lambda: _process_ended_events(run_id), 60, "the forged event")
            assert [e.resource.id for e in events] == ["prefect.worker.process.forged"]
        else:
            with pytest.raises(ObjectNotFound):
                _flow_run(run_id)
    finally:
        runner.join(timeout=180)
    watch.join(timeout=10)
    last_alive = watch.last
    [(result, row)] = done

    assert result is not None, done
    assert result.outcome == ("timed_out" if forge == "end" else "failed"), result
    assert "suspicious" in result.detail and "still run here" in result.detail, result.detail
    assert row["billed_seconds"] >= 10.0 - 0.01, row  # not to the forged end
    # it ran on past its forged end and past max_runtime, and was billed until it really stopped
    assert row["ended_at"] >= last_alive > max(forged_at, row["started_at"] + 10.0)
    assert not any(_alive(pid) for pid in pids)
    assert row["actual_micro"] == pytest.approx(1000 * row["billed_seconds"], abs=1)  # $3.6/h


class Interrupted(BaseException):
    """Stands for the calling run being cancelled while the job runs."""


@pytest.mark.parametrize("at", ["created", "Running"])
@pytest.mark.timeout(180)
def test_an_interrupted_run_cancels_the_flow_run_before_reraising(pool, gate, tmp_path, at):
    """Interrupted as soon as the flow run exists (it never runs: nothing is billed), or once
    it runs (billed from its real start until the interruption)."""
    out = tmp_path / "out"
    launcher = _launcher(out, seconds=120.0)
    job = GpuJob(instance_type="local:box", max_runtime="10m", kill_grace="2s")
    ids: list[str] = []

    def log(line: str) -> None:
        ids.extend(re.findall(r"\(([0-9a-f-]{36})\)", line)[:1])
        if at in line:
            if at == "Running":  # let it record its pid first
                wait_for(lambda: (out / f"{ids[0]}.json").exists(), 30, "the target's record")
            raise Interrupted

    with pytest.raises(Interrupted):
        _run(gate, launcher, job, log)
    flow_run = _flow_run(ids[0])
    [row] = gate.ledger.views.jobs(SCOPE)
    assert row["state"] == "settled" and row["outcome"] == "cancelled"
    if at == "created":
        # Cancelled at once, or (if a worker had taken it) Cancelling, which can never run
        assert flow_run.state.type in (StateType.CANCELLED, StateType.CANCELLING)
        assert flow_run.run_count == 0 and not (out / f"{ids[0]}.json").exists()
        assert row["started_at"] is None and row["actual_micro"] == 0
        assert launcher.probe(ids[0]).state == "finished"
        return
    assert flow_run.state.type == StateType.CANCELLED  # ended before the interruption re-raised
    assert not _alive(_record(out, ids[0])["pid"])
    assert row["external_id"] == ids[0]
    assert row["started_at"] == flow_run.start_time.timestamp()
    assert flow_run.end_time.timestamp() <= row["ended_at"] < flow_run.end_time.timestamp() + 5


@pytest.mark.timeout(120)
def test_a_flow_run_that_never_starts_expires_and_costs_nothing(pool, gate):
    launcher = DeploymentLauncher(deployment="gpu-target/idle", start_timeout=1.0, poll_s=0.2)
    job = GpuJob(instance_type="local:box", max_runtime="60s")
    result = launcher.run(job, gate.quote(job), on_start=_never, log=print)

    assert result.outcome == "wait_expired"
    assert result.started_at == result.ended_at
    assert result.capacity_wait_s >= 1.0
    assert _flow_run(result.external_id).state.type == StateType.CANCELLED


@pytest.mark.timeout(120)
@pytest.mark.parametrize("labelled", [True, False])
def test_a_gated_flow_run_is_marked_with_its_ledger_job_id(pool, gate, labelled):
    """Through the gate (`run_admitted`), the flow run is tagged gpu-budget-job:<ledger job id>;
    where its pool's template declares `labels`, its labels (which its worker puts on the
    infrastructure it creates) carry gpu-budget-job=<id> beside those of the pool, the
    deployment and the launcher (a flow run's `labels` replace its deployment's); where the
    template declares none, none are set. Its environment carries the id."""
    launcher = DeploymentLauncher(
        deployment=f"gpu-target/{'labelled' if labelled else 'unlabelled'}",
        job_variables={"labels": {"sweep": "lr"}} if labelled else {},
        tags=["sweep"],
        start_timeout=1.0,
        poll_s=0.2,
    )
    job = GpuJob(instance_type="local:box", max_runtime="60s")
    launcher.preflight(job, gate.quote(job))
    admission = gate.admit(job, SCOPE, launcher=launcher.kind)
    ended = run_admitted(gate, admission, launcher)

    assert ended.result.outcome == "wait_expired" and ended.row["id"] == admission.job_id
    job_id = ended.row["id"]
    flow_run = _flow_run(ended.result.external_id)
    assert {"sweep", f"gpu-budget-job:{job_id}"} <= set(flow_run.tags)
    assert flow_run.job_variables["env"] == {JOB_ID_ENV: job_id}
    if labelled:
        labels = {**POOL_LABELS, **DEPLOYMENT_LABELS, "sweep": "lr", "gpu-budget-job": job_id}
        assert flow_run.job_variables["labels"] == labels
    else:
        assert "labels" not in flow_run.job_variables


@pytest.mark.timeout(60)
def test_preflight_refuses_a_wrong_deployment_in_one_line_and_writes_nothing(pool, gate):
    job = GpuJob(instance_type="local:box", max_runtime="60s")
    cases = [
        (DeploymentLauncher(deployment="gpu-target/missing"), "no deployment 'gpu-target/missing'"),
        (
            DeploymentLauncher(deployment="gpu-target/sweep", job_parameter="spec"),
            "has no parameter 'spec'",
        ),
        (
            DeploymentLauncher(deployment="gpu-target/gated"),
            f"runs on work pool 'gpu-gated' of type {PROCESS_TYPE}, which passes each run",
        ),
    ]
    for launcher, reason in cases:
        with pytest.raises(LaunchConfigError) as info:
            _run(gate, launcher, job)
        assert reason in str(info.value) and "\n" not in str(info.value)
        assert str(info.value).startswith("deployment launcher: ")
    assert gate.ledger.views.jobs() == []
    with pytest.raises(ValidationError, match="flow-name/deployment-name"):
        DeploymentLauncher(deployment="sweep")
    # past preflight (deleted since, say): a launch error, nothing started
    result = cases[0][0].run(job, gate.quote(job), on_start=_never, log=print)
    assert result.outcome == "launch_error" and result.runtime_s == 0
    assert "could not create a flow run of gpu-target/missing" in result.detail


@pytest.mark.timeout(60)
def test_probe_and_stop_flow_runs_waiting_to_start(pool):
    """A scheduled run is cancelled outright; a pending one (a worker took it) goes to
    Cancelling, from which the server never lets it run: both are over at once, unbilled."""
    from prefect.deployments import run_deployment

    launcher = DeploymentLauncher(deployment="gpu-target/idle")
    scheduled, pending = (
        run_deployment("gpu-target/idle", timeout=0, as_subflow=False) for _ in range(2)
    )
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(pending.id, Pending())  # as a worker does on taking it
    for flow_run in (scheduled, pending):
        probe = launcher.probe(str(flow_run.id))
        assert (probe.state, probe.started_at) == ("running", None)  # may start, and bill, soon
        began = time.monotonic()
        launcher.stop(str(flow_run.id), grace=2.0)
        assert time.monotonic() - began < 10  # no wait for a run that cannot start any more
        stopped = _flow_run(str(flow_run.id))
        assert stopped.run_count == 0
        never = launcher.probe(str(flow_run.id))
        assert never.state == "finished" and never.started_at == never.ended_at
    assert _flow_run(str(scheduled.id)).state.type == StateType.CANCELLED
    assert _flow_run(str(pending.id)).state.type == StateType.CANCELLING
    assert launcher.probe("not-a-flow-run").state == "unknown"
    assert launcher.probe(str(UUID(int=1))).state == "unknown"


@pytest.mark.timeout(60)
def test_a_saved_launcher_loads_back_by_name(pool):
    saved = DeploymentLauncher(
        deployment="gpu-target/sweep",
        parameters={"seconds": 1},
        job_variables={"env": {"A": "1"}},
        start_timeout=600,
    )
    saved.save("sweeps", overwrite=True)
    loaded = DeploymentLauncher.load("sweeps")
    assert loaded.model_dump() == saved.model_dump() and loaded.kind == "deployment"
