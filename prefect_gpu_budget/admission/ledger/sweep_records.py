"""A sweep's results in the ledger's database: its trials' parameters and metrics, each
record they reported (learning curves), and its published outputs (results table, summary,
plots). The sweep flow writes them as it goes; the agent gateway reads them, from any host,
with the ledger's credentials and never the worker's files.

A store of its own over the ledger's database (`SweepRecords(ledger)`): none of it takes part
in admission, and none of it is read by the gate.

Bounded: each record is kept flat and small (`flat_record`), at most MAX_RECORDS per trial, and a
sweep's rows go RESULTS_RETENTION_S after it ended (`prune`, run as each sweep opens).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping
from itertools import chain
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from prefect_gpu_budget.admission.ledger.tables import (
    sweep_outputs,
    sweep_trials,
    sweeps,
    trial_metrics,
)

MAX_RECORDS = 10_000
"""Records kept per trial: a learning curve longer than this keeps its first MAX_RECORDS."""
MAX_OUTPUT_BYTES = 16 << 20
"""Largest output (a plot, the results table) kept for a sweep."""
MAX_RECORD_BYTES = 4096
"""Largest record kept, as its JSON (after `flat_record`): a page of 1000 records the gateway
loads stays a few MB of Python objects, whatever the trials wrote."""
MAX_RECORD_KEYS = 64
"""Keys kept per record (the first ones with a scalar value)."""
MAX_KEY_CHARS = 64
"""A longer key is dropped with its value."""
MAX_STR_CHARS = 256
"""A longer string value is cut to this many characters."""
RESULTS_RETENTION_S = 30 * 86400.0
"""How long a sweep's results (its rows in all four tables) are kept after it ended (or, never
ended, after it started): each `open_sweep` prunes the sweeps older than this."""
_KEPT_FIRST = ("summary", "step")
"""Keys `flat_record` takes before any other: what `latest_metrics` reads."""
_INT_BOUND = 1 << 63
"""Integers kept: those of a signed 64-bit integer (a bigger one could not even be written as
JSON past 4300 digits)."""


def _json(value: Any) -> str:
    return json.dumps(value, default=str, allow_nan=False) if value is not None else "null"


class Kept(NamedTuple):
    """What `keep` keeps of one reported record."""

    record: dict[str, Any] | None
    """The record, flat and small; None when it is dropped whole."""
    non_finite: tuple[str, ...]
    """The keys whose value was NaN or an infinity, left out of `record` (none when `record`
    is None)."""


def keep(record: Mapping[str, Any]) -> Kept:
    """What is kept of one reported record: a flat mapping of at most MAX_RECORD_KEYS string keys
    (of at most MAX_KEY_CHARS characters; a longer key is dropped) to scalars only: an int (of 64
    bits), a finite float, a bool, None, or a string (cut to MAX_STR_CHARS characters). A NaN or
    an infinity (JSON parses `NaN`, `Infinity` and `1e999` as floats) is left out, its key named
    in `non_finite`: such a value never stands in a record, and never replaces a finite one in a
    trial's metrics (`latest_metrics`). Nested values (lists, mappings) and anything else are
    dropped. `summary` and `step` (see `latest_metrics`) are taken first, so that many keys
    never push them out. The record is None, dropped, when its JSON is still over
    MAX_RECORD_BYTES (or it is not a mapping).

    A metrics file's line may be 64 KiB of nested lists or mappings (`metrics_file`), ~49 times
    that as Python objects; flat and small, a record costs a few KB wherever it is loaded (the
    gateway's pages of records, the sweep flow's learning curves). Keeping a kept record again
    changes nothing."""
    if not isinstance(record, Mapping):
        return Kept(None, ())
    flat: dict[str, Any] = {}
    non_finite: list[str] = []
    first = [(k, record[k]) for k in _KEPT_FIRST if k in record]
    for key, value in chain(first, ((k, v) for k, v in record.items() if k not in _KEPT_FIRST)):
        if len(flat) >= MAX_RECORD_KEYS:
            break
        key = key if isinstance(key, str) else str(key)
        if len(key) > MAX_KEY_CHARS:
            continue
        if value is None or isinstance(value, bool):
            flat[key] = value
        elif isinstance(value, int):
            if -_INT_BOUND <= value < _INT_BOUND:
                flat[key] = int(value)
        elif isinstance(value, float):
            if math.isfinite(value):
                flat[key] = float(value)
            else:
                non_finite.append(key)
        elif isinstance(value, str):
            flat[key] = str(value[:MAX_STR_CHARS])
    if len(_json(flat)) > MAX_RECORD_BYTES:
        return Kept(None, ())
    return Kept(flat, tuple(non_finite))


def flat_record(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """The record as `keep` keeps it (None: dropped)."""
    return keep(record).record


def flat_records(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`flat_record` of each record, those dropped left out."""
    return [f for f in map(flat_record, records) if f is not None]


def non_finite_count(records: Iterable[Mapping[str, Any]]) -> int:
    """How many NaN and infinite values `keep` left out of these records."""
    return sum(len(keep(r).non_finite) for r in records)


def _upsert(conn: Any, values: Mapping[str, Any]) -> Any:
    """An INSERT of a `gpu_sweeps` row that can take `.on_conflict_do_update` (on either
    database the ledger runs on)."""
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    return dialect.insert(sweeps).values(**values)


_PRUNE_BATCH = 500
"""Run ids per DELETE (SQLite before 3.32 takes at most 999 parameters a statement)."""


def _prune(conn: Any, before: float) -> int:
    """Delete the results of the sweeps that ended (never ended: started) before `before`."""
    old = (
        conn.execute(
            sa.select(sweeps.c.run_id).where(
                sa.func.coalesce(sweeps.c.ended_at, sweeps.c.started_at) < before
            )
        )
        .scalars()
        .all()
    )
    for start in range(0, len(old), _PRUNE_BATCH):
        batch = old[start : start + _PRUNE_BATCH]
        for table in (trial_metrics, sweep_trials, sweep_outputs, sweeps):
            conn.execute(table.delete().where(table.c.run_id.in_(batch)))
    return len(old)


_PLACEHOLDER_GOAL = ""
"""The goal of a `gpu_sweeps` row that `cancel` made before its flow opened the sweep (a sweep's
own goal is "min" or "max"): `sweep` answers None for it until `open_sweep` fills it in."""


class SweepRecords:
    """The results of sweeps, over the ledger's database (`Ledger`)."""

    def __init__(self, ledger: Any) -> None:
        self.ledger = ledger

    # -- writes (the sweep flow) -----------------------------------------------------------

    def open_sweep(
        self,
        run_id: str,
        scope: str,
        name: str,
        metric: str,
        goal: str,
        params: list[Mapping[str, Any]],
        now: float | None = None,
    ) -> None:
        """Record a sweep and every trial's parameters, in one transaction (again: replaced,
        except that a sweep cancelled already, even before it opened, stays cancelled). Prunes
        the results older than RESULTS_RETENTION_S first."""
        now = time.time() if now is None else now
        with self.ledger.db.tx() as conn:
            _prune(conn, now - RESULTS_RETENTION_S)
            for table in (trial_metrics, sweep_trials, sweep_outputs):
                conn.execute(table.delete().where(table.c.run_id == run_id))
            values = {
                "scope": scope,
                "name": name,
                "metric": metric,
                "goal": goal,
                "trials": len(params),
                "started_at": now,
                "ended_at": None,
                "message": "",
            }
            conn.execute(  # one statement: a concurrent `cancel` is kept, never overwritten
                _upsert(conn, {"run_id": run_id, **values}).on_conflict_do_update(
                    index_elements=[sweeps.c.run_id], set_=values
                )
            )
            if params:
                conn.execute(
                    sweep_trials.insert(),
                    [
                        {
                            "run_id": run_id,
                            "trial": i,
                            "params": _json(dict(p)),
                            "metrics": "{}",
                            "records": 0,
                            "non_finite": 0,
                            "reason": "",
                        }
                        for i, p in enumerate(params)
                    ],
                )

    def add_records(self, run_id: str, trial: int, records: Iterable[Mapping[str, Any]]) -> int:
        """Append a trial's newly reported records, each as `keep` keeps it (up to MAX_RECORDS
        in all); keep its latest metrics (`latest_metrics`) and count the NaN and infinite
        values left out, from every record, past MAX_RECORDS too; returns how many records
        were stored."""
        reported = [keep(r) for r in records]
        flat = [k.record for k in reported if k.record is not None]
        dropped = sum(len(k.non_finite) for k in reported)
        if not flat:
            return 0
        with self.ledger.db.tx() as conn:
            row = conn.execute(
                sa.select(
                    sweep_trials.c.records, sweep_trials.c.metrics, sweep_trials.c.non_finite
                ).where(sweep_trials.c.run_id == run_id, sweep_trials.c.trial == trial)
            ).first()
            if row is None:
                return 0
            kept = flat[: max(0, MAX_RECORDS - row.records)]
            if kept:
                conn.execute(
                    trial_metrics.insert(),
                    [
                        {
                            "run_id": run_id,
                            "trial": trial,
                            "seq": row.records + i,
                            "record": _json(r),
                        }
                        for i, r in enumerate(kept)
                    ],
                )
            metrics = _after(json.loads(row.metrics or "{}"), reported)
            conn.execute(
                sweep_trials.update()
                .where(sweep_trials.c.run_id == run_id, sweep_trials.c.trial == trial)
                .values(
                    records=row.records + len(kept),
                    metrics=_json(metrics),
                    non_finite=(row.non_finite or 0) + dropped,
                )
            )
        return len(kept)

    def end_trial(self, run_id: str, trial: int, state: str, reason: str) -> None:
        with self.ledger.db.tx() as conn:
            conn.execute(
                sweep_trials.update()
                .where(sweep_trials.c.run_id == run_id, sweep_trials.c.trial == trial)
                .values(state=state[:40], reason=reason)
            )

    def end_sweep(self, run_id: str, message: str, now: float | None = None) -> None:
        with self.ledger.db.tx() as conn:
            conn.execute(
                sweeps.update()
                .where(sweeps.c.run_id == run_id)
                .values(ended_at=time.time() if now is None else now, message=message)
            )

    def put_output(self, run_id: str, name: str, media_type: str, content: bytes) -> bool:
        """Keep one output of a sweep (replacing one of the same name); False when too big."""
        if len(content) > MAX_OUTPUT_BYTES:
            return False
        with self.ledger.db.tx() as conn:
            conn.execute(
                sweep_outputs.delete().where(
                    sweep_outputs.c.run_id == run_id, sweep_outputs.c.name == name
                )
            )
            conn.execute(
                sweep_outputs.insert().values(
                    run_id=run_id, name=name, media_type=media_type, content=content
                )
            )
        return True

    def cancel(self, run_id: str, now: float | None = None) -> bool:
        """Ask the sweep to start no more trials; False if it was asked already. A sweep not yet
        opened (its flow has not reached `open_sweep`) gets a placeholder row, cancelled, which
        `open_sweep` fills in and keeps cancelled."""
        now = time.time() if now is None else now
        placeholder = {
            "run_id": run_id,
            "scope": "",
            "name": "",
            "metric": "",
            "goal": _PLACEHOLDER_GOAL,
            "trials": 0,
            "started_at": now,
            "cancelled_at": now,
            "message": "",
        }
        with self.ledger.db.tx() as conn:
            upsert = _upsert(conn, placeholder).on_conflict_do_update(
                index_elements=[sweeps.c.run_id],
                set_={"cancelled_at": now},
                where=sweeps.c.cancelled_at.is_(None),
            )
            if not conn.dialect.insert_returning:  # SQLite before 3.35: its count is right
                return bool(conn.execute(upsert).rowcount)
            # psycopg's count of an upsert reads -1 through SQLAlchemy: the row written says it
            return conn.execute(upsert.returning(sweeps.c.run_id)).first() is not None

    def prune(self, before: float) -> int:
        """Delete every result (all four tables' rows) of the sweeps that ended before `before`,
        or never ended and started before it; how many sweeps went. `open_sweep` runs it with
        `before` RESULTS_RETENTION_S ago."""
        with self.ledger.db.tx() as conn:
            return _prune(conn, before)

    # -- reads (the sweep flow's checks, the gateway) --------------------------------------

    def sweep(self, run_id: str) -> dict[str, Any] | None:
        """The sweep's row once its flow opened it (`open_sweep`): None before, even when it was
        cancelled already (see `cancelled`)."""
        with self.ledger.db.read() as conn:
            row = conn.execute(
                sweeps.select().where(sweeps.c.run_id == run_id, sweeps.c.goal != _PLACEHOLDER_GOAL)
            ).first()
        return None if row is None else dict(row._mapping)

    def started(self, run_id: str) -> bool:
        """Whether the sweep's flow opened it (`open_sweep`); a cancel before does not count."""
        return self.sweep(run_id) is not None

    def latest(self, scope: str, name: str, since: float) -> str | None:
        """The run id of the newest sweep `name` in `scope` that started at or after `since`."""
        with self.ledger.db.read() as conn:
            return conn.execute(
                sa.select(sweeps.c.run_id)
                .where(sweeps.c.scope == scope, sweeps.c.name == name)
                .where(sweeps.c.started_at >= since, sweeps.c.goal != _PLACEHOLDER_GOAL)
                .order_by(sweeps.c.started_at.desc())
                .limit(1)
            ).scalar_one_or_none()

    def cancelled(self, run_id: str) -> bool:
        with self.ledger.db.read() as conn:
            return (
                conn.execute(
                    sa.select(sweeps.c.cancelled_at).where(sweeps.c.run_id == run_id)
                ).scalar_one_or_none()
                is not None
            )

    def trials(self, run_id: str) -> list[dict[str, Any]]:
        """Each trial: its number, parameters, latest metrics, record count, how many NaN and
        infinite values it reported (left out of its records and metrics), final state."""
        with self.ledger.db.read() as conn:
            rows = conn.execute(
                sweep_trials.select()
                .where(sweep_trials.c.run_id == run_id)
                .order_by(sweep_trials.c.trial)
            ).all()
        return [
            {
                "trial": r.trial,
                "params": json.loads(r.params),
                "metrics": shown_metrics(json.loads(r.metrics or "{}")),
                "records": r.records,
                "non_finite_dropped": r.non_finite or 0,
                "state": r.state,
                "reason": r.reason,
            }
            for r in rows
        ]

    def records(self, run_id: str, trial: int, offset: int, limit: int) -> list[dict[str, Any]]:
        with self.ledger.db.read() as conn:
            rows = conn.execute(
                sa.select(trial_metrics.c.record)
                .where(trial_metrics.c.run_id == run_id, trial_metrics.c.trial == trial)
                .where(trial_metrics.c.seq >= offset)
                .order_by(trial_metrics.c.seq)
                .limit(limit)
            ).all()
        return [json.loads(r.record) for r in rows]

    def outputs(self, run_id: str) -> dict[str, str]:
        """Name -> media type of a sweep's outputs."""
        with self.ledger.db.read() as conn:
            rows = conn.execute(
                sa.select(sweep_outputs.c.name, sweep_outputs.c.media_type)
                .where(sweep_outputs.c.run_id == run_id)
                .order_by(sweep_outputs.c.name)
            ).all()
        return {r.name: r.media_type for r in rows}

    def output(self, run_id: str, name: str) -> tuple[str, bytes] | None:
        with self.ledger.db.read() as conn:
            row = conn.execute(
                sa.select(sweep_outputs.c.media_type, sweep_outputs.c.content).where(
                    sweep_outputs.c.run_id == run_id, sweep_outputs.c.name == name
                )
            ).first()
        return None if row is None else (row.media_type, bytes(row.content))

    def version(self, run_id: str) -> tuple[Any, ...]:
        """What changes whenever the sweep's results do (records, trial states, outputs)."""
        with self.ledger.db.read() as conn:
            trials = conn.execute(
                sa.select(
                    sa.func.count(),
                    sa.func.coalesce(sa.func.sum(sweep_trials.c.records), 0),
                    sa.func.count(sweep_trials.c.state),
                ).where(sweep_trials.c.run_id == run_id)
            ).one()
            outputs = conn.execute(
                sa.select(sa.func.count()).where(sweep_outputs.c.run_id == run_id)
            ).scalar_one()
            ended = conn.execute(
                sa.select(sweeps.c.ended_at, sweeps.c.cancelled_at).where(sweeps.c.run_id == run_id)
            ).first()
        return (*trials, outputs, *(ended or (None, None)))


SUMMARY_SEEN = "__summary__"
"""Kept with a trial's metrics once its summary was reported; never shown."""


def shown_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if k != SUMMARY_SEEN}


def latest_metrics(
    metrics: Mapping[str, Any], records: Iterable[Mapping[str, Any]]
) -> dict[str, Any]:
    """A trial's metrics after `records`, each as `keep` keeps it: its summary (a record with
    `"summary": true`), else its last record, without the `summary` and `step` keys. Once a
    summary was seen, later records that are not summaries do not replace it. A value left out
    as NaN or an infinity replaces nothing: its key keeps the finite value it had, so a trial
    that writes `NaN` after a finite loss still reports that loss."""
    return _after(metrics, map(keep, records))


def _after(metrics: Mapping[str, Any], reported: Iterable[Kept]) -> dict[str, Any]:
    """`latest_metrics` of records kept already."""
    current = dict(metrics)
    for kept in reported:
        record = kept.record
        if record is None or not (record.get("summary") or not current.get(SUMMARY_SEEN)):
            continue
        held = {k: current[k] for k in kept.non_finite if k in current}
        current = {**held, **{k: v for k, v in record.items() if k not in ("summary", "step")}}
        if record.get("summary"):
            current[SUMMARY_SEEN] = True
    return current
