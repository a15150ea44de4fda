"""Mistakes caught in one line: a scope close to a known one (did you mean), and a command
group named alone (its help, no traceback)."""

from __future__ import annotations

import os

import pytest

from prefect_gpu_budget.admission.ledger import Ledger
from tests.cli.support import cli_run


def test_mistakes_are_caught_with_did_you_mean(tmp_path):
    env = {**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": f"sqlite:///{tmp_path / 'l.db'}"}
    assert cli_run(env, "budget", "set", "acme", "--hourly-cap", "60").returncode == 0
    assert cli_run(env, "budget", "set", "acme/vision", "--hourly-cap", "20").returncode == 0
    typo = cli_run(env, "budget", "set", "acme/visoin/agent-7", "--hourly-cap", "5")
    assert typo.returncode == 2
    assert typo.stderr.strip() == (
        "error: scope: acme/visoin has no budget; did you mean acme/vision? (--new creates it)"
    )
    assert {r.scope for r in Ledger(env["PREFECT_GPU_BUDGET_LEDGER_URL"]).config.budgets()} == {
        "acme",
        "acme/vision",
    }  # nothing written
    org_typo = cli_run(env, "budget", "set", "acne", "--hourly-cap", "5")
    assert org_typo.returncode == 2 and "did you mean acme?" in org_typo.stderr
    forced = cli_run(env, "budget", "set", "acme/visoin/agent-7", "--hourly-cap", "5", "--new")
    assert forced.returncode == 0, forced.stderr
    # a session of a known team, and a new team far from any other, need no --new
    assert cli_run(env, "budget", "set", "acme/vision/agent-8", "--hourly-cap", "5").returncode == 0
    assert cli_run(env, "budget", "set", "acme/robotics", "--hourly-cap", "5").returncode == 0

    status = cli_run(env, "status", "acme/visio")
    assert status.returncode == 2
    assert status.stderr.strip().endswith("in acme/visio; did you mean acme/vision?")
    ledger = cli_run(env, "ledger", "zzz")
    assert ledger.returncode == 2 and "known: acme" in ledger.stderr
    assert cli_run(env, "status", "acme/vision").returncode == 0


@pytest.mark.parametrize("argv", [[], ["budget"], ["pool"]], ids=["bare", "budget", "pool"])
def test_a_command_named_alone_prints_its_help_and_no_traceback(tmp_path, argv):
    env = {**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": f"sqlite:///{tmp_path / 'l.db'}"}
    done = cli_run(env, *argv)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "Usage: " in done.stdout and "Commands" in done.stdout
