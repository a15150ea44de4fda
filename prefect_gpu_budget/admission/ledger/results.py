"""A sweep's results in the ledger's database: its trials' parameters and metrics, each
record they reported (learning curves), and its published outputs (results table, summary,
plots). The sweep flow writes them as it goes; the agent gateway reads them, from any host,
with the ledger's credentials and never the worker's files.

A store of its own over the ledger's database (`SweepRecords(ledger)`): none of it takes part
in admission, and none of it is read by the gate.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

import sqlalchemy as sa

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


def _json(value: Any) -> str:
    return json.dumps(value, default=str, allow_nan=False) if value is not None else "null"


def _jsonable(value: Any) -> Any:
    """`value` without NaN or infinities at any depth (JSON has none): they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


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
        """Record a sweep and every trial's parameters, in one transaction (again: replaced)."""
        with self.ledger._tx() as conn:
            for table in (trial_metrics, sweep_trials, sweep_outputs, sweeps):
                conn.execute(table.delete().where(table.c.run_id == run_id))
            conn.execute(
                sweeps.insert().values(
                    run_id=run_id,
                    scope=scope,
                    name=name,
                    metric=metric,
                    goal=goal,
                    trials=len(params),
                    started_at=time.time() if now is None else now,
                    message="",
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
                            "reason": "",
                        }
                        for i, p in enumerate(params)
                    ],
                )

    def add_records(self, run_id: str, trial: int, records: Iterable[Mapping[str, Any]]) -> int:
        """Append a trial's newly reported records (up to MAX_RECORDS in all) and keep its
        latest metrics; returns how many were kept."""
        records = [_jsonable(r) for r in records]
        if not records:
            return 0
        with self.ledger._tx() as conn:
            row = conn.execute(
                sa.select(sweep_trials.c.records, sweep_trials.c.metrics).where(
                    sweep_trials.c.run_id == run_id, sweep_trials.c.trial == trial
                )
            ).first()
            if row is None:
                return 0
            kept = records[: max(0, MAX_RECORDS - row.records)]
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
            metrics = latest_metrics(json.loads(row.metrics or "{}"), records)
            conn.execute(
                sweep_trials.update()
                .where(sweep_trials.c.run_id == run_id, sweep_trials.c.trial == trial)
                .values(records=row.records + len(kept), metrics=_json(metrics))
            )
        return len(kept)

    def end_trial(self, run_id: str, trial: int, state: str, reason: str) -> None:
        with self.ledger._tx() as conn:
            conn.execute(
                sweep_trials.update()
                .where(sweep_trials.c.run_id == run_id, sweep_trials.c.trial == trial)
                .values(state=state[:40], reason=reason)
            )

    def end_sweep(self, run_id: str, message: str, now: float | None = None) -> None:
        with self.ledger._tx() as conn:
            conn.execute(
                sweeps.update()
                .where(sweeps.c.run_id == run_id)
                .values(ended_at=time.time() if now is None else now, message=message)
            )

    def put_output(self, run_id: str, name: str, media_type: str, content: bytes) -> bool:
        """Keep one output of a sweep (replacing one of the same name); False when too big."""
        if len(content) > MAX_OUTPUT_BYTES:
            return False
        with self.ledger._tx() as conn:
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
        """Ask the sweep to start no more trials; False if it is unknown or asked already."""
        with self.ledger._tx() as conn:
            return bool(
                conn.execute(
                    sweeps.update()
                    .where(sweeps.c.run_id == run_id, sweeps.c.cancelled_at.is_(None))
                    .values(cancelled_at=time.time() if now is None else now)
                ).rowcount
            )

    # -- reads (the sweep flow's checks, the gateway) --------------------------------------

    def sweep(self, run_id: str) -> dict[str, Any] | None:
        with self.ledger._read() as conn:
            row = conn.execute(sweeps.select().where(sweeps.c.run_id == run_id)).first()
        return None if row is None else dict(row._mapping)

    def latest(self, scope: str, name: str, since: float) -> str | None:
        """The run id of the newest sweep `name` in `scope` that started at or after `since`."""
        with self.ledger._read() as conn:
            return conn.execute(
                sa.select(sweeps.c.run_id)
                .where(sweeps.c.scope == scope, sweeps.c.name == name)
                .where(sweeps.c.started_at >= since)
                .order_by(sweeps.c.started_at.desc())
                .limit(1)
            ).scalar_one_or_none()

    def cancelled(self, run_id: str) -> bool:
        with self.ledger._read() as conn:
            return (
                conn.execute(
                    sa.select(sweeps.c.cancelled_at).where(sweeps.c.run_id == run_id)
                ).scalar_one_or_none()
                is not None
            )

    def trials(self, run_id: str) -> list[dict[str, Any]]:
        """Each trial: its number, parameters, latest metrics, record count, final state."""
        with self.ledger._read() as conn:
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
                "state": r.state,
                "reason": r.reason,
            }
            for r in rows
        ]

    def records(self, run_id: str, trial: int, offset: int, limit: int) -> list[dict[str, Any]]:
        with self.ledger._read() as conn:
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
        with self.ledger._read() as conn:
            rows = conn.execute(
                sa.select(sweep_outputs.c.name, sweep_outputs.c.media_type)
                .where(sweep_outputs.c.run_id == run_id)
                .order_by(sweep_outputs.c.name)
            ).all()
        return {r.name: r.media_type for r in rows}

    def output(self, run_id: str, name: str) -> tuple[str, bytes] | None:
        with self.ledger._read() as conn:
            row = conn.execute(
                sa.select(sweep_outputs.c.media_type, sweep_outputs.c.content).where(
                    sweep_outputs.c.run_id == run_id, sweep_outputs.c.name == name
                )
            ).first()
        return None if row is None else (row.media_type, bytes(row.content))

    def version(self, run_id: str) -> tuple[Any, ...]:
        """What changes whenever the sweep's results do (records, trial states, outputs)."""
        with self.ledger._read() as conn:
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


def final_metrics(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """A trial's metrics from all its records (`latest_metrics` from none)."""
    return shown_metrics(latest_metrics({}, records))


def latest_metrics(
    metrics: Mapping[str, Any], records: Iterable[Mapping[str, Any]]
) -> dict[str, Any]:
    """A trial's metrics after `records`: its summary (a record with `"summary": true`), else its
    last record, without the `summary` and `step` keys. Once a summary was seen, later
    records that are not summaries do not replace it."""
    current = dict(metrics)
    for record in records:
        if record.get("summary") or not current.get(SUMMARY_SEEN):
            current = {k: v for k, v in record.items() if k not in ("summary", "step")}
            if record.get("summary"):
                current[SUMMARY_SEEN] = True
    return current
