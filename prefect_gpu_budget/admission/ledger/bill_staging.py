"""An import's lines staged in the ledger (`tables.bill_staged`), for `bills.Bills` to import in
bounded memory: written batch by batch as they are read (`stage`), their repeated ids numbered
and their copies read twice marked (`number`), then, under the locks, classified (`classify`:
a copy of a line held under another period, a job's line booked or refused, untagged or
account) and swapped into `bill_lines` whole (`swap`), all in SQL but for one job's lines at a
time. What Python holds at once: a batch of lines, a page of repeated ids, one job's lines, and
per-job or per-period figures."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Sequence
from itertools import groupby
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from prefect_gpu_budget.admission.ledger.bill_store import (
    JOB_COLUMNS,
    billed_job,
    booked_elsewhere,
    chunks,
)
from prefect_gpu_budget.admission.ledger.engine import Db
from prefect_gpu_budget.admission.ledger.tables import bill_lines, bill_staged, jobs
from prefect_gpu_budget.billing.lines import BillError, BillLine, BillRead
from prefect_gpu_budget.billing.reading import numbered
from prefect_gpu_budget.billing.trueup import booked_lines, refusal, resource_name

STAGE_BATCH = 5_000
"""Lines read before they are written to the stage, in one short transaction."""
ID_PAGE = 500
"""Repeated line ids numbered at a time."""
STALE_S = 86400.0
"""Staged lines older than this belong to an import that died: the next import deletes them."""
Group = tuple[str, str]
"""(source, billing period)."""
Twice = dict[Group, tuple[int, int, str]]
"""Per group: lines read again (booked once), and the place in the read and where the first
of them (in the read's order) was."""

S = bill_staged.c


def stage(
    db: Db, token: str, reads: Iterable[BillRead], check: Callable[[BillLine], None]
) -> tuple[set[Group], int]:
    """Write the reads' lines to the stage under `token`, `STAGE_BATCH` at a time, each line
    `check`ed first (it raises to refuse one): the groups they hold or name, and how many
    reads (parts) there were."""
    groups: set[Group] = set()
    seq, parts, at = 0, 0, time.time()
    for part, read in enumerate(reads):
        parts = part + 1
        groups.update(read.periods)
        batch: list[tuple[Any, ...]] = []
        for line in read.lines:
            check(line)
            groups.add((line.source, line.billing_period))
            batch.append(staged_row(token, seq, part, line, at))
            seq += 1
            if len(batch) >= STAGE_BATCH:
                _write(db, batch)
                batch = []
        _write(db, batch)
    return groups, parts


STAGED = tuple(c.name for c in bill_staged.columns)
"""The stage's columns, in the order `staged_row` gives their values."""
PLACEHOLDER = {"qmark": "?", "format": "%s", "pyformat": "%s"}


def _write(db: Db, batch: list[tuple[Any, ...]]) -> None:
    """One batch of staged rows, in a transaction of its own, through the driver's own
    `executemany` (a row costs no statement compilation)."""
    if not batch:
        return
    with db.tx() as conn:
        mark = PLACEHOLDER[conn.dialect.paramstyle]
        sql = (
            f"INSERT INTO {bill_staged.name} ({', '.join(STAGED)}) "
            f"VALUES ({', '.join([mark] * len(STAGED))})"
        )
        conn.exec_driver_sql(sql, batch)


def staged_row(token: str, seq: int, part: int, line: BillLine, at: float) -> tuple[Any, ...]:
    """A line as the stage holds it (in `STAGED`'s order): as read, its kind if no job owns
    it."""
    return (
        token,
        seq,
        part,
        at,
        line.source,
        line.billing_period,
        line.line_id,
        None,  # repeat_id
        None,  # numbered_id
        "untagged" if line.usage else "account",
        None,  # job_id
        line.line_type,
        line.usage_start,
        line.usage_end,
        line.billed_micro,
        line.currency,
        line.job_mark,
        line.resource_id,
        resource_name(line.resource_id),
        line.description,
        line.version,
        line.where,
        False,  # dup
        None,  # reason
    )


def staged_line(row: Any) -> BillLine:
    return BillLine(
        source=row.source,
        billing_period=row.billing_period,
        line_id=row.line_id,
        line_type=row.line_type,
        usage_start=row.usage_start,
        usage_end=row.usage_end,
        billed_micro=row.billed_micro,
        currency=row.currency,
        job_mark=row.mark,
        resource_id=row.resource_id,
        description=row.description,
        where=row.place,
        version=row.version,
    )


def discard(db: Db, token: str) -> None:
    """Delete what `token` staged, and what an import that died a day ago left."""
    with db.tx() as conn:
        conn.execute(bill_staged.delete().where(S.token == token))
        conn.execute(bill_staged.delete().where(S.staged_at < time.time() - STALE_S))


def number(conn: Connection, token: str, part: int, renumber: bool, twice: Twice) -> None:
    """Number the line ids repeated within one read (`reading.numbered`, as `number_repeats`
    numbers a list) unless `renumber` is False (then two lines of one id that differ are
    refused), and mark `dup` each line alike in all it says to one before it in its (source,
    billing period): counted in `twice`. One sort of the read's ids finds the repeated ones
    (usually none); those are flagged (`repeat_id`) and taken `ID_PAGE` ids at a time."""
    mine = (S.token == token) & (S.part == part)
    repeated = sa.select(S.line_id).where(mine).group_by(S.line_id).having(sa.func.count() > 1)
    if conn.execute(repeated.limit(1)).first() is None:
        return
    conn.execute(
        bill_staged.update().where(mine, S.line_id.in_(repeated)).values(repeat_id=S.line_id)
    )
    page = (
        sa.select(S.repeat_id)
        .where(mine, S.repeat_id.is_not(None))
        .distinct()
        .order_by(S.repeat_id)
        .limit(ID_PAGE)
    )
    last, renamed = None, 0
    while (
        ids := conn.execute(page if last is None else page.where(S.repeat_id > last))
        .scalars()
        .all()
    ):
        last = ids[-1]
        rows = conn.execute(
            sa.select(bill_staged).where(mine, S.repeat_id.in_(ids)).order_by(S.repeat_id, S.seq)
        ).all()
        renames: list[dict[str, Any]] = []
        dups: list[dict[str, Any]] = []
        for _, same_id in groupby(rows, key=lambda r: r.line_id):
            _one_id(list(same_id), renumber, renames, dups, twice)
        _update(conn, token, renames, numbered_id=sa.bindparam("b_id"))
        _update(conn, token, dups, dup=True)
        renamed += len(renames)
    if renamed:
        conn.execute(
            bill_staged.update()
            .where(mine, S.numbered_id.is_not(None))
            .values(line_id=S.numbered_id, numbered_id=None)
        )


def _one_id(
    rows: Sequence[Any],
    renumber: bool,
    renames: list[dict[str, Any]],
    dups: list[dict[str, Any]],
    twice: Twice,
) -> None:
    lines = [staged_line(r) for r in rows]
    ids = numbered(lines) if renumber else [line.line_id for line in lines]
    first: dict[tuple[str, str], int] = {}
    for i, (row, line_id) in enumerate(zip(rows, ids, strict=True)):
        if line_id != row.line_id:
            renames.append({"b_seq": row.seq, "b_id": line_id})
        j = first.setdefault((row.billing_period, line_id), i)
        if j == i:
            continue
        if lines[j].content != lines[i].content:
            where = row.place or "bill"
            raise BillError(where, f"line {line_id} twice, differently: number repeats")
        dups.append({"b_seq": row.seq})
        group = (row.source, row.billing_period)
        count, seq, where = twice.get(group, (0, row.seq, ""))
        if not where or row.seq < seq:
            seq, where = row.seq, f"{row.place or line_id} (as {rows[j].place})"
        twice[group] = (count + 1, seq, where)


def _update(conn: Connection, token: str, rows: list[dict[str, Any]], **values: Any) -> None:
    if rows:
        query = bill_staged.update().where(S.token == token, S.seq == sa.bindparam("b_seq"))
        conn.execute(query.values(**values), rows)


def in_group(token: str, source: str, billing_period: str) -> Any:
    """The staged lines of one (source, billing period), each once."""
    return sa.and_(
        S.token == token,
        S.source == source,
        S.billing_period == billing_period,
        S.dup.is_(False),
    )


def named_orgs(conn: Connection, token: str, source: str, billing_period: str) -> set[str]:
    """The orgs of the jobs the staged lines of a group may bill (by mark, or a SageMaker
    training job's name)."""
    group = in_group(token, source, billing_period)
    by_mark = sa.select(jobs.c.org).where(jobs.c.id.in_(sa.select(S.mark).where(group)))
    by_name = sa.select(jobs.c.org).where(
        jobs.c.external_id.in_(sa.select(S.resource_name).where(group)),
        jobs.c.launcher.startswith("sagemaker"),
    )
    return set(conn.execute(sa.union(by_mark, by_name)).scalars())


def classify(conn: Connection, token: str, source: str, billing_period: str, now: float) -> None:
    """Each staged line's kind, job and reason, as `bill_lines` holds them: a `copy` of a line
    held under another billing period; a line of a job it can be true of (`job`), or
    `refused` with the reason; else `untagged` or `account`, as staged."""
    group = in_group(token, source, billing_period)
    _copies(conn, group, source, billing_period)
    owned = sa.and_(group, S.kind != "copy")
    conn.execute(
        bill_staged.update()
        .where(owned, S.mark.in_(sa.select(jobs.c.id)))
        .values(job_id=S.mark, kind="job")
    )
    sagemaker = jobs.c.launcher.startswith("sagemaker")
    by_name = (
        sa.select(jobs.c.id)
        .where(jobs.c.external_id == S.resource_name, sagemaker)
        .limit(1)
        .scalar_subquery()
    )
    conn.execute(
        bill_staged.update()
        .where(
            owned,
            S.job_id.is_(None),
            S.resource_name.in_(sa.select(jobs.c.external_id).where(sagemaker)),
        )
        .values(job_id=by_name, kind="job")
    )
    job_ids = sorted(
        conn.execute(sa.select(S.job_id).where(owned, S.job_id.is_not(None)).distinct()).scalars()
    )
    others = booked_elsewhere(conn, source, billing_period, job_ids)
    for chunk in chunks(job_ids):
        for row in conn.execute(sa.select(*JOB_COLUMNS).where(jobs.c.id.in_(chunk))).mappings():
            job = billed_job(row)
            its = conn.execute(
                sa.select(bill_staged).where(owned, S.job_id == job.id).order_by(S.seq)
            ).all()
            _book(conn, token, job, its, others.get(job.id, (0, False)), now)


def _book(
    conn: Connection, token: str, job: Any, rows: Sequence[Any], other: Any, now: float
) -> None:
    """One job's staged lines booked (`job`) or refused with the reason
    (`trueup.refusal`, `trueup.booked_lines`)."""
    true: list[tuple[int, BillLine]] = []
    refused: list[tuple[int, str]] = []
    for row in rows:
        line = staged_line(row)
        why = refusal(line, job, now)
        if why is None:
            true.append((row.seq, line))
        else:
            refused.append((row.seq, why))
    seq_of = {id(line): seq for seq, line in true}
    _, wrong = booked_lines([line for _, line in true], *other)
    refused += [(seq_of[id(line)], why) for line, why in wrong]
    _update(
        conn,
        token,
        [{"b_seq": seq, "b_why": why} for seq, why in refused],
        kind="refused",
        job_id=None,
        reason=sa.bindparam("b_why"),
    )


def _copies(conn: Connection, group: Any, source: str, billing_period: str) -> None:
    """Mark `copy` the staged lines the ledger holds under another billing period of
    `source` (as a line of its own), naming the earliest such period."""
    b = bill_lines.alias("held")
    elsewhere = (b.c.source == source) & (b.c.billing_period != billing_period)
    elsewhere &= b.c.kind != "copy"
    if conn.execute(sa.select(b.c.line_id).where(elsewhere).limit(1)).first() is None:
        return
    held = elsewhere & (b.c.line_id == sa.func.substr(S.line_id, 1, 400))
    period = sa.select(sa.func.min(b.c.billing_period)).where(held).scalar_subquery()
    conn.execute(
        bill_staged.update()
        .where(group, sa.exists().where(held))
        .values(kind="copy", reason=sa.literal(f"already held under {source} ") + period)
    )


def _as_stored() -> list[Any]:
    """The staged columns as `bill_lines` stores them, in its columns' order."""
    later = sa.case((S.usage_end < S.usage_start, S.usage_start), else_=S.usage_end)
    return [
        S.source,
        S.billing_period,
        sa.func.substr(S.line_id, 1, 400).label("line_id"),
        S.job_id,
        S.kind,
        sa.func.substr(S.line_type, 1, 60).label("line_type"),
        S.usage_start,
        later.label("usage_end"),
        S.billed_micro,
        sa.func.upper(S.currency).label("currency"),
        sa.func.nullif(sa.func.substr(S.mark, 1, 200), "").label("mark"),
        sa.func.nullif(sa.func.substr(S.resource_id, 1, 400), "").label("resource_id"),
        sa.func.substr(S.description, 1, 400).label("description"),
        S.reason,
    ]


STORED = [
    "source",
    "billing_period",
    "line_id",
    "job_id",
    "kind",
    "line_type",
    "usage_start",
    "usage_end",
    "billed_micro",
    "currency",
    "mark",
    "resource_id",
    "description",
    "reason",
]
SIGNATURE = ("line_id", "kind", "job_id", "line_type", "usage_start", "usage_end")
SIGNATURE += ("billed_micro", "reason")
"""What an import's lines say, for telling whether a new import says the same."""


def swap(conn: Connection, token: str, source: str, billing_period: str) -> bool:
    """Replace `bill_lines`' lines of (source, billing period) with the staged ones, unless
    they say the same (nothing is written then). Whether they differed."""
    group = in_group(token, source, billing_period)
    key = (bill_lines.c.source == source) & (bill_lines.c.billing_period == billing_period)
    stored = _as_stored()
    count = sa.select(sa.func.count())
    old_n = conn.execute(count.select_from(bill_lines).where(key)).scalar_one()
    new_n = conn.execute(count.select_from(bill_staged).where(group)).scalar_one()
    if old_n == new_n:
        expr = dict(zip(STORED, stored, strict=True))
        alike = sa.and_(
            key,
            bill_lines.c.line_id == expr["line_id"],
            *(bill_lines.c[name].is_not_distinct_from(expr[name]) for name in SIGNATURE),
        )
        matched = conn.execute(
            count.select_from(bill_staged).where(group, sa.exists().where(alike))
        ).scalar_one()
        if matched == new_n:
            return False
    conn.execute(bill_lines.delete().where(key))
    ordered = sa.select(*stored).where(group).order_by(S.line_id)  # in its indexes' order
    conn.execute(bill_lines.insert().from_select(STORED, ordered))
    return True


def digest(conn: Connection, source: str, billing_period: str) -> str:
    """A fingerprint of what the ledger holds of (source, billing period): per kind, its
    lines, their money, their usage and the length of their ids and reasons."""
    c = bill_lines.c
    query = (
        sa.select(
            c.kind,
            sa.func.count(),
            sa.func.sum(c.billed_micro),
            sa.func.sum(c.usage_start),
            sa.func.sum(c.usage_end),
            sa.func.sum(sa.func.length(c.line_id)),
            sa.func.sum(sa.func.length(sa.func.coalesce(c.reason, ""))),
            sa.func.count(c.job_id.distinct()),
        )
        .where(c.source == source, c.billing_period == billing_period)
        .group_by(c.kind)
        .order_by(c.kind)
    )
    figures = [[str(v) for v in row] for row in conn.execute(query)]
    return hashlib.sha256(json.dumps(figures).encode()).hexdigest()


def tally(conn: Connection, token: str, source: str, billing_period: str) -> dict[str, Any]:
    """Of a group's staged lines: how many, and per kind how many and what they bill; the
    copies by the period holding them."""
    group = in_group(token, source, billing_period)
    kinds = {
        kind: (n, int(total or 0))
        for kind, n, total in conn.execute(
            sa.select(S.kind, sa.func.count(), sa.func.sum(S.billed_micro))
            .where(group)
            .group_by(S.kind)
        )
    }
    copies: dict[str, int] = {}
    for reason, n in conn.execute(
        sa.select(S.reason, sa.func.count()).where(group, S.kind == "copy").group_by(S.reason)
    ):
        held = (reason or "").rsplit(" ", 1)[-1]
        copies[held] = copies.get(held, 0) + n
    return {"lines": sum(n for n, _ in kinds.values()), "kinds": kinds, "copies": copies}


def staged_jobs(conn: Connection, token: str, source: str, billing_period: str) -> set[str]:
    """The jobs a group's staged lines bill."""
    group = in_group(token, source, billing_period)
    query = sa.select(S.job_id).where(group, S.kind == "job").distinct()
    return set(conn.execute(query).scalars())
