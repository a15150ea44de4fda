"""What reconcile does with one orphan: a pure decision from its ledger row, what its launcher
says of it (`Probe`) and the time, executed by `admission/reconcile.py`.

No I/O, no clock, no threads: every rule of `reconcile`'s docstring is here, table-tested
(tests/admission/test_orphans.py), and reconcile only carries it out: it records a late start,
stops the job, settles it, gives its Prefect lease back, or leaves it alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from prefect_gpu_budget.admission.rules.timing import (
    HEARTBEAT_S,
    LEASE_MARGIN_S,
    LEASE_S,
    UNRECORDED_LEASE_S,
)

Verb = Literal["cancel-queued", "await-lease-expiry", "leave-running", "settle"]


class Probe(Protocol):
    """The launcher's answer about the orphan (`launchers.base.Probe`; named by its shape, so
    that this module imports no launcher): `running`, `finished` or `unknown`."""

    @property
    def state(self) -> str: ...
    @property
    def started_at(self) -> float | None: ...
    @property
    def ended_at(self) -> float | None: ...
    @property
    def billed_seconds(self) -> float | None: ...
    @property
    def actual_micro(self) -> int | None: ...


@dataclass(frozen=True)
class Action:
    """What to do with one orphan, in this order: record a start, stop, settle, release."""

    verb: Verb
    mark_started_at: float | None = None
    """It started after its holder left: record this start before settling."""
    stop: bool = False
    """Stop it first: still waiting for capacity, or running past its max runtime."""
    ended_at: float | None = None
    billed_seconds: float | None = None
    actual_micro: int | None = None
    real_end_after_stop: bool = False
    """Ask the launcher again once stopped: a finished answer's end (and billed figures)
    replaces `ended_at` (`after_stop`)."""
    release_lease: str | None = None
    """The Prefect lease to hand back once settled; None when it may be lapsing
    (`lease_to_give_back`)."""
    reported: str = "settled"
    """What `Reconciled.action` says when the settlement writes: `settled` or `stopped`."""


def may_hold_unrecorded_lease(row: Mapping[str, Any], now: float) -> bool:
    """Admitted, no lease id on record, and the lease it may have taken unrecorded has not
    expired yet (`UNRECORDED_LEASE_S` after its admission or last heartbeat). Whether its scope
    is capped (so that it took slots at all) is the caller's to add."""
    return (
        row["lease_id"] is None
        and row["admitted_at"] is not None
        and now < max(row["admitted_at"], row["heartbeat_at"]) + UNRECORDED_LEASE_S
    )


def lease_to_give_back(row: Mapping[str, Any], now: float) -> str | None:
    """The recorded lease, while it surely has `LEASE_MARGIN_S` left to live (its holder renewed
    it after its last stamp, `LEASE_S` long); else None, and Prefect's repossessor returns its
    slots within `REPOSSESS_S` of its end: releasing it beside the repossessor would count them
    back twice."""
    if now < row["heartbeat_at"] + LEASE_S - LEASE_MARGIN_S:
        return row["lease_id"]
    return None


def first_look(row: Mapping[str, Any], *, awaiting_lease_expiry: bool) -> Action | None:
    """The decisions that need no launcher: a queued orphan is cancelled (its waiter is gone);
    one that may hold Prefect slots under an unrecorded lease stays open until it expires.
    None: ask its launcher, then `decide`."""
    if row["state"] == "queued":
        return Action("cancel-queued")
    if awaiting_lease_expiry:
        return Action("await-lease-expiry")
    return None


def decide(
    row: Mapping[str, Any], probe: Probe, *, now: float, can_stop: bool, limits: bool = True
) -> Action:
    """An admitted or running orphan, with its launcher's answer (`can_stop`: that launcher
    is at hand). `limits`: the Prefect limits are at hand, so its recorded lease goes back
    (`lease_to_give_back`)."""
    lease = lease_to_give_back(row, now) if limits else None
    started = row["started_at"]
    mark = None
    if started is None and probe.started_at is not None:  # it started after its holder left
        mark = started = probe.started_at
    stop = started is None and probe.state == "running" and can_stop  # waiting for capacity
    reported = "stopped" if stop else "settled"
    if started is None:  # never started: settles at zero
        return Action("settle", stop=stop, ended_at=now, release_lease=lease, reported=reported)
    max_end = started + row["max_runtime_s"]
    if probe.state == "running":
        if now < max_end:  # still within its max runtime: metered on
            return Action("leave-running", mark_started_at=mark)
        if not can_stop:
            raise ValueError("a running orphan past its max runtime needs its launcher")
        return Action(
            "settle",
            mark_started_at=mark,
            stop=True,
            ended_at=now,
            real_end_after_stop=True,
            release_lease=lease,
            reported="stopped",
        )
    if probe.state == "finished" and probe.ended_at is not None:  # its real times
        return Action(
            "settle",
            mark_started_at=mark,
            ended_at=min(probe.ended_at, max_end),
            billed_seconds=probe.billed_seconds,
            actual_micro=probe.actual_micro,
            release_lease=lease,
        )
    # gone without a record: up to the last moment it could have run, never past max runtime
    last_seen = max(row["heartbeat_at"], started) + HEARTBEAT_S
    return Action(
        "settle", mark_started_at=mark, ended_at=min(now, last_seen, max_end), release_lease=lease
    )


def after_stop(action: Action, after: Probe) -> Action:
    """The settlement of a job stopped past its max runtime, once its launcher answers again:
    its real end when it reports one, else the moment of the stop."""
    if not action.real_end_after_stop or after.state != "finished" or after.ended_at is None:
        return action
    return Action(
        action.verb,
        mark_started_at=action.mark_started_at,
        stop=action.stop,
        ended_at=after.ended_at,
        billed_seconds=after.billed_seconds,
        actual_micro=after.actual_micro,
        release_lease=action.release_lease,
        reported=action.reported,
    )
