"""The cloud's bill in the ledger: each (source, billing period) imported whole, and what it
changed in the budgets (the rules: `billing.trueup`, `accounting.book_trueup`; the rows:
`bill_store`; what an import did: `billing.results`). `Bills` is the `billing.imports.BillStore`
that `bill import` and the daily flow import through.

An import replaces one (source, billing period) in one transaction under the locks of every
org its lines touch: the lines of the last import of that period go, the new ones come, and
every job either names is trued up again from all its lines (of every period): a job whose
figure is final has its settlement replaced by its lines in the period spend of every budget on
its path, each line in the periods its usage fell in; the booking moves by the difference only,
so the same export twice changes nothing and a restated line replaces the old. A closed period
whose spend now passes its budget is marked over by bill.

Each line is booked once: lines alike in all they say, read twice in one import (a copy of a
file), are one; a line the ledger holds under another billing period of the same source (a
re-delivery under another invoice month) is kept as a `copy` and books nothing. A line books
its job only where it can be true of it (`billing.trueup.refusal`, `booked_lines`); the rest is
kept `refused`, with its reason. A final figure far past the job's worst case is held until an
admin accepts it (`accept`). `forget` takes an import out whole.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from prefect_gpu_budget.admission.ledger import bill_views
from prefect_gpu_budget.admission.ledger.bill_store import (
    Figure,
    booked_drift,
    classify,
    final_bill_jobs,
    jobs_named,
    line_row,
    mark_over,
    refigure,
    trueup_shares,
    trueups,
)
from prefect_gpu_budget.admission.ledger.engine import Db, reconnecting
from prefect_gpu_budget.admission.ledger.queries import add_to_periods, path_rules
from prefect_gpu_budget.admission.ledger.tables import (
    bill_accepts,
    bill_imports,
    bill_jobs,
    bill_lines,
    jobs,
)
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.billing.lines import SOURCES, BillError, BillLine
from prefect_gpu_budget.billing.results import BillImport, HeldBill, OverByBill

__all__ = [
    "BILL_LOCK",
    "Bills",
    "final_bill_jobs",
    "trueup_shares",
    "trueups",
]

BILL_LOCK = "~bills"
"""A name no org can have (`validate_scope` refuses `~`): imports of bills queue on it."""
CURRENCY = "USD"
"""The budgets' currency: a bill in another is refused."""


def once(lines: Sequence[BillLine]) -> tuple[list[BillLine], int, str]:
    """The lines, each once: (lines, how many were read again, where one of them was). Lines
    alike in all they say (`BillLine.content`) are one line read twice; two lines of one id
    that differ are refused (a reader numbers them)."""
    first: dict[tuple[object, ...], BillLine] = {}
    ids: dict[str, BillLine] = {}
    again, where = 0, ""
    for line in lines:
        if line.content in first:
            again += 1
            where = where or f"{line.where or line.line_id} (as {first[line.content].where})"
            continue
        if line.line_id in ids:
            raise BillError(
                line.where or "bill", f"line {line.line_id} twice, differently: number repeats"
            )
        first[line.content] = ids[line.line_id] = line
    return list(first.values()), again, where


class Bills:
    """The imported bills and their true-up, over the ledger's database; `headroom` (the
    queue's) ends an import in every org it touched (a bill below a settlement frees room)."""

    def __init__(self, db: Db, headroom: Callable[[Connection, str], None]) -> None:
        self.db, self.headroom = db, headroom

    @reconnecting
    def import_bill(
        self,
        source: str,
        billing_period: str,
        lines: Sequence[BillLine],
        *,
        read_from: str = "",
        provisional_hours: float = 48.0,
        now: float | None = None,
    ) -> BillImport:
        """Replace what the ledger holds of (source, billing period) with `lines`, the whole
        export of that period as it stands, in one transaction, and true up every job either
        names. `BillError` (nothing changed) for a line of another source, period or
        currency."""
        now = time.time() if now is None else now
        _check(source, billing_period, lines)
        unique, again, where = once(lines)
        with self.db.read() as conn:
            orgs = _orgs(conn, source, billing_period, unique)
        with self.db.write_orgs([BILL_LOCK, *orgs]) as conn:
            owned = classify(conn, source, billing_period, unique, now)
            done = self._replace(
                conn, source, billing_period, owned, read_from, provisional_hours, now
            )
            for org in sorted(orgs):
                self.headroom(conn, org)
        done.orgs, done.twice, done.twice_where = sorted(orgs), again, where
        return done

    def _replace(
        self,
        conn: Connection,
        source: str,
        billing_period: str,
        owned: list[Any],
        read_from: str,
        provisional_hours: float,
        now: float,
    ) -> BillImport:
        key = (bill_lines.c.source == source) & (bill_lines.c.billing_period == billing_period)
        old = conn.execute(sa.select(bill_lines).where(key)).mappings().all()
        affected = sorted(
            ({r["job_id"] for r in old} | {job.id for _, _, job, _ in owned if job}) - {None}
        )
        rows = [line_row(item) for item in owned]
        same = _signature(old) == _signature(rows)
        before = self._before(conn, affected)
        conn.execute(bill_lines.delete().where(key))
        if rows:
            conn.execute(bill_lines.insert(), rows)
        done = self._rebook(conn, before, refigure(conn, affected, provisional_hours, now), now)
        conn.execute(bill_imports.delete().where(_import_key(source, billing_period)))
        conn.execute(
            bill_imports.insert().values(
                source=source,
                billing_period=billing_period,
                imported_at=now,
                digest=_digest(rows),
                lines=len(owned),
                read_from=read_from[:2000],
            )
        )
        done.source, done.billing_period, done.lines = source, billing_period, len(owned)
        done.changed = done.changed or not same
        for line, kind, _, reason in owned:
            if kind in ("untagged", "account"):
                name = f"{kind}_micro"
                setattr(done, name, getattr(done, name) + line.billed_micro)
            elif kind == "refused":
                done.refused += 1
                done.refused_micro += line.billed_micro
            elif kind == "copy":
                held = (reason or "").rsplit(" ", 1)[-1]
                done.copies[held] = done.copies.get(held, 0) + 1
        return done

    def _before(self, conn: Connection, affected: list[str]) -> dict[str, Any]:
        return {
            "shares": trueup_shares(conn, affected),
            "drift": booked_drift(conn, affected),
            "figures": {
                row.job_id: (row.final, bool(row.held), row.billed_micro)
                for row in conn.execute(
                    sa.select(bill_jobs).where(bill_jobs.c.job_id.in_(affected))
                )
            },
        }

    def _rebook(
        self, conn: Connection, before: dict[str, Any], state: dict[str, Figure], now: float
    ) -> BillImport:
        """Book the difference the figures now make, mark what it put over, and say so."""
        affected = list(before["figures"]) + [j for j in state if j not in before["figures"]]
        after = trueup_shares(conn, affected)
        delta = {
            k: after.get(k, 0) - before["shares"].get(k, 0) for k in {*before["shares"], *after}
        }
        delta = {k: v for k, v in delta.items() if v}
        rules: dict[str, BudgetRule] = {}
        for job_scope in {figure.scope for figure in state.values()} | {s for s, _ in delta}:
            rules.update({r.scope: r for r in path_rules(conn, job_scope)})
        add_to_periods(conn, delta, rules)
        moved: dict[str, int] = {}
        for (scope, _), amount in delta.items():
            moved[scope] = moved.get(scope, 0) + amount
        was = before["figures"]
        return BillImport(
            source="",
            billing_period="",
            lines=0,
            changed=bool(delta)
            or set(was) != set(state)
            or any(was.get(j) != (f.final, f.held, f.billed_micro) for j, f in state.items()),
            jobs_final=sum(1 for f in state.values() if f.final),
            jobs_provisional=sum(1 for f in state.values() if not f.final and not f.held),
            booked_micro=sum(delta.values()),
            drift_micro=booked_drift(conn, affected) - before["drift"],
            moved={scope: amount for scope, amount in sorted(moved.items()) if amount},
            over_by_bill=mark_over(conn, set(delta), rules, now),
            held=[
                HeldBill(job_id, f.scope, f.billed_micro, f.reason or "")
                for job_id, f in sorted(state.items())
                if f.held and was.get(job_id) != (False, True, f.billed_micro)
            ],
            provisional=dict(
                Counter(f.reason or "" for f in state.values() if not f.final and not f.held)
            ),
        )

    @reconnecting
    def forget(
        self,
        source: str,
        billing_period: str,
        *,
        provisional_hours: float = 48.0,
        now: float | None = None,
    ) -> BillImport:
        """Take the import of (source, billing period) out whole: its lines go, and every job
        they billed is trued up again from the lines left (none: back to its settlement, as
        the ledger had settled it), final by `provisional_hours` as an import would.
        `BillError` if the ledger holds no import of it."""
        now = time.time() if now is None else now
        with self.db.read() as conn:
            if (
                conn.execute(
                    sa.select(bill_imports).where(_import_key(source, billing_period))
                ).first()
                is None
            ):
                raise BillError(f"{source} {billing_period}", "no import of it to forget")
            orgs = _orgs(conn, source, billing_period, [])
        key = (bill_lines.c.source == source) & (bill_lines.c.billing_period == billing_period)
        with self.db.write_orgs([BILL_LOCK, *orgs]) as conn:
            held = set(conn.execute(sa.select(bill_lines.c.job_id).where(key)).scalars())
            affected = sorted(held - {None})
            lines = conn.execute(
                sa.select(sa.func.count()).select_from(bill_lines).where(key)
            ).scalar()
            before = self._before(conn, affected)
            conn.execute(bill_lines.delete().where(key))
            conn.execute(bill_imports.delete().where(_import_key(source, billing_period)))
            state = refigure(conn, affected, provisional_hours, now)
            done = self._rebook(conn, before, state, now)
            for org in sorted(orgs):
                self.headroom(conn, org)
        done.source, done.billing_period, done.lines = source, billing_period, lines or 0
        done.changed, done.orgs = True, sorted(orgs)
        return done

    @reconnecting
    def accept(self, job_id: str, *, now: float | None = None) -> BillImport:
        """An admin accepts a held figure: the job's bill, up to what it is now, books (its
        settlement replaced in every budget on its path). `BillError` if it is not held."""
        now = time.time() if now is None else now
        with self.db.read() as conn:
            row = conn.execute(
                sa.select(bill_jobs.c.org, bill_jobs.c.held).where(bill_jobs.c.job_id == job_id)
            ).first()
        if row is None or not row.held:
            raise BillError(f"job {job_id}", "no bill of it is held for acceptance")
        with self.db.write_orgs([BILL_LOCK, row.org]) as conn:
            before = self._before(conn, [job_id])
            billed = conn.execute(
                sa.select(bill_jobs.c.billed_micro).where(bill_jobs.c.job_id == job_id)
            ).scalar()
            conn.execute(bill_accepts.delete().where(bill_accepts.c.job_id == job_id))
            conn.execute(
                bill_accepts.insert().values(job_id=job_id, accepted_micro=billed, accepted_at=now)
            )
            conn.execute(
                bill_jobs.update()
                .where(bill_jobs.c.job_id == job_id, bill_jobs.c.held.is_(True))
                .values(final=True, held=False, reason=None, updated_at=now)
            )
            scope = conn.execute(sa.select(jobs.c.scope).where(jobs.c.id == job_id)).scalar()
            done = self._rebook(
                conn, before, {job_id: Figure(scope, True, billed, False, None)}, now
            )
            self.headroom(conn, row.org)
        done.source, done.billing_period, done.orgs = "accept", job_id, [row.org]
        return done

    @reconnecting
    def over_by_bill(self, scope: str | None = None) -> list[OverByBill]:
        """The closed periods marked over their budget by the bill (of `scope`'s subtree)."""
        with self.db.read() as conn:
            return bill_views.over_by_bill(conn, scope)

    @reconnecting
    def drift(self, scope: str | None = None) -> dict[str, Any]:
        """Per job a bill names (in `scope`'s subtree): its reservation, settlement, bill and
        drift (bill - settlement), whether the bill's figure is final, provisional or held, and
        why; per scope the totals; and, apart, the lines no job's bill counts (`untagged`
        usage, `account` lines, `refused` lines with their reason, `copy` lines held under
        another period), never spread over scopes. Money in micro-dollars."""
        with self.db.read() as conn:
            return bill_views.drift(conn, scope)


def _import_key(source: str, billing_period: str) -> Any:
    return (bill_imports.c.source == source) & (bill_imports.c.billing_period == billing_period)


def _digest(rows: Sequence[Any]) -> str:
    """A digest of an import's lines as the ledger holds them (what they say, their kinds)."""
    blob = json.dumps(sorted(_signature(rows), key=repr), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _signature(rows: Sequence[Any]) -> set[tuple[Any, ...]]:
    names = ("line_id", "kind", "job_id", "line_type", "usage_start", "usage_end")
    return {tuple(r[n] for n in names) + (r["billed_micro"], r["reason"]) for r in rows}


def _orgs(
    conn: Connection, source: str, billing_period: str, lines: Sequence[BillLine]
) -> set[str]:
    """The orgs an import touches: those of the jobs its lines may bill, and of the jobs the
    period's last import billed."""
    by_id, by_external = jobs_named(conn, lines)
    held = conn.execute(
        sa.select(jobs.c.org)
        .select_from(bill_lines.join(jobs, jobs.c.id == bill_lines.c.job_id))
        .where(bill_lines.c.source == source, bill_lines.c.billing_period == billing_period)
    ).scalars()
    return {job.org for job in (*by_id.values(), *by_external.values())} | set(held)


def _check(source: str, billing_period: str, lines: Sequence[BillLine]) -> None:
    if source not in SOURCES:
        raise BillError("bill", f"unknown source {source!r}; known: {', '.join(SOURCES)}")
    for n, line in enumerate(lines, 1):
        where = line.where or f"line {n}"
        if line.source != source or line.billing_period != billing_period:
            raise BillError(
                where,
                f"a {line.source} line of {line.billing_period} in an import of "
                f"{source} {billing_period}",
            )
        if line.currency.upper() != CURRENCY:
            raise BillError(
                where, f"currency {line.currency!r}, not the budgets' {CURRENCY}", "currency"
            )
