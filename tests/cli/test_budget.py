"""`budget set` changes only what it is given, atomically, under the org's lock (real processes
race each other on SQLite and PostgreSQL, each setting a different field: every change
survives), and says in one line when the cap it keeps is not the one given or a parent's binds."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from tests.cli.support import cli_run, race, start

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


def test_racing_budget_sets_each_keep_their_field(url: str) -> None:
    ledger = start(url)
    try:
        codes = race(url, [["budget", "set", "acme", *args] for args, _, _ in FIELD_CHANGES])
        assert codes == [0] * len(FIELD_CHANGES)
        [rule] = ledger.config.budgets()
        lost = {
            field: (getattr(rule, field), want)
            for _, field, want in FIELD_CHANGES
            if getattr(rule, field) != want
        }
        assert lost == {}, f"changes lost to a concurrent `budget set`: {lost}"
    finally:
        ledger.db.dispose()


def test_racing_session_template_sets_each_keep_their_field(url: str) -> None:
    ledger = Ledger(url)
    try:
        ledger.config.set_session_template(
            BudgetRule(scope="acme/agents", period_budget_micro=10**9)
        )
        codes = race(
            url,
            [
                ["budget", "set", "acme/agents", "--session-template", *args]
                for args, _, _ in FIELD_CHANGES
            ],
        )
        assert codes == [0] * len(FIELD_CHANGES)
        [rule] = ledger.config.session_templates()
        lost = {f: getattr(rule, f) for _, f, want in FIELD_CHANGES if getattr(rule, f) != want}
        assert lost == {}, f"changes lost to a concurrent `budget set`: {lost}"
    finally:
        ledger.db.dispose()


def test_a_bad_value_in_the_merged_rule_writes_nothing(tmp_path: Path, monkeypatch, capsys):
    from prefect_gpu_budget.cli import main

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = start(url)
    before = ledger.config.budgets()
    # removing the only two limits is checked against the rule as it stands in the ledger
    argv = ["budget", "set", "acme", "--hourly-cap", "none", "--period-budget", "none"]
    monkeypatch.setattr(sys, "argv", ["prefect-gpu-budget", "--ledger-url", url, *argv])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.startswith("error: budget:") and "\n" not in err
    assert ledger.config.budgets() == before


def test_a_child_cap_above_its_parents_is_set_with_a_warning(tmp_path):
    env = {**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": f"sqlite:///{tmp_path / 'l.db'}"}
    assert cli_run(env, "budget", "set", "acme", "--hourly-cap", "60").returncode == 0
    done = cli_run(env, "budget", "set", "acme/vision", "--hourly-cap", "500")
    assert done.returncode == 0
    assert done.stderr.strip() == (
        "warning: the cap $500.00/h of acme/vision is above the $60.00/h of acme, which binds"
    )
    assert "budget set for acme/vision: cap $500.00/h" in done.stdout  # one line when piped


def test_a_cap_that_is_not_whole_cents_is_set_with_a_warning(tmp_path):
    """Caps are whole cents per hour, rounded down: a finer cap is kept lower, said in one
    line; one under a cent admits nothing, and says so. A whole-cent cap says nothing."""
    env = {**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": f"sqlite:///{tmp_path / 'l.db'}"}
    done = cli_run(env, "budget", "set", "acme", "--hourly-cap", "3.605")
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == (
        "warning: the cap $3.605/h of acme is kept as $3.60/h "
        "(caps are whole cents per hour, rounded down)"
    )
    done = cli_run(env, "budget", "set", "acme/tiny", "--hourly-cap", "0.004", "--new")
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == (
        "warning: the cap $0.004/h of acme/tiny is kept as $0.00/h (caps are whole cents per "
        "hour, rounded down): no job will be admitted in it"
    )
    done = cli_run(env, "budget", "set", "acme", "--hourly-cap", "3.61")
    assert done.returncode == 0 and done.stderr.strip() == "", done.stderr
