"""What a sweep keeps of its trials as they run: parameters, every record they report, and
its outputs, in the ledger's database (`SweepRecords`), where the agent gateway reads them.

One thread per sweep reads each running trial's metrics file every `TAP_S` (bounded:
`metrics_file.MetricsTail`) and stores the new records, so an agent sees a learning curve while
the trial runs and can stop it early. Each record is kept as the store keeps it (flat and
small: `trial_records.keep`), in memory too, with each trial's metrics and its count of NaN and
infinite values (left out: they never replace a finite value). A failed write never stops a
sweep: it is logged once.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from functools import partial
from logging import Logger, LoggerAdapter
from pathlib import Path
from typing import Any

from prefect_gpu_budget.admission.ledger.sweep_records import MAX_RECORDS, SweepRecords
from prefect_gpu_budget.admission.ledger.trial_records import (
    flat_records,
    latest_metrics,
    non_finite_count,
    shown_metrics,
)
from prefect_gpu_budget.admission.stopping import stop_sweep
from prefect_gpu_budget.sweeps.metrics_file import MetricsTail
from prefect_gpu_budget.sweeps.spec import SweepSpec

SWEEP_CANCELLED = "its sweep was cancelled"
TAP_S = 1.0
"""How often running trials' metrics files are read."""


class SweepRecorder:
    """Records one sweep's trials (`open` first, `finish` last); the tap thread runs between."""

    def __init__(
        self,
        records: SweepRecords | None,
        run_id: str,
        logger: Logger | LoggerAdapter,
    ) -> None:
        self.records, self.run_id, self.logger = records, run_id, logger
        self.scope = ""
        self._tails: dict[int, MetricsTail] = {}
        self._points: dict[int, list[dict[str, Any]]] = {}
        self._metrics: dict[int, dict[str, Any]] = {}
        self._non_finite: dict[int, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._warned = False
        self._cancelled = False
        self._thread: threading.Thread | None = None

    def open(self, spec: SweepSpec, params: list[Mapping[str, Any]]) -> None:
        self.scope = spec.scope
        self._store(
            "recording the sweep",
            lambda r: r.open_sweep(
                self.run_id, spec.scope, spec.name, spec.metric, spec.goal, params
            ),
        )
        self._thread = threading.Thread(
            target=self._tap, name=f"gpu-budget-sweep-tap-{self.run_id[:8]}", daemon=True
        )
        self._thread.start()

    def watch(self, trial: int, path: Path) -> None:
        """Read this trial's metrics file from now on."""
        with self._lock:
            self._tails[trial] = MetricsTail(path)
            self._points[trial] = []

    def ended(self, trial: int, state: str, reason: str) -> list[dict[str, Any]]:
        """The trial ended: read its file to the end, record its end; its records."""
        with self._lock:
            tail = self._tails.pop(trial, None)
            if tail is not None:
                self._take(trial, tail.read(final=True))
        self._store(
            "recording a trial's end", lambda r: r.end_trial(self.run_id, trial, state, reason)
        )
        return self._points.get(trial, [])

    def metrics(self, trial: int) -> dict[str, Any]:
        """The trial's metrics from all it reported (`trial_records.latest_metrics`)."""
        with self._lock:
            return shown_metrics(self._metrics.get(trial, {}))

    def non_finite(self, trial: int) -> int:
        """How many NaN and infinite values the trial reported (left out of its records)."""
        with self._lock:
            return self._non_finite.get(trial, 0)

    def cancelled(self) -> bool:
        """Whether the sweep was asked to stop (`POST /v1/sweeps/{id}/cancel`)."""
        if self.records is None or self._cancelled:
            return self._cancelled
        try:
            self._cancelled = self.records.cancelled(self.run_id)
        except Exception as exc:
            self._warn("reading whether the sweep was cancelled", exc)
        return self._cancelled

    def finish(self, outputs: Mapping[str, tuple[str, bytes]], message: str) -> None:
        """Stop the tap; keep the sweep's outputs (name -> (media type, content)) and its last
        word."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for name, (media_type, content) in outputs.items():
            self._store(f"keeping {name}", partial(_put, self.run_id, name, media_type, content))
        self._store("recording the sweep's end", lambda r: r.end_sweep(self.run_id, message))

    def _tap(self) -> None:
        while not self._stop.wait(TAP_S):
            with self._lock:
                for trial, tail in list(self._tails.items()):
                    self._take(trial, tail.read())
            if self.cancelled():  # a job asked for just as the sweep was cancelled, say
                self._store(
                    "stopping the sweep's jobs",
                    lambda r: stop_sweep(r.ledger, self.run_id, self.scope, SWEEP_CANCELLED),
                )

    def _take(self, trial: int, new: list[dict[str, Any]]) -> None:
        if not new:
            return
        # the learning curves held here for the plots are kept flat and small, as the store
        # keeps them: they cost no more than the gateway's pages of them
        points = self._points.setdefault(trial, [])
        points.extend(flat_records(new)[: max(0, MAX_RECORDS - len(points))])
        self._metrics[trial] = latest_metrics(self._metrics.get(trial, {}), new)
        self._non_finite[trial] = self._non_finite.get(trial, 0) + non_finite_count(new)
        # all of them, as reported: the store keeps MAX_RECORDS, a late summary still sets the
        # metrics, and a NaN is counted there too
        self._store("recording metrics", lambda r: r.add_records(self.run_id, trial, new))

    def _store(self, what: str, write: Any) -> None:
        if self.records is None:
            return
        try:
            write(self.records)
        except Exception as exc:  # results are worth keeping, never worth a failed sweep
            self._warn(what, exc)

    def _warn(self, what: str, exc: Exception) -> None:
        if not self._warned:
            self._warned = True
            self.logger.warning("sweep results: %s failed: %s", what, type(exc).__name__)


def _put(run_id: str, name: str, media_type: str, content: bytes, records: SweepRecords) -> None:
    records.put_output(run_id, name, media_type, content)
