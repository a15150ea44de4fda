"""What a job costs and where its money lands: the money rules, pure (no I/O, no clock).

The ledger books through these functions when it settles a job and when a budget is set; the
audit, the simulator and the soak benchmark count through the same functions, so they agree with
the ledger to the micro-dollar by construction, not by a mirror kept in step.

- The cost rule (`settled_cost`): a job that never started costs nothing. Otherwise it is billed
  the seconds from its start to its end (never negative) unless its launcher reports the billed
  seconds, at its rate, rounded half up to the micro-dollar, unless the cloud reports the amount.
- Where the cost is incurred (`incurred_span`): from the job's start to its end, never backwards;
  a job that never started at the instant it ended (its cost is zero, but its row is booked).
- The period-booking rule (`book`): every period budget on the job's scope path (org, team,
  session) counts the whole cost, each in its own calendar periods, shared between them in
  proportion to the time the job ran in each (`period_shares`; the shares sum exactly to the
  cost, see `periods.split`).
- The true-up rule (`book_trueup`): once the cloud's bill for a job is final, its lines replace
  its settlement in every period budget on its path, each line in the periods its usage fell
  in; the ledger, a rebuilt period and the audit all book it through this one function.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.units import cost_micro, scope_path

Spend = tuple[int, float, float]
"""(amount in micro-dollars, start, end): money incurred over [start, end]."""


def settled_cost(
    rate_micro_per_hour: int,
    started_at: float | None,
    ended_at: float,
    billed_seconds: float | None = None,
    actual_micro: int | None = None,
) -> tuple[float, int]:
    """(billed seconds, cost in micro-dollars) of a job that ended at `ended_at`.

    A job that never started is billed nothing, whatever was reported. `billed_seconds` and
    `actual_micro` are the launcher's figures where it has them.
    """
    if started_at is None:  # admitted but never launched: nothing was spent
        return 0.0, 0
    billed = max(0.0, ended_at - started_at) if billed_seconds is None else billed_seconds
    actual = (
        cost_micro(rate_micro_per_hour, billed, round_up=False)
        if actual_micro is None
        else actual_micro
    )
    return billed, actual


def incurred_span(started_at: float | None, ended_at: float) -> tuple[float, float]:
    """The [start, end] over which a settled job's cost is booked: its start (its end if it
    never started) to its end, and never an end before the start."""
    start = ended_at if started_at is None else started_at
    return start, max(ended_at, start)


def row_spend(row: Mapping[str, Any]) -> Spend:
    """What a final job row put in the periods, as its settlement booked it: its cost over its
    `incurred_span` (a row that ended without running: nothing, at its settlement)."""
    ended = row["ended_at"] if row["ended_at"] is not None else row["settled_at"]
    start, end = incurred_span(row["started_at"], ended)
    return row["actual_micro"] or 0, start, end


def period_shares(
    amount: int, start: float, end: float, rule: BudgetRule
) -> tuple[tuple[float, int], ...]:
    """(period start, share) of `amount`, incurred over [start, end], in each of the budget's
    calendar periods that the interval touches, in proportion to the time in each."""
    return periods.split(amount, start, end, rule.period, rule.timezone)


def book(
    scope: str,
    amount: int,
    start: float,
    end: float,
    rules: Mapping[str, BudgetRule] | Iterable[BudgetRule],
) -> dict[tuple[str, float], int]:
    """Each period budget's share of a job's cost: {(budget scope, period start): share}.

    Every rule on `scope`'s path that has a period budget gets the whole `amount`, spread over
    its own periods (`period_shares`); rules elsewhere, or with no period budget, get nothing.
    `rules` is keyed by scope, or any iterable of rules (at most one per scope).
    """
    if isinstance(rules, Mapping):
        path = [rules[s] for s in scope_path(scope) if s in rules]
    else:
        on_path = set(scope_path(scope))
        path = [rule for rule in rules if rule.scope in on_path]
    out: dict[tuple[str, float], int] = {}
    for rule in path:
        if rule.period_budget_micro is None:
            continue
        for p_start, share in period_shares(amount, start, end, rule):
            key = (rule.scope, p_start)
            out[key] = out.get(key, 0) + share
    return out


def settled_in_period(spends: Iterable[Spend], rule: BudgetRule, period_start: float) -> int:
    """What the settled `spends` put in the budget's period starting at `period_start` (the
    caller picks the jobs of the budget's subtree): what `book` added there, summed."""
    return sum(
        share
        for amount, start, end in spends
        for p_start, share in period_shares(amount, start, end, rule)
        if p_start == period_start
    )


def book_trueup(
    scope: str,
    billed: Iterable[Spend],
    settled: Spend,
    rules: Mapping[str, BudgetRule] | Iterable[BudgetRule],
) -> dict[tuple[str, float], int]:
    """What a job's bill changes in each period budget once its figure is final: its bill's
    lines (`billed`), each booked over the span its usage fell in, in place of its settlement
    (`settled`, as `book` booked it, taken back share for share). Zero shares left out."""
    if not isinstance(rules, Mapping):
        rules = {rule.scope: rule for rule in rules}
    out: dict[tuple[str, float], int] = {}
    for amount, start, end in billed:
        for key, share in book(scope, amount, start, max(start, end), rules).items():
            out[key] = out.get(key, 0) + share
    for key, share in book(scope, *settled, rules).items():
        out[key] = out.get(key, 0) - share
    return {key: amount for key, amount in out.items() if amount}
