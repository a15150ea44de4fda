"""`cancel` and `ledger`: an admin's stop, as Slurm's scancel, and why a job that never ran ended."""

from __future__ import annotations

import json
import os
import sys
import time

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from tests.cli.support import cli_run
from tests.support.jobs import new_job


def test_cancel_ends_a_queued_job_and_stops_a_running_one_as_scancel(tmp_path):
    url = f"sqlite:///{tmp_path / 'l.db'}"
    env = {**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": url}
    ledger = Ledger(url)
    ledger.config.set_budget(BudgetRule("sc", hourly_cap_cents=360))
    running, _ = ledger.queue.request(new_job("sc/s"))
    assert ledger.settlements.mark_started(running, time.time())
    queued, waits = ledger.queue.request(new_job("sc/s"))
    assert waits.verdict == "wait"
    before = ledger.views.jobs()
    for wrong, said in (
        ("", "no job"),
        ("zzz", "no job zzz"),
        ("%", "no job %"),
    ):
        done = cli_run(env, "cancel", queued[:8], wrong)
        assert done.returncode == 2 and said in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert ledger.views.jobs() == before  # a bad id anywhere stops nothing
    done = cli_run(env, "cancel", queued[:8], running[:8], "--reason", "runaway sweep")
    assert done.returncode == 0, done.stderr
    assert f"{queued[:8]} sc/s: cancelled" in done.stdout
    assert f"{running[:8]} sc/s: stopping" in done.stdout
    rows = {r["id"]: r for r in ledger.views.jobs()}
    assert rows[queued]["state"] == "cancelled" and rows[queued]["reason"] == "runaway sweep"
    assert rows[running]["stop_asked_at"] is not None  # its holder stops and settles it
    again = cli_run(env, "cancel", queued)
    assert again.returncode == 2 and "has ended (cancelled)" in again.stderr, again.stderr
    ledger.db.dispose()


def test_the_ledger_names_why_a_job_that_never_ran_ended(tmp_path, monkeypatch, capsys):
    from prefect_gpu_budget.cli import main
    from tests.support.jobs import new_job

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    ledger.config.set_budget(BudgetRule("acme", hourly_cap_cents=100, on_limit="reject"))
    refused, decision = ledger.queue.request(new_job("acme/t", name="nightly/0007"))
    assert decision.verdict == "reject"
    monkeypatch.setenv("PREFECT_GPU_BUDGET_LEDGER_URL", url)
    monkeypatch.setattr(sys, "argv", ["prefect-gpu-budget", "ledger", "--json"])
    main()
    [row] = json.loads(capsys.readouterr().out)
    assert (row["id"], row["outcome"], row["sweep"], row["trial"]) == (
        refused,
        "refused",
        "nightly",
        7,
    )


def test_the_ledger_pages_back_before_a_job_and_refuses_an_unknown_one(tmp_path):
    url = f"sqlite:///{tmp_path / 'l.db'}"
    env = {**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": url}
    ledger = Ledger(url)
    ledger.config.set_budget(BudgetRule("pg", period_budget_micro=10**9))
    ids = [ledger.queue.request(new_job("pg/s"), now=1_000_000.0 + i)[0] for i in range(5)]
    first = json.loads(cli_run(env, "ledger", "--json", "--limit", "2").stdout)
    assert [j["id"] for j in first] == ids[3:]
    done = cli_run(env, "ledger", "--json", "--limit", "2", "--before", first[0]["id"])
    assert done.returncode == 0, done.stderr
    assert [j["id"] for j in json.loads(done.stdout)] == ids[1:3]
    wrong = cli_run(env, "ledger", "--before", ids[0][:8])
    assert wrong.returncode == 2 and "before: no job" in wrong.stderr, wrong.stderr
