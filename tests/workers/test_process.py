"""The `gpu-budget-process` worker type against a real `prefect server start`, a real pool of
that type (`prefect work-pool create --type gpu-budget-process`), a real `prefect worker
start` and a PostgreSQL ledger: runs whose scope's cap fits one at a time run one after the
other, a run's own job variables may only narrow the scope (a `command`, an `env` or anything
its deployment did not list is refused with nothing reserved), a run is its whole process tree
(a `setsid` child is billed until it ends and stopped at max_runtime + kill grace), max_runtime
stops a run, and a worker killed mid-run leaves a job that reconcile settles.

Background children are real processes, found by a mark their deployment puts in their
environment (`TEST_TREE`), as the launcher tests find theirs."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.states import Cancelling

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.reconcile import reconcile
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.launchers.local import JOB_MARK_ENV, marked_processes
from prefect_gpu_budget.pricing.catalog import set_local_price
from tests.conftest import PG_URL
from tests.support.postgres import fresh_database
from tests.support.prefect_server import PrefectServer, stop_groups, wait_for

HERE = Path(__file__).parent
POOL = "gpu"
SCOPE = "lab/gpu"
KILL_GRACE_S = 10.0
"""A worker run's kill grace (`GpuJob`'s default: the pool has no variable for it)."""
SLACK_S = 5.0
"""What a busy 2-core machine may add to a bound on a process's life."""


def _engine_after(script: str) -> str:
    """A deployment's `command`: `script` in sh, then the flow run's engine as usual."""
    return shlex.join(["sh", "-c", f'{script}\nexec "$0" -m prefect.engine', sys.executable])


DEPLOYMENTS: dict[str, tuple[str, dict[str, Any]]] = {
    "gated": ("1m", {"env": {"GATED": "1"}}),
    "slow": ("3s", {}),
    "agents": ("1m", {"require_agent_token": True}),
    "orphan": ("1m", {"command": _engine_after("setsid sh -c 'sleep 30' &")}),
    "runaway": (
        "5s",
        {"command": _engine_after("""setsid sh -c 'trap "" TERM; sleep 60' &""")},
    ),
    "lenient": ("1m", {"run_may_set": ["stream_output"]}),
    "misconfigured": ("1m", {"run_may_set": ["max_runtime"]}),
}
"""name: (max_runtime, more job variables). `orphan` and `runaway` start a `setsid` child that
outlives the flow (the second ignores SIGTERM) before they run the flow's engine."""


@pytest.fixture(scope="module")
def house(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A server, a gated pool with the `DEPLOYMENTS` (each marking its processes with its own
    `TEST_TREE`), a PostgreSQL ledger whose cap holds one `local:box` run at a time, and a
    worker polling the pool."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    tmp = tmp_path_factory.mktemp("gated-worker")
    server = PrefectServer(tmp / "home").start()
    prices = set_local_price("box", "3.6", gpus=0, path=tmp / "prices.csv")
    marks = {name: uuid.uuid4().hex for name in DEPLOYMENTS}
    procs: list[subprocess.Popen] = []
    ledgers: list[Ledger] = []
    try:
        with fresh_database(PG_URL) as url:
            ledgers.append(Ledger(url))
            ledgers[0].config.set_budget(
                BudgetRule("lab", hourly_cap_cents=360, period_budget_micro=10**8)
            )
            env = server.client_env(
                PREFECT_GPU_BUDGET_LEDGER_URL=url,
                PREFECT_GPU_BUDGET_PRICES=str(prices),
                PREFECT_WORKER_QUERY_SECONDS="1",
            )
            created = subprocess.run(
                [sys.executable, "-m", "prefect", "work-pool", "create", POOL, "--type"]
                + ["gpu-budget-process"],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert created.returncode == 0, created.stdout + created.stderr
            with (
                pytest.MonkeyPatch.context() as mp,
                temporary_settings(updates={PREFECT_API_URL: server.api}),
            ):
                mp.setenv("PREFECT_API_URL", server.api)
                target = flow.from_source(source=str(HERE), entrypoint="gated_target.py:target")
                for name, (runtime, more) in DEPLOYMENTS.items():
                    marked = {**more.get("env", {}), "TEST_TREE": marks[name]}
                    target.deploy(
                        name=name,
                        work_pool_name=POOL,
                        job_variables={
                            "instance_type": "local:box",
                            "scope": SCOPE,
                            "max_runtime": runtime,
                            **more,
                            "env": marked,
                        },
                        build=False,
                        push=False,
                        print_next_steps=False,
                        ignore_warnings=True,
                    )
                worker = subprocess.Popen(
                    [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL],
                    env=env,
                    stdout=(tmp / "worker.log").open("w"),
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                procs.append(worker)
                yield {
                    "ledger": ledgers[0],
                    "worker": worker,
                    "procs": procs,
                    "marks": marks,
                    "tmp": tmp,
                }
                stop_groups(procs)
                procs.clear()
                ledgers[0].db.dispose()
    finally:
        stop_groups(procs)
        server.stop()


def _wait_final(flow_run_ids: list, timeout: float = 150) -> list:
    seen: list = []

    def final():
        with get_client(sync_client=True) as client:
            seen[:] = [client.read_flow_run(i) for i in flow_run_ids]
        return seen if all(r.state and r.state.is_final() for r in seen) else None

    try:
        return wait_for(final, timeout, "the flow runs to end")
    except AssertionError as late:  # say which run is stuck where
        raise AssertionError(f"{late}: {[r.state and r.state.name for r in seen]}") from None


def _settled(ledger: Ledger, scope: str, count: int) -> list[dict]:
    """The scope's rows once `count` of them are settled (the worker settles a run just after
    its process exits, a moment after the run's final state)."""
    return wait_for(
        lambda: (
            (rows := [r for r in ledger.views.jobs(scope) if r["state"] == "settled"])
            and len(rows) >= count
            and rows
        ),
        60,
        "the worker to settle",
    )


def _states(flow_run_id) -> list[str]:
    with get_client(sync_client=True) as client:
        return [s.name for s in client.read_flow_run_states(flow_run_id)]


@pytest.mark.timeout(400)
def test_runs_whose_cap_fits_one_run_one_after_the_other(house):
    ledger = house["ledger"]
    runs = [
        run_deployment("gated-target/gated", parameters={"seconds": 2}, timeout=0) for _ in range(3)
    ]
    ended = _wait_final([r.id for r in runs])
    assert [r.state.name for r in ended] == ["Completed"] * 3, [r.state for r in ended]
    rows = sorted(_settled(ledger, SCOPE, 3), key=lambda r: r["admitted_at"])
    assert len(rows) == 3 and {r["outcome"] for r in rows} == {"completed"}
    for before, after in zip(rows, rows[1:], strict=False):
        assert before["ended_at"] <= after["admitted_at"]  # never two at once
    assert all(2.0 <= r["billed_seconds"] < 60 for r in rows)  # the process's own start and end
    assert any("AwaitingBudget" in _states(r.id) for r in runs)


@pytest.mark.timeout(300)
def test_a_run_may_only_narrow_its_scope(house):
    ledger = house["ledger"]
    before = len(ledger.views.jobs())
    moved = run_deployment("gated-target/gated", job_variables={"scope": "other/x"}, timeout=0)
    cheaper = run_deployment(
        "gated-target/gated", job_variables={"instance_type": "local:free"}, timeout=0
    )
    narrowed = run_deployment(
        "gated-target/gated",
        parameters={"seconds": 0},
        job_variables={"scope": f"{SCOPE}/a"},
        timeout=0,
    )
    moved, cheaper, narrowed = _wait_final([moved.id, cheaper.id, narrowed.id])
    assert moved.state.name == "GateRefused"
    assert "not within the deployment's scope 'lab/gpu'" in moved.state.message
    assert cheaper.state.name == "GateRefused" and "instance_type" in cheaper.state.message
    assert narrowed.state.name == "Completed"
    assert len(ledger.views.jobs()) == before + 1 and ledger.views.jobs(f"{SCOPE}/a")


@pytest.mark.timeout(300)
def test_a_run_may_set_nothing_else_of_its_own(house):
    """A run's `command`, `env` (over a deployment's own `env`), `working_dir`, an unknown
    variable, or a `run_may_set` of its own: GateRefused naming it, no ledger row, nothing run.
    What a deployment lists in `run_may_set` a run may set; a list naming a gate variable
    refuses every run of the deployment."""
    ledger, tmp = house["ledger"], house["tmp"]
    pwned = tmp / "pwned"
    attacks = {
        "command": {"command": shlex.join(["sh", "-c", f"touch {pwned}"])},
        "env": {"env": {"PYTHONSTARTUP": str(pwned)}},
        "working_dir": {"working_dir": str(tmp)},
        "no_such_variable": {"no_such_variable": 1},
        "run_may_set": {"run_may_set": ["command"], "command": "true"},
    }
    runs = {
        key: run_deployment("gated-target/gated", job_variables=variables, timeout=0)
        for key, variables in attacks.items()
    }
    runs["lenient-command"] = run_deployment(
        "gated-target/lenient", job_variables={"command": "true"}, timeout=0
    )
    runs["misconfigured"] = run_deployment("gated-target/misconfigured", timeout=0)
    allowed = run_deployment(
        "gated-target/lenient",
        parameters={"seconds": 0},
        job_variables={"stream_output": False},
        timeout=0,
    )
    ended = dict(zip(runs, _wait_final([r.id for r in runs.values()]), strict=True))
    for key in attacks:
        state = ended[key].state
        assert state.name == "GateRefused", (key, state)
        assert f"job variable {key} is the deployment's to set, not a run's" in state.message
        assert "\n" not in state.message
    assert "job variable command is" in ended["lenient-command"].state.message
    assert ended["misconfigured"].state.name == "GateRefused"
    assert ended["misconfigured"].state.message == (
        "run_may_set: max_runtime is the gate's; a run can never set it"
    )
    for run in runs.values():
        assert not [r for r in ledger.views.jobs() if r["flow_run_id"] == str(run.id)], run.name
    assert not pwned.exists()
    [done] = _wait_final([allowed.id])
    assert done.state.name == "Completed", done.state
    assert _settled_row(ledger, allowed)["outcome"] == "completed"


def _settled_row(ledger: Ledger, run: Any) -> dict:
    return wait_for(lambda: _row_of(ledger, run, "settled"), 60, "the worker to settle")


class _Sleeper:
    """Watches, from outside, the `sleep` a deployment's command leaves behind (a process of
    the deployment's `TEST_TREE`): when it was last seen alive, and the run's mark
    (`GPU_BUDGET_JOB_MARK`) in its environment."""

    def __init__(self, mark: str) -> None:
        self.mark = mark
        self.last: float | None = None
        self.job_mark: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            for pid in marked_processes("TEST_TREE", self.mark):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as handle:
                        if handle.read().split(b"\0")[0] != b"sleep":
                            continue
                    with open(f"/proc/{pid}/environ", "rb") as handle:
                        environ = handle.read().split(b"\0")
                except OSError:
                    continue
                self.last = time.time()
                prefix = f"{JOB_MARK_ENV}=".encode()
                for item in environ:
                    if item.startswith(prefix):
                        self.job_mark = item[len(prefix) :].decode()
            time.sleep(0.1)

    def alive(self) -> bool:
        return self.last is not None and time.time() - self.last < 1.0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        assert self.last is not None and self.job_mark, "the child was never seen"


@pytest.mark.timeout(300)
def test_a_setsid_child_is_part_of_the_run_and_billed_until_it_ends(house):
    """The deployment's command starts `setsid sh -c 'sleep 30' &`, then the flow (which
    ends at once): the run is Completed, but it is billed until the child ended, and nothing
    of its tree is left when it is settled."""
    ledger, mark = house["ledger"], house["marks"]["orphan"]
    child = _Sleeper(mark)
    run = run_deployment("gated-target/orphan", parameters={"seconds": 0}, timeout=0)
    [ended] = _wait_final([run.id])
    assert ended.state.name == "Completed", ended.state
    wait_for(child.alive, 10, "the child alive after its flow ended")  # sampled every 0.1 s
    assert _row_of(ledger, run)["state"] == "running"  # and the run is still billed
    row = _settled_row(ledger, run)
    child.stop()
    assert row["outcome"] == "completed", row
    assert 30.0 <= row["billed_seconds"] < 60, row  # the child's life, not the flow's
    assert child.last <= row["ended_at"] < child.last + SLACK_S
    assert marked_processes(JOB_MARK_ENV, child.job_mark) == []
    assert marked_processes("TEST_TREE", mark) == []


@pytest.mark.timeout(300)
def test_a_child_that_ignores_sigterm_is_killed_at_max_runtime_plus_grace(house):
    """The deployment's command leaves a `setsid` child that ignores SIGTERM and would sleep
    60 s; max_runtime is 5 s: the child is SIGKILLed at max_runtime + kill grace, the run
    ends `timed_out`, billed no more than its reservation, and nothing of it is left."""
    ledger, mark = house["ledger"], house["marks"]["runaway"]
    child = _Sleeper(mark)
    run = run_deployment("gated-target/runaway", parameters={"seconds": 0}, timeout=0)
    row = wait_for(lambda: _row_of(ledger, run, "settled"), 150, "the worker to settle")
    child.stop()
    reserve = 5.0 + KILL_GRACE_S
    assert row["outcome"] == "timed_out", row
    assert row["reserve_seconds"] == reserve, row
    assert reserve - 1.0 <= row["billed_seconds"] <= reserve, row  # killed, not stretched
    assert child.last - row["started_at"] > 5.0 + 1  # it outlived the SIGTERM at max_runtime
    # billed until the child was gone, or its reservation ran out if the kill landed later
    assert min(child.last, row["started_at"] + reserve) <= row["ended_at"]
    assert row["ended_at"] <= row["started_at"] + reserve
    assert marked_processes(JOB_MARK_ENV, child.job_mark) == []
    assert marked_processes("TEST_TREE", mark) == []


@pytest.mark.timeout(300)
def test_a_deployment_that_requires_an_agent_token_binds_the_run_to_its_session(house):
    """Without a token, with a revoked one, or with one whose session lies outside the
    deployment's scope: refused, nothing reserved. With the agent's own: the run spends in its
    session, under its grant."""
    ledger = house["ledger"]
    ledger.config.set_budget(BudgetRule(f"{SCOPE}/agent-1", period_budget_micro=10**7))
    ledger.config.set_budget(BudgetRule("lab/elsewhere/agent-2", period_budget_micro=10**7))
    token = ledger.grants.grant_agent(f"{SCOPE}/agent-1")
    outside = ledger.grants.grant_agent("lab/elsewhere/agent-2")
    revoked = ledger.grants.grant_agent(f"{SCOPE}/agent-1")
    ledger.grants.revoke_agent(f"{SCOPE}/agent-1")  # revokes both of that session's tokens
    token = ledger.grants.grant_agent(f"{SCOPE}/agent-1")
    before = len(ledger.views.jobs())
    runs = {
        "none": run_deployment("gated-target/agents", parameters={"seconds": 0}, timeout=0),
        "revoked": run_deployment(
            "gated-target/agents", job_variables={"agent_token": revoked}, timeout=0
        ),
        "outside": run_deployment(
            "gated-target/agents", job_variables={"agent_token": outside}, timeout=0
        ),
        "own": run_deployment(
            "gated-target/agents",
            parameters={"seconds": 0},
            job_variables={"agent_token": token},
            timeout=0,
        ),
        "unlock": run_deployment(
            "gated-target/agents", job_variables={"require_agent_token": False}, timeout=0
        ),
    }
    ended = dict(zip(runs, _wait_final([r.id for r in runs.values()]), strict=True))
    assert ended["none"].state.name == "GateRefused"
    assert "must carry an agent's token" in ended["none"].state.message
    assert ended["revoked"].state.name == "GateRefused"
    assert "unknown or revoked token" in ended["revoked"].state.message
    assert ended["outside"].state.name == "GateRefused"
    assert "'lab/elsewhere/agent-2' is not within the run's scope 'lab/gpu'" in (
        ended["outside"].state.message
    )
    assert ended["unlock"].state.name == "GateRefused"
    assert "require_agent_token is the deployment's to set" in ended["unlock"].state.message
    for run in ended.values():
        assert token not in (run.state.message or "") and outside not in (run.state.message or "")
    assert ended["own"].state.name == "Completed", ended["own"].state
    assert len(ledger.views.jobs()) == before + 1
    [row] = _settled(ledger, f"{SCOPE}/agent-1", 1)
    assert row["flow_run_id"] == str(runs["own"].id) and row["outcome"] == "completed"


@pytest.mark.timeout(300)
def test_max_runtime_stops_the_run_and_bills_what_ran(house):
    ledger = house["ledger"]
    run = run_deployment("gated-target/slow", parameters={"seconds": 60}, timeout=0)
    [ended] = _wait_final([run.id], timeout=120)
    assert ended.state.is_crashed() or ended.state.is_failed() or ended.state.is_cancelled()
    row = wait_for(
        lambda: next(
            (
                r
                for r in ledger.views.jobs(SCOPE)
                if r["flow_run_id"] == str(run.id) and r["state"] == "settled"
            ),
            None,
        ),
        60,
        "the worker to settle",
    )
    assert row["outcome"] == "timed_out" and 3.0 <= row["billed_seconds"] < 30


def _row_of(ledger: Ledger, run: Any, state: str | None = None) -> dict | None:
    rows = [r for r in ledger.views.jobs(SCOPE) if r["flow_run_id"] == str(run.id)]
    return next((r for r in rows if state is None or r["state"] == state), None)


@pytest.mark.timeout(300)
def test_a_run_cancelled_while_it_waits_gives_up_its_place(house):
    ledger = house["ledger"]
    # long enough to be still running when the second is cancelled, on a loaded machine too
    busy = run_deployment("gated-target/gated", parameters={"seconds": 30}, timeout=0)
    wait_for(lambda: _row_of(ledger, busy, "running"), 120, "the first run to start")
    waiting = run_deployment("gated-target/gated", parameters={"seconds": 0}, timeout=0)
    queued = wait_for(lambda: _row_of(ledger, waiting, "queued"), 60, "the second to queue")
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(waiting.id, Cancelling())
    try:
        gone = wait_for(lambda: _row_of(ledger, waiting, "cancelled"), 30, "its place given up")
    except AssertionError as late:
        raise AssertionError(f"{late}: {_row_of(ledger, waiting)} {_states(waiting.id)}") from None
    assert gone["id"] == queued["id"] and gone["started_at"] is None
    assert _row_of(ledger, busy, "running")  # the running one goes on
    ended, cancelled = _wait_final([busy.id, waiting.id])
    assert ended.state.name == "Completed" and cancelled.state.is_cancelled()


@pytest.mark.timeout(300)
def test_a_run_cancelled_while_it_runs_is_stopped_and_settled_for_what_ran(house):
    ledger = house["ledger"]
    run = run_deployment("gated-target/gated", parameters={"seconds": 45}, timeout=0)
    wait_for(lambda: _row_of(ledger, run, "running"), 120, "the run to start")
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run.id, Cancelling())
    [ended] = _wait_final([run.id], timeout=120)
    assert ended.state.is_cancelled(), ended.state
    row = wait_for(lambda: _row_of(ledger, run, "settled"), 60, "the worker to settle")
    assert row["billed_seconds"] < 40, row  # stopped, not run out


@pytest.mark.timeout(300)
def test_a_worker_killed_mid_run_leaves_a_job_reconcile_settles(house):
    ledger = house["ledger"]
    run = run_deployment("gated-target/gated", parameters={"seconds": 30}, timeout=0)

    def admitted():
        rows = [r for r in ledger.views.jobs(SCOPE) if r["flow_run_id"] == str(run.id)]
        return rows[0] if rows and rows[0]["started_at"] else None

    wait_for(admitted, 120, "the run to start")
    os.killpg(house["worker"].pid, signal.SIGKILL)
    house["worker"].wait()
    house["procs"].remove(house["worker"])
    time.sleep(1)
    done = {r.job_id: r.action for r in reconcile(ledger)}
    row = admitted() or next(r for r in ledger.views.jobs(SCOPE) if r["flow_run_id"] == str(run.id))
    assert done.get(row["id"]) == "settled", done
    assert ledger.views.job(row["id"])["state"] == "settled"
    # the run's holder saw its worker die and killed the run's tree: nothing runs unmetered
    wait_for(lambda: not marked_processes("TEST_TREE", house["marks"]["gated"]), 10, "no tree")
