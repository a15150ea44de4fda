"""Priority classes an admin defines in the ledger, as Kueue's WorkloadPriorityClass objects:
a job names one, the gate resolves it when the job is recorded, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from prefect_gpu_budget.admission.gate import Gate
from prefect_gpu_budget.admission.ledger import NewJob
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.units import BudgetInputError
from tests.cli.support import cli_run as _cli_run
from tests.support.jobs import new_job


def _job(priority: object, **kw) -> GpuJob:
    return GpuJob(instance_type="aws:g5.xlarge", max_runtime="1h", priority=priority, **kw)


def test_an_orgs_own_class_orders_the_queue_and_unknown_names_write_nothing(ledger):
    ledger.config.set_budget(BudgetRule("acme", hourly_cap_cents=101, max_wait_s=86400))
    ledger.config.set_budget(BudgetRule("beta", hourly_cap_cents=1000))
    for team in ("acme/a", "acme/b"):  # the teams jobs run in; the org's cap binds
        ledger.config.set_budget(BudgetRule(team, max_wait_s=86400))
    ledger.config.set_budget(BudgetRule("beta/x"))
    ledger.config.set_priority_class("acme", "urgent", 500, "deadline work")
    ledger.config.set_priority_class("acme", "scavenger", -500)
    gate = Gate(ledger, poll_s=0.02)

    running = gate.admit(_job("scavenger"), "acme/a/s")  # the cap holds one g5 at a time
    assert ledger.views.job(running.job_id)["priority"] == -500
    high, waits = ledger.queue.request(_record(gate, _job("high"), "acme/a/s"))
    urgent, also = ledger.queue.request(_record(gate, _job("urgent"), "acme/b/s"))
    assert waits.verdict == also.verdict == "wait"
    assert ledger.views.job(urgent)["priority"] == 500
    gate.holding.settle(running, ended_at=time.time(), outcome="completed")
    assert ledger.queue.try_admit(high, "acme/a/s").verdict == "wait"  # the urgent one goes first
    assert ledger.queue.try_admit(urgent, "acme/b/s").verdict == "admit"

    before = len(ledger.views.jobs())
    with pytest.raises(BudgetInputError) as unknown:
        gate.admit(_job("urgnet"), "acme/a/s")
    assert str(unknown.value) == (
        "priority: no priority class 'urgnet' in acme; did you mean urgent? "
        "known: urgent, high, normal, low, scavenger"
    )
    with pytest.raises(BudgetInputError, match="no priority class 'urgent' in beta"):
        gate.admit(_job("urgent"), "beta/x/s")  # classes are an org's own
    assert len(ledger.views.jobs()) == before

    ledger.config.set_priority_class("acme", "urgent", 50)  # redefined: new jobs only, as in Kueue
    assert ledger.views.job(urgent)["priority"] == 500
    assert ledger.config.priority_values("acme/a/s")["urgent"] == 50
    assert ledger.config.remove_priority_class("acme", "urgent")
    assert not ledger.config.remove_priority_class("acme", "urgent")
    with pytest.raises(BudgetInputError, match="high is a class every org has"):
        ledger.config.set_priority_class("acme", "high", 5)
    with pytest.raises(BudgetInputError, match="value: must be an integer in -1000..1000"):
        ledger.config.set_priority_class("acme", "huge", 5000)


def _record(gate: Gate, job: GpuJob, scope: str) -> NewJob:
    """What the gate records for `job` (to queue it without waiting for it)."""
    named = job.priority if isinstance(job.priority, str) else None
    return new_job(
        scope,
        instance_type=job.instance_type,
        rate_micro_per_hour=gate.quote(job).rate_micro_per_hour,
        rate_cents=101,
        priority=0 if named else job.priority,
        priority_class=named,
        max_runtime_s=job.reserve_runtime_s,
    )


def test_the_block_and_the_cli_define_and_show_an_orgs_classes(tmp_path):
    from prefect_gpu_budget.admission.ledger import Ledger
    from prefect_gpu_budget.blocks import GpuPriorityClass

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    GpuPriorityClass(org="acme", name="urgent", value=500, description="deadlines").apply(
        Ledger(url)
    )
    env = {**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": url}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return _cli_run(env, *args)

    assert cli("priority", "set", "acme", "scavenger", "--value", "-500").returncode == 0
    listed = json.loads(cli("priority", "list", "acme", "--json").stdout)
    assert [(c["name"], c["value"], c["defined_by"]) for c in listed] == [
        ("urgent", 500, "acme"),
        ("high", 100, "built-in"),
        ("normal", 0, "built-in"),
        ("low", -100, "built-in"),
        ("scavenger", -500, "acme"),
    ]
    shown = cli("capacity", "acme").stdout
    assert "priority classes: urgent=500, high=100, normal=0, low=-100, scavenger=-500" in shown
    refused = cli("priority", "set", "acme", "low", "--value", "7")
    assert refused.returncode == 2
    assert refused.stderr.strip() == "error: name: low is a class every org has (high, normal, low)"
