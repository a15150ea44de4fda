"""A sweep's results in the ledger's database: its trials' parameters and metrics, each
record they reported (learning curves), and its published outputs (results table, summary,
plots). The sweep flow writes them as it goes; the agent gateway reads them, from any host,
with the ledger's credentials and never the worker's files.

One of the ledger's stores (`ledger.sweeps`): none of it takes part in admission, and none of
it is read by the gate.

Bounded: each record is kept flat and small (`trial_records.keep`), at most MAX_RECORDS per
trial, and a sweep's rows go RESULTS_RETENTION_S after it ended (`prune`, run as each sweep
opens).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from prefect_gpu_budget.admission.ledger.engine import Db
from prefect_gpu_budget.admission.ledger.tables import (
    sweep_outputs,
    sweep_trials,
    sweeps,
    trial_metrics,
)
from prefect_gpu_budget.admission.ledger.trial_records import (
    keep,
    metrics_after,
    shown_metrics,
    to_json,
)

MAX_RECORDS = 10_000
"""Records kept per trial: a learning curve longer than this keeps its first MAX_RECORDS."""
MAX_OUTPUT_BYTES = 16 << 20
"""Largest output (a plot, the results table) kept for a sweep."""
RESULTS_RETENTION_S = 30 * 86400.0
"""How long a sweep's results (its rows in all four tables) are kept after it ended (or, never
ended, after it started): each `open_sweep` prunes the sweeps older than this."""


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
    """The results of sweeps, over the ledger's database (`Ledger.sweeps`)."""

    def __init__(self, db: Db) -> None:
        self.db = db

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
        with self.db.tx() as conn:
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
                            "params": to_json(dict(p)),
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
        with self.db.tx() as conn:
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
                            "record": to_json(r),
                        }
                        for i, r in enumerate(kept)
                    ],
                )
            metrics = metrics_after(json.loads(row.metrics or "{}"), reported)
            conn.execute(
                sweep_trials.update()
                .where(sweep_trials.c.run_id == run_id, sweep_trials.c.trial == trial)
                .values(
                    records=row.records + len(kept),
                    metrics=to_json(metrics),
                    non_finite=(row.non_finite or 0) + dropped,
                )
            )
        return len(kept)

    def end_trial(self, run_id: str, trial: int, state: str, reason: str) -> None:
        with self.db.tx() as conn:
            conn.execute(
                sweep_trials.update()
                .where(sweep_trials.c.run_id == run_id, sweep_trials.c.trial == trial)
                .values(state=state[:40], reason=reason)
            )

    def end_sweep(self, run_id: str, message: str, now: float | None = None) -> None:
        with self.db.tx() as conn:
            conn.execute(
                sweeps.update()
                .where(sweeps.c.run_id == run_id)
                .values(ended_at=time.time() if now is None else now, message=message)
            )

    def put_output(self, run_id: str, name: str, media_type: str, content: bytes) -> bool:
        """Keep one output of a sweep (replacing one of the same name); False when too big."""
        if len(content) > MAX_OUTPUT_BYTES:
            return False
        with self.db.tx() as conn:
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
        with self.db.tx() as conn:
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
        with self.db.tx() as conn:
            return _prune(conn, before)

    # -- reads (the sweep flow's checks, the gateway) --------------------------------------

    def sweep(self, run_id: str) -> dict[str, Any] | None:
        """The sweep's row once its flow opened it (`open_sweep`): None before, even when it was
        cancelled already (see `cancelled`)."""
        with self.db.read() as conn:
            row = conn.execute(
                sweeps.select().where(sweeps.c.run_id == run_id, sweeps.c.goal != _PLACEHOLDER_GOAL)
            ).first()
        return None if row is None else dict(row._mapping)

    def started(self, run_id: str) -> bool:
        """Whether the sweep's flow opened it (`open_sweep`); a cancel before does not count."""
        return self.sweep(run_id) is not None

    def latest(self, scope: str, name: str, since: float) -> str | None:
        """The run id of the newest sweep `name` in `scope` that started at or after `since`."""
        with self.db.read() as conn:
            return conn.execute(
                sa.select(sweeps.c.run_id)
                .where(sweeps.c.scope == scope, sweeps.c.name == name)
                .where(sweeps.c.started_at >= since, sweeps.c.goal != _PLACEHOLDER_GOAL)
                .order_by(sweeps.c.started_at.desc())
                .limit(1)
            ).scalar_one_or_none()

    def cancelled(self, run_id: str) -> bool:
        with self.db.read() as conn:
            return (
                conn.execute(
                    sa.select(sweeps.c.cancelled_at).where(sweeps.c.run_id == run_id)
                ).scalar_one_or_none()
                is not None
            )

    def trials(self, run_id: str) -> list[dict[str, Any]]:
        """Each trial: its number, parameters, latest metrics, record count, how many NaN and
        infinite values it reported (left out of its records and metrics), final state."""
        with self.db.read() as conn:
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
        with self.db.read() as conn:
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
        with self.db.read() as conn:
            rows = conn.execute(
                sa.select(sweep_outputs.c.name, sweep_outputs.c.media_type)
                .where(sweep_outputs.c.run_id == run_id)
                .order_by(sweep_outputs.c.name)
            ).all()
        return {r.name: r.media_type for r in rows}

    def output(self, run_id: str, name: str) -> tuple[str, bytes] | None:
        with self.db.read() as conn:
            row = conn.execute(
                sa.select(sweep_outputs.c.media_type, sweep_outputs.c.content).where(
                    sweep_outputs.c.run_id == run_id, sweep_outputs.c.name == name
                )
            ).first()
        return None if row is None else (row.media_type, bytes(row.content))

    def version(self, run_id: str) -> tuple[Any, ...]:
        """What changes whenever the sweep's results do (records, trial states, outputs)."""
        with self.db.read() as conn:
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
