"""The liveness clocks bound each other as admission/rules/timing.py's docstring argues, and every
default that names one of them is that clock."""

from __future__ import annotations

import inspect

from prefect_gpu_budget.admission import audit, gate, ledger, reconcile
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.admission.rules.timing import (
    FRESH_ADMISSION_S,
    HEARTBEAT_S,
    LEASE_S,
    LIMIT_RETRY_S,
    LIVENESS_S,
    RECHECK_S,
    REPOSSESS_S,
    STALE_AFTER_S,
    STALE_WAITER_S,
    UNRECORDED_LEASE_S,
)
from prefect_gpu_budget.units import parse_duration


def _default(function, name: str):
    return inspect.signature(function).parameters[name].default


def test_a_waiter_loses_its_place_long_before_its_row() -> None:
    assert RECHECK_S < STALE_WAITER_S < STALE_AFTER_S
    assert STALE_WAITER_S >= 10 * RECHECK_S  # many re-decisions missed, not one slow one


def test_an_admitted_job_s_clocks_nest() -> None:
    assert LIVENESS_S < HEARTBEAT_S < LEASE_S < UNRECORDED_LEASE_S < STALE_AFTER_S
    assert HEARTBEAT_S == LEASE_S / 4
    assert LEASE_S > 3 * HEARTBEAT_S  # three beats in a row may fail before the lease lapses
    assert UNRECORDED_LEASE_S == LIMIT_RETRY_S + LIVENESS_S + LEASE_S + REPOSSESS_S
    assert STALE_AFTER_S >= 4 * HEARTBEAT_S  # one late beat never makes a live holder gone
    # a holder taking over a fresh admission asks for slots within LIMIT_RETRY_S + LIVENESS_S
    # of its stamp, as UNRECORDED_LEASE_S assumes, with seconds to spare for clocks
    assert FRESH_ADMISSION_S + LIMIT_RETRY_S < LIMIT_RETRY_S + LIVENESS_S - 2


class _CappedConfig:
    def path_budgets(self, scope: str) -> list[BudgetRule]:
        return [BudgetRule(scope.split("/")[0], hourly_cap_cents=100)]


class _CappedLedger:
    config = _CappedConfig()


def test_a_row_found_by_its_silence_never_awaits_an_unrecorded_lease() -> None:
    """Reconcile takes a holder on another host for gone once its row is `STALE_AFTER_S`
    silent; by then any lease it took but did not record has expired."""
    for admitted, beat in ((1000.0, 1000.0), (1000.0, 1500.0)):  # admission stamps the row too
        row = {"lease_id": None, "admitted_at": admitted, "heartbeat_at": beat, "scope": "o/t"}
        found_silent = beat + STALE_AFTER_S + 1e-6
        assert not reconcile.awaiting_lease_expiry(_CappedLedger(), row, found_silent)
        assert reconcile.awaiting_lease_expiry(_CappedLedger(), row, beat + LEASE_S)


def test_the_defaults_are_the_clocks() -> None:
    assert _default(gate.Gate, "heartbeat_s") == HEARTBEAT_S
    assert _default(gate.Gate, "recheck_s") == RECHECK_S
    for function in (
        ledger.Views.orphans,
        reconcile.reconcile,
        audit.audit,
        audit.orphans_left,
        audit.awaiting_rows,
    ):
        assert _default(function, "stale_after") == STALE_AFTER_S, function


def test_the_cli_and_the_flow_default_to_the_same_staleness() -> None:
    from prefect_gpu_budget.cli import jobs as cli
    from prefect_gpu_budget.flows.reconcile import reconcile_flow

    option = _default(cli.reconcile_cmd, "stale_after")
    assert option.default == "120s"  # the help text as before
    assert parse_duration(option.default, "stale_after") == STALE_AFTER_S
    assert _default(reconcile_flow.fn, "stale_after_s") == STALE_AFTER_S
