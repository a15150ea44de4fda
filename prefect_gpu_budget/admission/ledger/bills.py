"""The cloud's bill in the ledger: each (source, billing period) imported whole, and what it
changed in the budgets (the rules: `billing.trueup`, `accounting.book_trueup`).

An import replaces one (source, billing period) in one transaction under the locks of every
org its lines touch: the lines of the last import of that period go, the new ones come, and
every job either names is trued up again from all its lines (of every period): a job whose
figure is final has its settlement replaced by its lines in the period spend of every budget on
its path, each line in the periods its usage fell in; the booking moves by the difference only,
so the same export twice changes nothing and a restated line replaces the old. A closed period
whose spend now passes its budget is marked over by bill.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from prefect_gpu_budget.admission.ledger.engine import Db, _reconnecting
from prefect_gpu_budget.admission.ledger.rows import _path_rules, add_to_periods
from prefect_gpu_budget.admission.ledger.tables import (
    bill_imports,
    bill_jobs,
    bill_lines,
    jobs,
    over_by_bill,
    period_spend,
)
from prefect_gpu_budget.admission.rules import accounting
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.billing.lines import SOURCES, BillError, BillLine
from prefect_gpu_budget.billing.trueup import BilledJob, is_final, owner_of

BILL_LOCK = "~bills"
"""A name no org can have (`validate_scope` refuses `~`): imports of bills queue on it."""
CURRENCY = "USD"
"""The budgets' currency: a bill in another is refused."""


@dataclass(frozen=True)
class OverByBill:
    """A closed period whose spend, trued up from the bill, passed its budget."""

    scope: str
    period_start: float
    period_end: float
    budget_micro: int
    spent_micro: int


@dataclass
class BillImport:
    """What one import did."""

    source: str
    billing_period: str
    lines: int
    changed: bool
    """False: the same lines as the last import of this period, and no figure turned final."""
    jobs_final: int = 0
    jobs_provisional: int = 0
    untagged_micro: int = 0
    account_micro: int = 0
    booked_micro: int = 0
    """What the budgets' period spend moved by, summed over every budget's periods."""
    over_by_bill: list[OverByBill] = field(default_factory=list)
    """Closed periods this import found over their budget (newly, or by more than before)."""
    orgs: list[str] = field(default_factory=list)


def _digest(lines: Sequence[BillLine]) -> str:
    rows = sorted(
        (ln.line_id, ln.line_type, ln.usage_start, ln.usage_end, ln.billed_micro, ln.job_mark)
        for ln in lines
    )
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def _billed_job(row: Any) -> BilledJob:
    return BilledJob(**{name: row[name] for name in BilledJob.__dataclass_fields__})


_JOB_COLUMNS = [
    jobs.c[name] for name in BilledJob.__dataclass_fields__ if name not in ("external_id",)
] + [jobs.c.external_id]


def trueup_shares(
    conn: Connection, job_ids: Iterable[str], rules: dict[str, BudgetRule] | None = None
) -> dict[tuple[str, float], int]:
    """What the final bills of `job_ids` book in the period budgets now, on top of their
    settlements (`accounting.book_trueup`), from the lines the ledger holds; `rules` (by
    scope) default to each job's path's budgets."""
    out: dict[tuple[str, float], int] = defaultdict(int)
    for _, shares in trueups(conn, job_ids, rules):
        for key, share in shares.items():
            out[key] += share
    return dict(out)


def trueups(
    conn: Connection, job_ids: Iterable[str], rules: dict[str, BudgetRule] | None = None
) -> list[tuple[float, dict[tuple[str, float], int]]]:
    """(when, shares) of each job of `job_ids` whose bill is final: when its figure last
    changed, and what it books on top of its settlement (`trueup_shares`, job by job)."""
    ids = list(job_ids)
    found: dict[str, tuple[BilledJob, float]] = {}
    for chunk in _chunks(ids):
        for row in conn.execute(
            sa.select(*_JOB_COLUMNS, bill_jobs.c.updated_at)
            .select_from(bill_jobs.join(jobs, jobs.c.id == bill_jobs.c.job_id))
            .where(bill_jobs.c.job_id.in_(chunk), bill_jobs.c.final.is_(True))
        ).mappings():
            found[row["id"]] = (_billed_job(row), row["updated_at"])
    spans: dict[str, list[accounting.Spend]] = defaultdict(list)
    for chunk in _chunks(list(found)):
        for job_id, amount, start, end in conn.execute(
            sa.select(
                bill_lines.c.job_id,
                bill_lines.c.billed_micro,
                bill_lines.c.usage_start,
                bill_lines.c.usage_end,
            ).where(bill_lines.c.job_id.in_(chunk))
        ):
            spans[job_id].append((amount, start, end))
    out = []
    for job, at in found.values():
        path = rules if rules is not None else {r.scope: r for r in _path_rules(conn, job.scope)}
        settled = accounting.row_spend(
            {
                "actual_micro": job.actual_micro,
                "started_at": job.started_at,
                "ended_at": job.ended_at,
                "settled_at": job.settled_at,
            }
        )
        out.append((at, accounting.book_trueup(job.scope, spans[job.id], settled, path)))
    return out


def final_bill_jobs(conn: Connection, scope: str) -> list[str]:
    """The jobs of `scope`'s subtree whose bill is final (their true-up is in the periods)."""
    return list(
        conn.execute(
            sa.select(bill_jobs.c.job_id).where(
                sa.or_(
                    bill_jobs.c.scope == scope,
                    bill_jobs.c.scope.startswith(scope + "/", autoescape=True),
                ),
                bill_jobs.c.final.is_(True),
            )
        ).scalars()
    )


class Bills:
    """The imported bills and their true-up, over the ledger's database; `headroom` (the
    queue's) ends an import in every org it touched (a bill below a settlement frees room)."""

    def __init__(self, db: Db, headroom: Callable[[Connection, str], None]) -> None:
        self.db, self.headroom = db, headroom

    @_reconnecting
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
        with self.db.read() as conn:
            by_id, by_external = _jobs_named(conn, lines, source, billing_period)
        owned = [(line, *owner_of(line, by_id, by_external)) for line in lines]
        with self.db.read() as conn:
            held = {
                row.job_id: row.org
                for row in conn.execute(
                    sa.select(bill_lines.c.job_id, jobs.c.org)
                    .select_from(bill_lines.join(jobs, jobs.c.id == bill_lines.c.job_id))
                    .where(
                        bill_lines.c.source == source,
                        bill_lines.c.billing_period == billing_period,
                    )
                )
            }
        orgs = {job.org for _, _, job in owned if job is not None} | set(held.values())
        with self.db.write_orgs([BILL_LOCK, *orgs]) as conn:
            done = self._replace(
                conn, source, billing_period, owned, read_from, provisional_hours, now
            )
            for org in sorted(orgs):
                self.headroom(conn, org)
        done.orgs = sorted(orgs)
        return done

    def _replace(
        self,
        conn: Connection,
        source: str,
        billing_period: str,
        owned: list[tuple[BillLine, str, BilledJob | None]],
        read_from: str,
        provisional_hours: float,
        now: float,
    ) -> BillImport:
        key = (bill_lines.c.source == source) & (bill_lines.c.billing_period == billing_period)
        old_jobs = set(conn.execute(sa.select(bill_lines.c.job_id).where(key)).scalars())
        affected = sorted((old_jobs | {job.id for _, _, job in owned if job}) - {None})
        was_final = {
            row.job_id: (row.final, row.billed_micro)
            for row in conn.execute(sa.select(bill_jobs).where(bill_jobs.c.job_id.in_(affected)))
        }
        digest = _digest([line for line, _, _ in owned])
        last = conn.execute(
            sa.select(bill_imports.c.digest).where(
                bill_imports.c.source == source, bill_imports.c.billing_period == billing_period
            )
        ).scalar()
        before = trueup_shares(conn, affected)
        if last != digest:
            conn.execute(bill_lines.delete().where(key))
            if owned:
                conn.execute(
                    bill_lines.insert(), [_line_row(ln, kind, job) for ln, kind, job in owned]
                )
        state = _refigure(conn, affected, provisional_hours, now)
        after = trueup_shares(conn, affected)
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)}
        delta = {k: v for k, v in delta.items() if v}
        rules: dict[str, BudgetRule] = {}
        for job_scope in {scope for scope, _, _ in state.values()}:
            rules.update({r.scope: r for r in _path_rules(conn, job_scope)})
        add_to_periods(conn, delta, rules)
        conn.execute(
            bill_imports.delete().where(
                bill_imports.c.source == source, bill_imports.c.billing_period == billing_period
            )
        )
        conn.execute(
            bill_imports.insert().values(
                source=source,
                billing_period=billing_period,
                imported_at=now,
                digest=digest,
                lines=len(owned),
                read_from=read_from[:2000],
            )
        )
        over = _mark_over(conn, {k for k in delta}, rules, now)
        changed = (
            last != digest
            or bool(delta)
            or any(
                was_final.get(job_id) != (final, billed)
                for job_id, (_, final, billed) in state.items()
            )
        )
        return BillImport(
            source=source,
            billing_period=billing_period,
            lines=len(owned),
            changed=changed,
            jobs_final=sum(1 for _, final, _ in state.values() if final),
            jobs_provisional=sum(1 for _, final, _ in state.values() if not final),
            untagged_micro=sum(ln.billed_micro for ln, kind, _ in owned if kind == "untagged"),
            account_micro=sum(ln.billed_micro for ln, kind, _ in owned if kind == "account"),
            booked_micro=sum(delta.values()),
            over_by_bill=over,
        )

    @_reconnecting
    def over_by_bill(self, scope: str | None = None) -> list[OverByBill]:
        """The closed periods marked over their budget by the bill (of `scope`'s subtree)."""
        query = sa.select(over_by_bill).order_by(over_by_bill.c.scope, over_by_bill.c.period_start)
        if scope is not None:
            query = query.where(
                sa.or_(
                    over_by_bill.c.scope == scope,
                    over_by_bill.c.scope.startswith(scope + "/", autoescape=True),
                )
            )
        with self.db.read() as conn:
            return [
                OverByBill(r.scope, r.period_start, r.period_end, r.budget_micro, r.spent_micro)
                for r in conn.execute(query)
            ]

    @_reconnecting
    def drift(self, scope: str | None = None) -> dict[str, Any]:
        """Per job a bill names (in `scope`'s subtree): its reservation, settlement, bill and
        drift (bill - settlement) and whether the bill's figure is final; per scope the
        totals; and, apart, the lines no job owns (`untagged` usage, `account` lines), never
        spread over scopes. Money in micro-dollars."""
        query = (
            sa.select(
                bill_jobs.c.job_id,
                bill_jobs.c.scope,
                bill_jobs.c.billed_micro,
                bill_jobs.c.final,
                jobs.c.reserved_micro,
                jobs.c.actual_micro,
                jobs.c.state,
                jobs.c.name,
            )
            .select_from(bill_jobs.join(jobs, jobs.c.id == bill_jobs.c.job_id))
            .order_by(bill_jobs.c.scope, bill_jobs.c.job_id)
        )
        if scope is not None:
            query = query.where(
                sa.or_(
                    bill_jobs.c.scope == scope,
                    bill_jobs.c.scope.startswith(scope + "/", autoescape=True),
                )
            )
        with self.db.read() as conn:
            rows = conn.execute(query).mappings().all()
            unowned = (
                conn.execute(
                    sa.select(bill_lines)
                    .where(bill_lines.c.kind != "job")
                    .order_by(bill_lines.c.billing_period, bill_lines.c.usage_start)
                )
                .mappings()
                .all()
            )
            imports = conn.execute(sa.select(bill_imports)).mappings().all()
        per_job = []
        totals: dict[str, dict[str, int]] = {}
        for row in rows:
            settled = row["actual_micro"] or 0
            entry = {
                "job_id": row["job_id"],
                "name": row["name"],
                "scope": row["scope"],
                "reserved_micro": row["reserved_micro"] or 0,
                "settled_micro": settled,
                "billed_micro": row["billed_micro"],
                "drift_micro": row["billed_micro"] - settled,
                "final": bool(row["final"]),
            }
            per_job.append(entry)
            total = totals.setdefault(
                row["scope"],
                {"settled_micro": 0, "billed_micro": 0, "drift_micro": 0, "provisional": 0},
            )
            for name in ("settled_micro", "billed_micro", "drift_micro"):
                total[name] += entry[name]
            total["provisional"] += not entry["final"]
        return {
            "jobs": per_job,
            "scopes": totals,
            "untagged": [_line_view(r) for r in unowned if r["kind"] == "untagged"],
            "account": [_line_view(r) for r in unowned if r["kind"] == "account"],
            "imports": [dict(r) for r in imports],
        }


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


def _jobs_named(
    conn: Connection, lines: Sequence[BillLine], source: str, billing_period: str
) -> tuple[dict[str, BilledJob], dict[str, BilledJob]]:
    """The ledger jobs the lines name: by id (their marks) and by external id (a SageMaker
    line's resource, a training job's name)."""
    from prefect_gpu_budget.billing.trueup import resource_name

    marks = sorted({ln.job_mark for ln in lines if ln.job_mark})
    names = sorted({n for ln in lines if (n := resource_name(ln.resource_id))})
    by_id: dict[str, BilledJob] = {}
    by_external: dict[str, BilledJob] = {}
    for chunk in _chunks(marks):
        for row in conn.execute(sa.select(*_JOB_COLUMNS).where(jobs.c.id.in_(chunk))).mappings():
            by_id[row["id"]] = _billed_job(row)
    for chunk in _chunks(names):
        query = sa.select(*_JOB_COLUMNS).where(
            jobs.c.external_id.in_(chunk), jobs.c.launcher.startswith("sagemaker")
        )
        for row in conn.execute(query).mappings():
            by_external[row["external_id"]] = _billed_job(row)
    return by_id, by_external


def _chunks(values: list[str], size: int = 500) -> Iterable[list[str]]:
    for start in range(0, len(values), size):
        yield values[start : start + size]


def _line_row(line: BillLine, kind: str, job: BilledJob | None) -> dict[str, Any]:
    return {
        "source": line.source,
        "billing_period": line.billing_period,
        "line_id": line.line_id[:400],
        "job_id": job.id if job is not None else None,
        "kind": kind,
        "line_type": line.line_type[:60],
        "usage_start": line.usage_start,
        "usage_end": max(line.usage_start, line.usage_end),
        "billed_micro": line.billed_micro,
        "currency": line.currency.upper(),
        "mark": (line.job_mark or None) and line.job_mark[:200],
        "resource_id": (line.resource_id or None) and line.resource_id[:400],
        "description": line.description[:400],
    }


def _line_view(row: Any) -> dict[str, Any]:
    return {
        "source": row["source"],
        "billing_period": row["billing_period"],
        "line_id": row["line_id"],
        "line_type": row["line_type"],
        "usage_start": row["usage_start"],
        "usage_end": row["usage_end"],
        "billed_micro": row["billed_micro"],
        "mark": row["mark"],
        "resource_id": row["resource_id"],
        "description": row["description"],
    }


def _refigure(
    conn: Connection, job_ids: list[str], provisional_hours: float, now: float
) -> dict[str, tuple[str, bool, int]]:
    """Each job's bill from all its lines, and whether it is final: written to `bill_jobs`
    (a job no line names any more is taken out). Returns {job id: (scope, final, billed)}."""
    if not job_ids:
        return {}
    spans: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for job_id, amount, end in conn.execute(
        sa.select(bill_lines.c.job_id, bill_lines.c.billed_micro, bill_lines.c.usage_end).where(
            bill_lines.c.job_id.in_(job_ids)
        )
    ):
        spans[job_id].append((amount, end))
    rows = conn.execute(sa.select(*_JOB_COLUMNS).where(jobs.c.id.in_(job_ids))).mappings()
    state: dict[str, tuple[str, bool, int]] = {}
    conn.execute(bill_jobs.delete().where(bill_jobs.c.job_id.in_(job_ids)))
    for job in map(_billed_job, rows):
        if job.id not in spans:
            continue
        billed = sum(amount for amount, _ in spans[job.id])
        final = is_final(job, (end for _, end in spans[job.id]), now, provisional_hours)
        state[job.id] = (job.scope, final, billed)
        conn.execute(
            bill_jobs.insert().values(
                job_id=job.id,
                org=job.org,
                scope=job.scope,
                billed_micro=billed,
                final=final,
                updated_at=now,
            )
        )
    return state


def _mark_over(
    conn: Connection,
    touched: set[tuple[str, float]],
    rules: dict[str, BudgetRule],
    now: float,
) -> list[OverByBill]:
    """Mark each closed period of `touched` whose spend passes its budget now; unmark one
    that no longer does. Returns the newly marked (or marked higher)."""
    found = []
    for scope, p_start in sorted(touched):
        rule = rules.get(scope)
        row = conn.execute(
            sa.select(period_spend).where(
                period_spend.c.scope == scope, period_spend.c.period_start == p_start
            )
        ).first()
        if rule is None or rule.period_budget_micro is None or row is None or row.period_end > now:
            continue
        key = (over_by_bill.c.scope == scope) & (over_by_bill.c.period_start == p_start)
        was = conn.execute(sa.select(over_by_bill.c.spent_micro).where(key)).scalar()
        conn.execute(over_by_bill.delete().where(key))
        if row.settled_micro <= rule.period_budget_micro:
            continue
        mark = OverByBill(
            scope, p_start, row.period_end, rule.period_budget_micro, row.settled_micro
        )
        conn.execute(
            over_by_bill.insert().values(
                scope=scope,
                period_start=p_start,
                period_end=row.period_end,
                budget_micro=rule.period_budget_micro,
                spent_micro=row.settled_micro,
                marked_at=now,
            )
        )
        if was is None or was < row.settled_micro:
            found.append(mark)
    return found
