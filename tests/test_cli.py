"""Admin commands change only what they are given, atomically, under the org's lock.

Real processes race each other on SQLite and PostgreSQL: each sets a different field at once,
and every field's change survives (a read outside the write transaction loses all but one).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.policy import BudgetRule
from prefect_gpu_budget.blocks import GpuBudget
from tests.conftest import PG_URL
from tests.postgres import fresh_database

FIELD_CHANGES: list[tuple[list[str], str, object]] = [
    (["--hourly-cap", "123"], "hourly_cap_cents", 12_300),
    (["--period-budget", "10"], "period_budget_micro", 10_000_000),
    (["--period", "week"], "period", "week"),
    (["--timezone", "Europe/Berlin"], "timezone", "Europe/Berlin"),
    (["--on-limit", "reject"], "on_limit", "reject"),
    (["--max-wait", "2h"], "max_wait_s", 7200.0),
    (["--reservation-mode", "estimate"], "reservation_mode", "estimate"),
    (["--notify", "slack-webhook/ops"], "notify_block", "slack-webhook/ops"),
]


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.db'}"
        return
    with fresh_database(PG_URL) as fresh:
        yield fresh


def _cli_in_child(barrier, argv: list[str]) -> None:  # noqa: ANN001 - a multiprocessing Barrier
    from prefect_gpu_budget.cli import main

    sys.argv = ["prefect-gpu-budget", *argv]
    barrier.wait(timeout=120)
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    os._exit(code)


def _race(url: str, commands: list[list[str]]) -> list[int]:
    """Run each CLI command in its own process, all released at once; their exit codes."""
    import prefect_gpu_budget.cli  # noqa: F401 - imported once here, inherited by the children

    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(len(commands))
    procs = [
        ctx.Process(target=_cli_in_child, args=(barrier, ["--ledger-url", url, *argv]))
        for argv in commands
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=300)
    return [proc.exitcode for proc in procs]


def _start(url: str) -> Ledger:
    ledger = Ledger(url)
    ledger.set_budget(GpuBudget(scope="acme", hourly_cap_usd=1000, period_budget_usd=1000).rule())
    return ledger


def test_racing_budget_sets_each_keep_their_field(url: str) -> None:
    ledger = _start(url)
    try:
        codes = _race(url, [["budget", "set", "acme", *args] for args, _, _ in FIELD_CHANGES])
        assert codes == [0] * len(FIELD_CHANGES)
        [rule] = ledger.budgets()
        lost = {
            field: (getattr(rule, field), want)
            for _, field, want in FIELD_CHANGES
            if getattr(rule, field) != want
        }
        assert lost == {}, f"changes lost to a concurrent `budget set`: {lost}"
    finally:
        ledger.dispose()


def test_racing_session_template_sets_each_keep_their_field(url: str) -> None:
    ledger = Ledger(url)
    try:
        ledger.set_session_template(BudgetRule(scope="acme/agents", period_budget_micro=10**9))
        codes = _race(
            url,
            [
                ["budget", "set", "acme/agents", "--session-template", *args]
                for args, _, _ in FIELD_CHANGES
            ],
        )
        assert codes == [0] * len(FIELD_CHANGES)
        [rule] = ledger.session_templates()
        lost = {f: getattr(rule, f) for _, f, want in FIELD_CHANGES if getattr(rule, f) != want}
        assert lost == {}, f"changes lost to a concurrent `budget set`: {lost}"
    finally:
        ledger.dispose()


def test_racing_quotas_and_pool_set_all_survive(url: str) -> None:
    ledger = Ledger(url)
    try:
        pool = ["pool", "set", "acme", "lab", "--nodes", "4", "--gpus-per-node", "8"]
        assert _race(url, [pool]) == [0]
        teams = [f"team-{i}" for i in range(6)]
        commands = [
            ["pool", "quota", f"acme/{team}", "--pool", "lab", "--gpus", str(i + 1)]
            for i, team in enumerate(teams)
        ]
        commands.append([*pool, "--gpu-model", "h100"])  # the pool changes while quotas land
        assert _race(url, commands) == [0] * len(commands)
        [lab], quotas = ledger.capacity("acme")
        assert {q.team: q.quota[0] for q in quotas} == {
            f"acme/{team}": i + 1 for i, team in enumerate(teams)
        }
        assert lab.gpu_model == "h100"
    finally:
        ledger.dispose()


def test_a_bad_value_in_the_merged_rule_writes_nothing(tmp_path: Path, monkeypatch, capsys):
    from prefect_gpu_budget.cli import main

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = _start(url)
    before = ledger.budgets()
    # removing the only two limits is checked against the rule as it stands in the ledger
    argv = ["budget", "set", "acme", "--hourly-cap", "none", "--period-budget", "none"]
    monkeypatch.setattr(sys, "argv", ["prefect-gpu-budget", "--ledger-url", url, *argv])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.startswith("error: budget:") and "\n" not in err
    assert ledger.budgets() == before
