"""`@gpu_task` in real flow runs against a real Prefect server: a cap of two never runs three
bodies at once, a body past max_runtime pays for what it ran, a body that borrowed a pool's
capacity is stopped when its lender takes it back (and queued again, or ends `Preempted`), a
body its owner stops ends Cancelled, refusals are final, retries are new admissions, settings
move per task and per call, async bodies are gated alike, and a flow's `job_defaults` (a
sweep's, an agent's) fill what a task does not set and bound its scope."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from prefect import flow, unmapped
from prefect.task_runners import ThreadPoolTaskRunner

from prefect_gpu_budget import GpuBudget, SpendLedger, current_job, gpu_task, job_defaults
from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.prices import default_catalog
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.admission.rules.quota import Pool, TeamQuota, proportional
from prefect_gpu_budget.pricing.catalog import set_local_price
from prefect_gpu_budget.sweeps import flow as sweep
from prefect_gpu_budget.units import BudgetInputError
from tests.support.jobs import new_job
from tests.support.prefect_server import wait_for

MACHINE = "local:h100x8"


def _most_at_once(spans: list[tuple[float, float]]) -> int:
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


@pytest.fixture
def lab(prefect_api, prices, tmp_path):
    """A ledger where lab's cap holds two `local:box` jobs ($3.60/h each) at once."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    GpuBudget(scope="lab", hourly_cap_usd="7.2", period_budget_usd=50).apply(ledger)
    GpuBudget(scope="lab/tight", hourly_cap_usd="1", on_limit="reject").apply(ledger)
    for team in ("sweep", "slow", "retry", "a", "b", "flow"):  # lab has teams: each must exist
        ledger.config.set_budget(BudgetRule(f"lab/{team}"))
    return ledger, SpendLedger(database_url=url)


def test_a_cap_of_two_never_runs_three_bodies_and_each_run_settles_once(lab):
    ledger, block = lab
    spans: list[tuple[float, float]] = []
    lock = threading.Lock()

    @gpu_task(instance_type="local:box", scope="lab/sweep", max_runtime="1m", ledger=block)
    def train(lr: float) -> float:
        started = time.time()
        job = current_job()
        assert job.scope == "lab/sweep" and job.instance_type == "local:box"
        time.sleep(1.0)
        with lock:
            spans.append((started, time.time()))
        return lr * 2

    @flow(task_runner=ThreadPoolTaskRunner(max_workers=5))
    def search() -> list[float]:
        return [f.result() for f in train.map([1.0, 2.0, 3.0, 4.0, 5.0])]

    assert search() == [2.0, 4.0, 6.0, 8.0, 10.0]
    rows = ledger.views.jobs("lab/sweep")
    assert len(rows) == 5 and {r["outcome"] for r in rows} == {"completed"}
    assert {r["launcher"] for r in rows} == {"task"}
    assert _most_at_once(spans) <= 2  # from the bodies' own clocks
    assert _most_at_once([(r["admitted_at"], r["ended_at"]) for r in rows]) <= 2
    assert min(s for s, _ in spans) >= min(r["admitted_at"] for r in rows)  # never before
    for row in rows:  # billed from the body's real start and end
        assert 1.0 <= row["billed_seconds"] < 10
        assert row["actual_micro"] == round(3_600_000 * row["billed_seconds"] / 3600)
    with pytest.raises(RuntimeError, match="only inside the body"):
        current_job()


def test_past_max_runtime_a_body_is_stopped_and_pays_for_what_it_ran(lab):
    ledger, block = lab

    @gpu_task(
        instance_type="local:box",
        scope="lab/slow",
        max_runtime="2s",
        kill_grace="1s",
        ledger=block,
    )
    def forever() -> None:
        while True:  # a training loop: back in Python often, where the stop lands
            time.sleep(0.05)

    @flow
    def run() -> tuple[str, str]:
        state = forever(return_state=True)
        return state.name, state.message

    begun = time.time()
    name, message = run()
    assert name == "TimedOut" and "stopped at max_runtime 2s" in message
    assert time.time() - begun < 30
    [row] = ledger.views.jobs("lab/slow")
    assert row["outcome"] == "timed_out" and 2.0 <= row["billed_seconds"] < 6
    assert row["actual_micro"] < row["reserved_micro"]


@pytest.fixture
def teams(prefect_api, ledger_url, tmp_path, monkeypatch):
    """A pool of two `MACHINE` nodes, one per team's quota; team B may borrow A's idle one.
    B's own node is taken by a job held elsewhere, so B's next job borrows."""
    prices = set_local_price("h100x8", "8", gpus=8, path=tmp_path / "prices.csv")
    monkeypatch.setenv("PREFECT_GPU_BUDGET_PRICES", str(prices))
    default_catalog.cache_clear()
    ledger = Ledger(ledger_url)
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    pool = Pool("acme", "lab-a", 2, (8, 192, 2048), (MACHINE,), "H100")
    ledger.config.set_pool(
        pool,
        [
            TeamQuota("lab-a", "acme/a", proportional(pool, 8)),
            TeamQuota("lab-a", "acme/b", proportional(pool, 8), borrow_pct=100),
        ],
    )
    own, decision = ledger.queue.request(
        new_job(
            "acme/b/s",
            name="b-own",
            instance_type=MACHINE,
            rate_micro_per_hour=8_000_000,
            rate_cents=800,
            node_gpus=8,
            max_runtime_s=600.0,
        )
    )
    assert decision.verdict == "admit", decision.reason
    yield ledger, SpendLedger(database_url=ledger_url)
    ledger.settlements.settle(own, ended_at=time.time(), outcome="completed", scope="acme/b/s")
    ledger.db.dispose()
    default_catalog.cache_clear()


def _running(ledger: Ledger, scope: str, count: int) -> None:
    wait_for(
        lambda: len(ledger.views.jobs(scope, states=("running",))) >= count, 120, f"{scope} runs"
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("requeue", [False, True])
def test_a_borrowing_body_is_stopped_when_its_lender_takes_the_capacity_back(teams, requeue):
    """Team B's body borrows A's idle node; A's job within A's quota arrives: B's body is
    stopped (an exception raised in its thread), settled `preempted` for what it ran, and A's
    job is admitted. With `requeue` B's body is queued again and runs once A's is done; else
    its run ends `Preempted`, and its retries do not run it again."""
    ledger, block = teams
    runs: list[float] = []

    @gpu_task(
        instance_type=MACHINE,
        scope="acme/b/s",
        max_runtime="5m",
        ledger=block,
        retries=2,
        requeue=requeue,
    )
    def borrowed() -> int:
        runs.append(time.time())
        if len(runs) > 1:  # queued again: its checkpoint says it is almost done
            return len(runs)
        while True:  # a training loop: back in Python often, where the stop lands
            time.sleep(0.05)

    @gpu_task(instance_type=MACHINE, scope="acme/a/s", max_runtime="1m", ledger=block)
    def lender() -> str:
        return current_job().job_id

    @flow(task_runner=ThreadPoolTaskRunner(max_workers=2))
    def contention() -> tuple:
        taken = borrowed.submit()
        _running(ledger, "acme/b", 1)  # its own node is held elsewhere, admitted
        mine = lender.submit()
        mine.wait()
        taken.wait()
        return taken.state, mine.result()

    state, mine = contention()
    first, *again = [r for r in ledger.views.jobs("acme/b") if r["name"] != "b-own"]
    lent = ledger.views.job(mine)
    assert first["outcome"] == "preempted" and first["preempt_at"] is not None, first
    assert 0 < first["actual_micro"] < first["reserved_micro"]  # paid for what it ran
    assert lent["outcome"] == "completed" and lent["admitted_at"] >= first["ended_at"]
    if requeue:
        assert state.name == "Completed" and state.result() == 2
        [second] = again
        assert second["outcome"] == "completed" and second["admitted_at"] >= lent["ended_at"]
    else:
        assert state.name == "Preempted", state
        assert f"preempted for job {mine[:8]}" in state.message
        assert "in pool lab-a was taken back" in state.message
        assert again == [] and len(runs) == 1  # not retried as if it failed


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_body_its_owner_stops_ends_cancelled_and_pays_for_what_ran(lab, kind):
    """`ledger.settlements.ask_stop` (an agent's cancel of its running trial) reaches a body as it
    reaches a command: a sync body in the flow's own (main) thread, an async one in the task
    runner's event loop."""
    ledger, block = lab
    ledger.config.set_budget(BudgetRule("lab/stop"))  # the team it spends in
    settings = {"instance_type": "local:box", "scope": "lab/stop/s", "max_runtime": "5m"}

    def stop_when_running() -> None:
        _running(ledger, "lab/stop", 1)
        [row] = ledger.views.jobs("lab/stop", states=("running",))
        ledger.settlements.ask_stop(row["id"], "stopped from a test")

    if kind == "sync":

        @gpu_task(**settings, ledger=block)
        def body() -> None:
            while True:
                time.sleep(0.05)
    else:

        @gpu_task(**settings, ledger=block)
        async def body() -> None:
            while True:
                await asyncio.sleep(0.05)

    @flow
    def run() -> tuple[bool, str]:
        threading.Thread(target=stop_when_running, daemon=True).start()
        if kind == "sync":  # in this (the main) thread
            state = body(return_state=True)
        else:  # in its task runner's thread and event loop
            future = body.submit()
            future.wait()
            state = future.state
        return state.is_cancelled(), state.message

    cancelled, message = run()
    [row] = ledger.views.jobs("lab/stop")
    assert cancelled and message.startswith("stopped from a test; cost ")
    assert row["outcome"] == "cancelled" and 0 < row["actual_micro"] < row["reserved_micro"]


def test_refusals_are_final_and_retries_are_new_admissions(lab):
    ledger, block = lab
    tries: list[str] = []

    @gpu_task(instance_type="local:box", max_runtime="1m", ledger=block, retries=2)
    def flaky() -> str:
        tries.append(current_job().job_id)
        if len(tries) == 1:
            raise ValueError("first try fails")
        return "ok"

    @flow
    def run() -> tuple[str, str, str]:
        refused = flaky.with_options(gpu={"scope": "lab/tight"})(return_state=True)
        return refused.name, refused.message, flaky(gpu={"scope": "lab/retry"})

    name, message, retried = run()
    assert name == "OverBudget" and "hourly cap $1.00/h of lab/tight" in message
    assert len(ledger.views.jobs("lab/tight")) == 1  # refused once, never retried into a loop
    assert retried == "ok" and len(tries) == 2 and tries[0] != tries[1]
    rows = {r["id"]: r["outcome"] for r in ledger.views.jobs("lab/retry")}
    assert rows == {tries[0]: "failed", tries[1]: "completed"}


def test_async_bodies_and_per_call_settings(lab):
    ledger, block = lab

    @gpu_task(instance_type="local:box", max_runtime="1m", scope="lab/a", ledger=block)
    async def evaluate(x: int) -> str:
        await asyncio.sleep(0.1)
        return current_job().scope

    @flow(task_runner=ThreadPoolTaskRunner(max_workers=2))
    def run():
        moved = evaluate.map([1, 2], gpu=unmapped({"scope": "lab/b"}))
        return [f.result() for f in moved]

    assert run() == ["lab/b", "lab/b"]
    assert len(ledger.views.jobs("lab/b")) == 2 and ledger.views.jobs("lab/a") == []
    with pytest.raises(ValueError, match="unknown setting 'colour'"):
        evaluate.with_options(gpu={"colour": "red"})


def test_a_flows_defaults_fill_what_a_task_leaves_out_and_its_scope_only_narrows(lab, tmp_path):
    ledger, block = lab

    @gpu_task(max_runtime="1m")
    def probe() -> tuple[str, str, float]:
        job = current_job()
        return job.scope, job.instance_type, job.deadline - time.time()

    elsewhere = probe.with_options(gpu={"scope": "other/x"})
    own_ledger = probe.with_options(
        gpu={"ledger": SpendLedger(database_url=f"sqlite:///{tmp_path / 'own.db'}")}
    )

    @flow
    def run() -> dict:
        with job_defaults(scope="lab/flow", ledger=block, instance_type="local:box"):
            out = {
                "inherited": probe(),
                "narrowed": probe(gpu={"scope": "lab/flow/a"}),
                "moved": elsewhere(return_state=True),
                "other ledger": own_ledger(return_state=True),
            }
            with (
                pytest.raises(BudgetInputError, match="not within the enclosing"),
                job_defaults(scope="lab/wider"),
            ):
                pass
            with job_defaults(scope="lab/flow/b", max_runtime="2m"):  # nests: narrows
                out["nested"] = probe()
        return out

    out = run()
    assert out["inherited"][:2] == ("lab/flow", "local:box")
    assert out["inherited"][2] <= 60  # the decorator's max_runtime wins over no default
    assert out["narrowed"][0] == "lab/flow/a"
    assert out["nested"][0] == "lab/flow/b" and out["nested"][2] <= 60  # the task's 1m wins
    moved, other = out["moved"], out["other ledger"]
    assert moved.name == "GateRefused"
    assert moved.message == "scope 'other/x' is not within its flow's scope 'lab/flow'"
    assert other.name == "GateRefused" and "another ledger" in other.message
    assert ledger.views.jobs("other/x") == [] and not (tmp_path / "own.db").exists()  # nothing held
    assert {r["scope"] for r in ledger.views.jobs()} == {"lab/flow", "lab/flow/a", "lab/flow/b"}


def test_a_sweep_gives_its_tasks_its_scope_shape_ledger_and_agent_grant(lab, monkeypatch):
    ledger, block = lab
    GpuBudget(scope="lab/agents/a7", hourly_cap_usd="7.2").apply(ledger)
    _, grant = ledger.grants.agent_grant(ledger.grants.grant_agent("lab/agents/a7"))

    @gpu_task()
    def inside() -> str:
        return current_job().job_id

    wider = inside.with_options(gpu={"scope": "lab/elsewhere"})
    seen: list = []

    def body(*_args: object) -> None:  # what runs inside the sweep's defaults
        seen.extend([inside(return_state=True), wider(return_state=True)])

    monkeypatch.setattr(sweep, "_sweep", body)
    spec = sweep.SweepSpec.model_validate(
        {
            "name": "ctx",
            "scope": "lab/agents/a7",
            "job": {"instance_type": "local:box", "max_runtime": "30s", "priority": 5},
            "command": ["true"],
        }
    )

    @flow
    def agent_like() -> None:
        sweep.run_sweep(spec, block, grant=grant)

    agent_like()
    ran, refused = seen
    row = ledger.views.job(ran.result())
    assert row["scope"] == "lab/agents/a7" and row["instance_type"] == "local:box"
    assert row["outcome"] == "completed" and row["priority"] == 5
    assert refused.name == "GateRefused" and "within its flow's scope" in refused.message
    ledger.grants.revoke_agent("lab/agents/a7")  # the grant is the flow's: revoked, its tasks stop
    seen.clear()
    agent_like()
    assert seen[0].name != "Completed" and "grant was revoked" in seen[0].message
