"""Audit the ledger: check from its own records that nothing was lost, charged twice or
over-admitted. For tests, benchmarks and users (after a crash and a reconcile, or on a schedule).

- `promise1_violations`: at every admission instant the ledger recorded, the admitted jobs'
  rates per scope fit the hourly cap, and settled plus committed spend per period fits the
  period budget (promise 1), counted the way the ledger's own decision counts them;
- `orphans_left`: rows neither final nor owned: the holder is gone and no job process of theirs
  still runs here (what reconcile must settle; promise 3). A row reconcile holds open until a
  lease its holder may have taken, unrecorded, expires (`awaiting_rows`) is owned by that
  schedule, not an orphan;
- `charge_errors`: the per-period spend the ledger keeps against the settled jobs' own costs
  (a job charged twice, or a charge lost);
- `slot_mismatches`: Prefect concurrency slots in use per capped scope against the ledger's
  running rate. Only meaningful while no live admission is between its ledger decision and its
  Prefect lease, e.g. once every admitter has finished or died and reconcile has run. A row
  awaiting lease expiry explains a difference up to its rate (Prefect may or may not have
  granted the lease nobody recorded): that part is transient, counted apart, and gone once the
  lease has expired and reconcile has settled the row.

`audit` runs them all over one scope's subtree and returns an `Audit`; its `ok` ignores what rows
awaiting lease expiry explain (see `Audit.awaiting_lease_expiry`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prefect_gpu_budget.admission.ledger import (
    ACTIVE,
    Ledger,
    hold_of,
    process_start_ticks,
)
from prefect_gpu_budget.admission.ledger.bills import trueup_shares, trueups
from prefect_gpu_budget.admission.limits import RateLimits
from prefect_gpu_budget.admission.rules.accounting import book, period_shares, row_spend
from prefect_gpu_budget.admission.rules.policy import BudgetRule, held_in
from prefect_gpu_budget.admission.rules.timing import STALE_AFTER_S
from prefect_gpu_budget.units import fmt_usd, scope_path

Row = dict[str, Any]


@dataclass(frozen=True)
class Audit:
    """Figures of one audit (each should be zero) and a message per finding."""

    jobs: int
    orphans_left: int
    double_charges: int
    """(scope, period) spend rows holding more than the settled jobs cost: charged twice."""
    missing_charges: int
    """(scope, period) spend rows holding less than the settled jobs cost: a charge lost."""
    slot_mismatch_cents: int | None
    """Sum over capped scopes of how far Prefect's slots in use fall outside what the ledger's
    running rate explains; None: not checked."""
    invariant_violations: int
    messages: tuple[str, ...] = ()
    awaiting_lease_expiry: int = 0
    """Rows reconcile holds open until a lease their dead holder may have taken expires."""
    slot_transient_cents: int | None = None
    """Sum over capped scopes of the ledger's running rate minus Prefect's slots that rows
    awaiting lease expiry explain (their lease never granted, or already taken back)."""
    slot_unrecorded_cents: int | None = None
    """Sum over capped scopes of the slots Prefect holds under leases no row recorded (those of
    rows awaiting lease expiry): only the lease's expiry gives them back."""

    @property
    def ok(self) -> bool:
        return not (
            self.orphans_left
            or self.double_charges
            or self.missing_charges
            or self.slot_mismatch_cents
            or self.invariant_violations
        )


def _within(scope: str, parent: str | None) -> bool:
    return parent is None or scope == parent or scope.startswith(parent + "/")


# -- promise 1 ---------------------------------------------------------------------------------


def promise1_violations(
    rows: Iterable[Row],
    rules: Iterable[BudgetRule],
    trueups: Iterable[tuple[float, Mapping[tuple[str, float], int]]] = (),
) -> list[str]:
    """Replay admissions and settlements in the order of the ledger's timestamps and check each
    admission instant: rate per capped scope <= cap; settled + committed spend in each period
    the new reservation touches <= the period budget. `trueups`: what bills booked on top of
    settlements, and when (`ledger.bills.trueups`), replayed as settlements are.

    Settlements sort before admissions stamped at the same instant. The rules are today's
    budgets; an admission later put back in the queue (its Prefect slots were busy) keeps only
    its last admission time in the ledger, so its earlier interval is not replayed.
    """
    by_scope = {rule.scope: rule for rule in rules}
    active: dict[str, Row] = {}
    rate: dict[str, int] = defaultdict(int)
    settled: dict[tuple[str, float], int] = defaultdict(int)
    found: list[str] = []
    for at, kind, row in _replayed(rows, trueups):
        if "trueup" in row:
            for key, share in row["trueup"].items():
                settled[key] += share
            continue
        path = [by_scope[s] for s in scope_path(row["scope"]) if s in by_scope]
        if kind == 0:
            del active[row["id"]]
            for rule in path:
                rate[rule.scope] -= row["rate_cents"]
            for key, share in book(row["scope"], *row_spend(row), by_scope).items():
                settled[key] += share
            continue
        active[row["id"]] = row
        for rule in path:
            rate[rule.scope] += row["rate_cents"]
            found += _over_at_admission(row, at, rule, rate[rule.scope], active, settled)
    return found


def _replayed(
    rows: Iterable[Row], trueups: Iterable[tuple[float, Mapping[tuple[str, float], int]]]
) -> list[tuple[float, int, Row]]:
    """Admissions (1), settlements and true-ups (0) in the ledger's order, settlements before
    admissions stamped at the same instant."""
    events: list[tuple[float, int, Row]] = []
    for row in rows:
        if row["admitted_at"] is None:
            continue
        events.append((row["admitted_at"], 1, row))
        if row["state"] not in ACTIVE and row["settled_at"] is not None:
            events.append((row["settled_at"], 0, row))
    for at, shares in trueups:
        events.append((at, 0, {"trueup": shares}))
    events.sort(key=lambda e: (e[0], e[1]))
    return events


def _over_at_admission(
    row: Row,
    at: float,
    rule: BudgetRule,
    running: int,
    active: Mapping[str, Row],
    settled: Mapping[tuple[str, float], int],
) -> list[str]:
    """What the admission of `row` at `at` broke of `rule`: its cap (`running`: the scope's
    rate with it), or its budget in a period the new reservation touches."""
    found = []
    cap = rule.hourly_cap_cents
    if cap is not None and running > cap:
        found.append(
            f"job {row['id'][:8]} admitted at {at:.3f}: running rate of {rule.scope} "
            f"{running} cents/h > cap {cap}"
        )
    budget = rule.period_budget_micro
    if budget is None:
        return found
    new = hold_of(row, now=at)  # as the ledger saw it then
    held = [hold_of(r, now=at) for r in active.values() if rule.scope in scope_path(r["scope"])]
    for p_start, _ in period_shares(new.reserved_micro, new.start, new.end, rule):
        reserved = sum(held_in(h, at, rule, p_start) for h in held)
        total = settled.get((rule.scope, p_start), 0) + reserved
        if total > budget:
            found.append(
                f"job {row['id'][:8]} admitted at {at:.3f}: {rule.period} of "
                f"{rule.scope} holds {fmt_usd(total)} > budget {fmt_usd(budget)}"
            )
    return found


# -- nothing lost ------------------------------------------------------------------------------


def local_job_running(row: Row) -> bool:
    """Does the row's local job process (`pid:start-ticks`) still run on this host?"""
    if not str(row.get("launcher") or "").startswith("local") or not row.get("external_id"):
        return False
    pid, _, ticks = str(row["external_id"]).partition(":")
    return pid.isdigit() and bool(ticks) and process_start_ticks(int(pid)) == ticks


def _ownerless(
    ledger: Ledger, scope: str | None, now: float, stale_after: float, job_running
) -> tuple[list[Row], list[Row]]:
    """(orphans, awaiting): rows whose holder is gone and whose job is not known to run, split
    by whether reconcile holds them open until an unrecorded lease expires."""
    from prefect_gpu_budget.admission.reconcile import awaiting_lease_expiry

    orphans, awaiting = [], []
    for row in ledger.views.orphans(now=now, stale_after=stale_after):
        if not _within(row["scope"], scope) or (row["started_at"] and job_running(row)):
            continue
        (awaiting if awaiting_lease_expiry(ledger, row, now) else orphans).append(row)
    return orphans, awaiting


def orphans_left(
    ledger: Ledger,
    *,
    scope: str | None = None,
    now: float | None = None,
    stale_after: float = STALE_AFTER_S,
    job_running: Callable[[Row], bool] = local_job_running,
) -> list[Row]:
    """Queued or active rows whose holder is gone (dead here, or silent `stale_after` seconds)
    and whose job is not known to run: reservations without an owner. A row that reconcile
    holds open until a lease its holder may have taken expires has an owner: that schedule."""
    now = time.time() if now is None else now
    return _ownerless(ledger, scope, now, stale_after, job_running)[0]


def awaiting_rows(
    ledger: Ledger,
    *,
    scope: str | None = None,
    now: float | None = None,
    stale_after: float = STALE_AFTER_S,
    job_running: Callable[[Row], bool] = local_job_running,
) -> list[Row]:
    """Rows of gone holders that reconcile holds open until a Prefect lease their holder may
    have taken, but did not live to record, has expired (`reconcile.awaiting_lease_expiry`)."""
    now = time.time() if now is None else now
    return _ownerless(ledger, scope, now, stale_after, job_running)[1]


def charge_errors(
    ledger: Ledger, rows: Iterable[Row], rules: Iterable[BudgetRule]
) -> tuple[int, int, list[str]]:
    """(double, missing, messages): the spend the ledger keeps per (budget scope, period)
    against the sum of the settled jobs' costs that fall in that period (where a job's bill is
    final, its lines in place of its settlement: `accounting.book_trueup`).

    A job settled before its budget existed is booked only if it falls in the period the
    budget was set in (setting a budget rebuilds that period); in an earlier period it shows
    here as a missing charge. The check is exact for budgets set before their jobs ran.
    """
    expected: dict[tuple[str, float], int] = defaultdict(int)
    by_scope = {rule.scope: rule for rule in rules}
    settled = []
    for row in rows:
        if row["state"] == "settled":
            settled.append(row["id"])
            for key, share in book(row["scope"], *row_spend(row), by_scope).items():
                expected[key] += share
    with ledger.db.read() as conn:  # the bill's word, where it is final
        for key, share in trueup_shares(conn, settled, by_scope).items():
            expected[key] += share
    double = missing = 0
    messages = []
    for (scope, p_start), want in sorted(expected.items()):
        held = ledger.views.period_settled(scope, p_start)
        if held == want:
            continue
        if held > want:
            double += 1
        else:
            missing += 1
        messages.append(
            f"period of {scope} from {p_start:.0f}: ledger holds {fmt_usd(held)}, "
            f"its settled jobs cost {fmt_usd(want)}"
        )
    return double, missing, messages


@dataclass(frozen=True)
class SlotCheck:
    """Prefect slots in use against the ledger's running rate, summed over capped scopes."""

    mismatch_cents: int
    """How far Prefect's slots fall outside [rate - awaiting rate, rate] (0 when consistent)."""
    transient_cents: int
    """Rate of rows awaiting lease expiry that Prefect holds no slots for (never granted, or
    already repossessed): the ledger counts it until the lease's latest expiry."""
    unrecorded_cents: int
    """Slots Prefect holds for rows awaiting lease expiry (leases nobody recorded)."""
    scopes: int
    """Capped scopes checked."""
    slots_cents: int
    """Prefect slots in use in those scopes."""
    messages: tuple[str, ...] = ()
    by_scope: Mapping[str, int] = field(default_factory=dict)
    """The mismatch per capped scope, for those that have one."""


def slot_mismatches(
    limits: RateLimits,
    rows: Iterable[Row],
    rules: Iterable[BudgetRule],
    awaiting: Collection[str] = (),
) -> SlotCheck:
    """Per capped scope, Prefect slots in use S against the running rate R of the ledger's
    active jobs in its subtree. `awaiting` holds the ids of rows awaiting lease expiry (their
    rate A in the scope): Prefect may or may not have granted their leases, so any S in
    [R - A, R] is consistent; R - S of it is transient. What falls outside is a mismatch."""
    running = [r for r in rows if r["state"] in ACTIVE]
    mismatch = transient = unrecorded = scopes = held = 0
    messages = []
    by_scope: dict[str, int] = {}
    for rule in rules:
        if rule.hourly_cap_cents is None:
            continue
        inside = [r for r in running if rule.scope in scope_path(r["scope"])]
        rate = sum(r["rate_cents"] for r in inside)
        pending = sum(r["rate_cents"] for r in inside if r["id"] in awaiting)
        slots = limits.active_slots(rule.scope) or 0
        scopes += 1
        held += slots
        low = rate - pending
        explained = min(max(slots, low), rate)
        transient += rate - explained
        unrecorded += explained - low
        if slots == explained:
            continue
        mismatch += abs(slots - explained)
        by_scope[rule.scope] = abs(slots - explained)
        why = f" ({pending} of it awaiting lease expiry)" if pending else ""
        messages.append(
            f"{rule.scope}: Prefect holds {slots} slots, ledger runs {rate} cents/h{why}"
        )
    return SlotCheck(mismatch, transient, unrecorded, scopes, held, tuple(messages), by_scope)


def audit(
    ledger: Ledger,
    limits: RateLimits | None = None,
    *,
    scope: str | None = None,
    now: float | None = None,
    stale_after: float = STALE_AFTER_S,
) -> Audit:
    """Every check over `scope`'s subtree (all of the ledger if None), with the budgets set
    inside it; Prefect slots are compared only when `limits` is given."""
    now = time.time() if now is None else now
    rows = ledger.views.jobs(scope)
    rules = [rule for rule in ledger.config.budgets() if _within(rule.scope, scope)]
    messages: list[str] = []
    orphans, awaiting = _ownerless(ledger, scope, now, stale_after, local_job_running)
    messages += [
        f"orphan: job {r['id'][:8]} in {r['scope']} is {r['state']}, holder {r['holder']} gone"
        for r in orphans
    ]
    double, missing, found = charge_errors(ledger, rows, rules)
    messages += found
    slots = None
    if limits is not None:
        slots = slot_mismatches(limits, rows, rules, {r["id"] for r in awaiting})
        messages += slots.messages
    with ledger.db.read() as conn:
        billed = trueups(conn, [r["id"] for r in rows], {r.scope: r for r in rules})
    violations = promise1_violations(rows, rules, billed)
    messages += violations
    return Audit(
        jobs=len(rows),
        orphans_left=len(orphans),
        double_charges=double,
        missing_charges=missing,
        slot_mismatch_cents=None if slots is None else slots.mismatch_cents,
        invariant_violations=len(violations),
        messages=tuple(messages),
        awaiting_lease_expiry=len(awaiting),
        slot_transient_cents=None if slots is None else slots.transient_cents,
        slot_unrecorded_cents=None if slots is None else slots.unrecorded_cents,
    )
