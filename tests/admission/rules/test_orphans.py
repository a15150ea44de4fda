"""What reconcile does with one orphan (`admission/rules/orphans.py`), as a table: the row, what its
launcher says, the time -> the action reconcile carries out."""

from __future__ import annotations

from typing import Any

import pytest

from prefect_gpu_budget.admission.rules import orphans
from prefect_gpu_budget.admission.rules.orphans import Action
from prefect_gpu_budget.admission.rules.timing import (
    HEARTBEAT_S,
    LEASE_MARGIN_S,
    LEASE_S,
    UNRECORDED_LEASE_S,
)
from prefect_gpu_budget.launchers.base import Probe

NOW = 10_000.0
MAX = 600.0  # max runtime


def _row(**over: Any) -> dict[str, Any]:
    row = {
        "state": "running",
        "admitted_at": 1_000.0,
        "started_at": 1_000.0,
        "heartbeat_at": 1_200.0,
        "max_runtime_s": MAX,
        "lease_id": "lease-1",
    }
    return {**row, **over}


LEASED = {"release_lease": "lease-1"}

DECIDE = [
    # (what, row, probe, can_stop, action)
    (
        "never started, nothing known: settles at zero, now",
        _row(state="admitted", started_at=None),
        Probe("unknown"),
        False,
        Action("settle", ended_at=NOW),
    ),
    (
        "never started, still waiting for cloud capacity: stopped, settles at zero",
        _row(state="admitted", started_at=None),
        Probe("running"),
        True,
        Action("settle", stop=True, ended_at=NOW, reported="stopped"),
    ),
    (
        "started after its holder left and finished: start recorded, real times",
        _row(state="admitted", started_at=None),
        Probe("finished", started_at=9_000.0, ended_at=9_100.0, billed_seconds=95.0),
        True,
        Action("settle", mark_started_at=9_000.0, ended_at=9_100.0, billed_seconds=95.0),
    ),
    (
        "started after its holder left, still running within max runtime: recorded, left",
        _row(state="admitted", started_at=None),
        Probe("running", started_at=9_900.0),
        True,
        Action("leave-running", mark_started_at=9_900.0),
    ),
    (
        "running within its max runtime: left alone, metered",
        _row(started_at=NOW - MAX + 1),
        Probe("running"),
        True,
        Action("leave-running"),
    ),
    (
        "running past its max runtime: stopped, settled now or at its real end",
        _row(),
        Probe("running"),
        True,
        Action(
            "settle",
            stop=True,
            ended_at=NOW,
            real_end_after_stop=True,
            reported="stopped",
        ),
    ),
    (
        "finished: its real end and billed figures",
        _row(),
        Probe("finished", ended_at=1_300.0, billed_seconds=290.0, actual_micro=4_321),
        True,
        Action("settle", ended_at=1_300.0, billed_seconds=290.0, actual_micro=4_321),
    ),
    (
        "finished past its max runtime: charged up to max runtime only",
        _row(),
        Probe("finished", ended_at=1_000.0 + MAX + 50),
        True,
        Action("settle", ended_at=1_000.0 + MAX),
    ),
    (
        "gone: last heartbeat plus one interval",
        _row(),
        Probe("unknown"),
        False,
        Action("settle", ended_at=1_200.0 + HEARTBEAT_S),
    ),
    (
        "gone, silent long: never past its max runtime",
        _row(heartbeat_at=1_000.0 + MAX),
        Probe("unknown"),
        False,
        Action("settle", ended_at=1_000.0 + MAX),
    ),
    (
        "gone a moment ago: never past now",
        _row(started_at=NOW - 10, heartbeat_at=NOW - 1),
        Probe("unknown"),
        False,
        Action("settle", ended_at=NOW, **LEASED),
    ),
    (
        "no lease recorded: none to give back",
        _row(lease_id=None),
        Probe("unknown"),
        False,
        Action("settle", ended_at=1_200.0 + HEARTBEAT_S),
    ),
    (
        "gone, its lease renewed a moment ago: given back",
        _row(heartbeat_at=NOW - HEARTBEAT_S),
        Probe("unknown"),
        False,
        Action("settle", ended_at=1_000.0 + MAX, **LEASED),
    ),
    (
        "gone, its lease near its end: left to Prefect's repossessor, never released beside it",
        _row(heartbeat_at=NOW - LEASE_S + LEASE_MARGIN_S),
        Probe("unknown"),
        False,
        Action("settle", ended_at=1_000.0 + MAX),
    ),
]


@pytest.mark.parametrize(
    ("row", "probe", "can_stop", "action"),
    [case[1:] for case in DECIDE],
    ids=[case[0] for case in DECIDE],
)
def test_decide(row: dict, probe: Probe, can_stop: bool, action: Action) -> None:
    assert orphans.decide(row, probe, now=NOW, can_stop=can_stop) == action


def test_without_limits_no_lease_is_given_back() -> None:
    fresh = _row(heartbeat_at=NOW - 1)
    assert orphans.decide(fresh, Probe("unknown"), now=NOW, can_stop=False).release_lease
    action = orphans.decide(fresh, Probe("unknown"), now=NOW, can_stop=False, limits=False)
    assert action.release_lease is None and action.verb == "settle"


def test_a_running_orphan_past_max_runtime_needs_its_launcher() -> None:
    with pytest.raises(ValueError):
        orphans.decide(_row(), Probe("running"), now=NOW, can_stop=False)


FIRST_LOOK = [
    ("queued: cancelled", _row(state="queued", started_at=None), False, Action("cancel-queued")),
    (
        "queued, even where a lease may be unrecorded: cancelled",
        _row(state="queued"),
        True,
        Action("cancel-queued"),
    ),
    (
        "may hold unrecorded slots: waits for the lease's expiry",
        _row(),
        True,
        Action("await-lease-expiry"),
    ),
    ("admitted, nothing pending: ask the launcher", _row(), False, None),
]


@pytest.mark.parametrize(
    ("row", "awaiting", "action"),
    [case[1:] for case in FIRST_LOOK],
    ids=[case[0] for case in FIRST_LOOK],
)
def test_first_look(row: dict, awaiting: bool, action: Action | None) -> None:
    assert orphans.first_look(row, awaiting_lease_expiry=awaiting) == action


UNRECORDED = [
    ("lease recorded", _row(), 1_001.0, False),
    ("never admitted", _row(lease_id=None, admitted_at=None), 1_001.0, False),
    ("admitted, unrecorded, lease may live", _row(lease_id=None), 1_200.0, True),
    (
        "unrecorded, expired since the last heartbeat",
        _row(lease_id=None),
        1_200.0 + UNRECORDED_LEASE_S,
        False,
    ),
]


@pytest.mark.parametrize(
    ("row", "now", "held"), [c[1:] for c in UNRECORDED], ids=[c[0] for c in UNRECORDED]
)
def test_may_hold_unrecorded_lease(row: dict, now: float, held: bool) -> None:
    assert orphans.may_hold_unrecorded_lease(row, now) is held


def test_after_stop_takes_the_real_end_when_the_launcher_reports_one() -> None:
    stopped = orphans.decide(_row(), Probe("running"), now=NOW, can_stop=True)
    real = orphans.after_stop(stopped, Probe("finished", ended_at=1_650.0, billed_seconds=640.0))
    assert (real.ended_at, real.billed_seconds, real.reported) == (1_650.0, 640.0, "stopped")
    assert orphans.after_stop(stopped, Probe("unknown")) == stopped
    assert orphans.after_stop(stopped, Probe("finished")) == stopped  # no end: the stop's moment
    settled = orphans.decide(_row(), Probe("unknown"), now=NOW, can_stop=False)
    assert orphans.after_stop(settled, Probe("finished", ended_at=1.0)) == settled
