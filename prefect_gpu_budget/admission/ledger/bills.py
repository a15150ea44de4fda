"""The cloud's bill in the ledger: each (source, billing period) imported whole, and what it
changed in the budgets (the rules: `billing.trueup`, `accounting.book_trueup`; the rows:
`bill_store`; the lines on their way in: `bill_staging`; what an import did:
`billing.results`). `Bills` is the `billing.imports.BillStore` that `bill import` and the daily
flow import through.

An import stages its lines as they are read, batch by batch (memory bounded by a batch, not by
the month), then replaces each (source, billing period) in one transaction under the locks of
every org its lines touch: the lines of the last import of that period go, the new ones come
(unless they say the same: then nothing is written), and every job either names is trued up
again from all its lines (of every period): a job whose figure is final has its settlement
replaced by its lines in the period spend of every budget on its path, each line in the periods
its usage fell in; the booking moves by the difference only, so the same export twice changes
nothing and a restated line replaces the old. A closed period whose spend now passes its budget
is marked over by bill. A bad line anywhere (another currency, or a read that fails halfway)
leaves every period as it was: nothing is replaced until all is staged.

Each line is booked once: lines alike in all they say, read twice in one import (a copy of a
file), are one; a line the ledger holds under another billing period of the same source (a
re-delivery under another invoice month) is kept as a `copy` and books nothing. A line books
its job only where it can be true of it (`billing.trueup.refusal`, `booked_lines`); the rest is
kept `refused`, with its reason. A final figure far past the job's worst case is held until an
admin accepts it (`accept`). `forget` takes an import out whole.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from prefect_gpu_budget.admission.ledger import bill_staging, bill_views
from prefect_gpu_budget.admission.ledger.bill_staging import Twice
from prefect_gpu_budget.admission.ledger.bill_store import (
    Figure,
    booked_drift,
    final_bill_jobs,
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
from prefect_gpu_budget.billing.files import currency_error
from prefect_gpu_budget.billing.lines import SOURCES, BillError, BillLine, BillRead
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


class Bills:
    """The imported bills and their true-up, over the ledger's database; `headroom` (the
    queue's) ends an import in every org it touched (a bill below a settlement frees room)."""

    def __init__(self, db: Db, headroom: Callable[[Connection, str], None]) -> None:
        self.db, self.headroom = db, headroom

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
        currency, and for two lines of one id that differ (a reader numbers them)."""
        _check(source, billing_period, lines)
        read = BillRead(lines, ((source, billing_period),))
        [done] = self._import([read], read_from, provisional_hours, now, renumber=False)
        return done

    def import_reads(
        self,
        reads: Iterable[BillRead],
        *,
        read_from: str = "",
        provisional_hours: float = 48.0,
        now: float | None = None,
    ) -> list[BillImport]:
        """Import every (source, billing period) the reads hold or name, each whole as
        `import_bill` imports it, in order, reading their lines once, as they come (a line id
        repeated within a read is numbered, `reading.number_repeats`' rule). A line in another
        currency, or of an unknown source, refuses the whole import before anything is
        replaced."""
        return self._import(reads, read_from, provisional_hours, now, renumber=True)

    def _import(
        self,
        reads: Iterable[BillRead],
        read_from: str,
        provisional_hours: float,
        now: float | None,
        renumber: bool,
    ) -> list[BillImport]:
        now = time.time() if now is None else now
        token = str(uuid.uuid4())
        try:
            groups, parts = bill_staging.stage(self.db, token, reads, _check_line)
            twice: Twice = {}
            with self.db.tx() as conn:
                for part in range(parts):
                    bill_staging.number(conn, token, part, renumber, twice)
            return [
                self._import_group(
                    token, group, twice.get(group, (0, 0, "")), read_from, provisional_hours, now
                )
                for group in sorted(groups)
            ]
        finally:
            bill_staging.discard(self.db, token)

    @reconnecting
    def _import_group(
        self,
        token: str,
        group: tuple[str, str],
        twice: tuple[int, int, str],
        read_from: str,
        provisional_hours: float,
        now: float,
    ) -> BillImport:
        source, billing_period = group
        with self.db.read() as conn:
            orgs = _orgs(conn, source, billing_period)
            orgs |= bill_staging.named_orgs(conn, token, source, billing_period)
        with self.db.write_orgs([BILL_LOCK, *orgs]) as conn:
            bill_staging.classify(conn, token, source, billing_period, now)
            done = self._replace(conn, token, group, read_from, provisional_hours, now)
            for org in sorted(orgs):
                self.headroom(conn, org)
        done.orgs, (done.twice, _, done.twice_where) = sorted(orgs), twice
        return done

    def _replace(
        self,
        conn: Connection,
        token: str,
        group: tuple[str, str],
        read_from: str,
        provisional_hours: float,
        now: float,
    ) -> BillImport:
        source, billing_period = group
        key = (bill_lines.c.source == source) & (bill_lines.c.billing_period == billing_period)
        held = sa.select(bill_lines.c.job_id).where(key, bill_lines.c.job_id.is_not(None))
        affected = sorted(
            set(conn.execute(held.distinct()).scalars())
            | bill_staging.staged_jobs(conn, token, source, billing_period)
        )
        tally = bill_staging.tally(conn, token, source, billing_period)
        before = self._before(conn, affected)
        changed = bill_staging.swap(conn, token, source, billing_period)
        done = self._rebook(conn, before, refigure(conn, affected, provisional_hours, now), now)
        conn.execute(bill_imports.delete().where(_import_key(source, billing_period)))
        conn.execute(
            bill_imports.insert().values(
                source=source,
                billing_period=billing_period,
                imported_at=now,
                digest=bill_staging.digest(conn, source, billing_period),
                lines=tally["lines"],
                read_from=read_from[:2000],
            )
        )
        done.source, done.billing_period, done.lines = source, billing_period, tally["lines"]
        done.changed = done.changed or changed
        kinds = tally["kinds"]
        done.untagged_micro = kinds.get("untagged", (0, 0))[1]
        done.account_micro = kinds.get("account", (0, 0))[1]
        done.refused, done.refused_micro = kinds.get("refused", (0, 0))
        done.copies = tally["copies"]
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
            orgs = _orgs(conn, source, billing_period)
        key = (bill_lines.c.source == source) & (bill_lines.c.billing_period == billing_period)
        with self.db.write_orgs([BILL_LOCK, *orgs]) as conn:
            held = sa.select(bill_lines.c.job_id).where(key, bill_lines.c.job_id.is_not(None))
            affected = sorted(conn.execute(held.distinct()).scalars())
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


def _orgs(conn: Connection, source: str, billing_period: str) -> set[str]:
    """The orgs of the jobs the last import of (source, billing period) billed."""
    held = conn.execute(
        sa.select(jobs.c.org)
        .select_from(bill_lines.join(jobs, jobs.c.id == bill_lines.c.job_id))
        .where(bill_lines.c.source == source, bill_lines.c.billing_period == billing_period)
        .distinct()
    ).scalars()
    return set(held)


def _check_line(line: BillLine) -> None:
    """Refuse (`BillError`, naming its file, column and row) a line of an unknown source or
    in another currency than the budgets'."""
    if line.source not in SOURCES:
        raise BillError(
            line.where or "bill", f"unknown source {line.source!r}; known: {', '.join(SOURCES)}"
        )
    if (error := currency_error(line, CURRENCY)) is not None:
        raise error


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
