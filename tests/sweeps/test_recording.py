"""`SweepRecorder` over a real ledger (SQLite and PostgreSQL), without a Prefect server: what it
keeps of a trial's records, in memory and in the store, and a cancel that came before it opened."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from prefect_gpu_budget.admission.ledger.sweep_records import SweepRecords
from prefect_gpu_budget.admission.ledger.trial_records import MAX_RECORD_BYTES
from prefect_gpu_budget.sweeps.recording import SweepRecorder
from prefect_gpu_budget.sweeps.spec import SweepSpec

RUN = "33333333-3333-4333-8333-333333333333"
LOG = logging.getLogger("tests.recording")


def _spec() -> SweepSpec:
    return SweepSpec.model_validate(
        {
            "name": "unit",
            "scope": "lab/sweeps/agent-1",
            "job": {"instance_type": "local:box", "max_runtime": "30s"},
            "command": [sys.executable, "-c", "pass", "{lr}"],
            "grid": {"lr": [0.1, 0.2]},
        }
    )


@pytest.fixture
def store(ledger) -> SweepRecords:
    return ledger.sweeps


def test_a_sweep_cancelled_before_it_opens_starts_no_trials(store):
    """The agent cancels while the flow run is still starting: once the flow opens the sweep,
    its recorder says cancelled (the flow then starts no trial)."""
    assert store.cancel(RUN)
    recorder = SweepRecorder(store, RUN, LOG)
    recorder.open(_spec(), [{"lr": 0.1}, {"lr": 0.2}])
    try:
        assert recorder.cancelled()
        assert store.sweep(RUN)["trials"] == 2
    finally:
        recorder.finish({}, "cancelled")
    assert store.cancelled(RUN)


def test_the_recorder_keeps_records_flat_and_small(store, tmp_path):
    """What the flow holds of a trial's records (its plots, its results table) is what the
    store keeps: flat and small, however the trial nested them."""
    metrics = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 0, "loss": 2.0, "hist": [[]] * 15000},
        {"step": 1, "loss": 1.0, "deep": {"a": {"b": {"c": [1, 2]}}}, "tag": "t" * 1000},
        {"summary": True, "loss": 0.5, **{f"s{i}": "x" * 900 for i in range(60)}},  # too big
        {"summary": True, "loss": 0.75},
    ]
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines))
    recorder = SweepRecorder(store, RUN, LOG)
    recorder.open(_spec(), [{"lr": 0.1}])
    try:
        recorder.watch(0, metrics)
        points = recorder.ended(0, "COMPLETED", "")
    finally:
        recorder.finish({}, "done")
    expected = [
        {"step": 0, "loss": 2.0},
        {"step": 1, "loss": 1.0, "tag": "t" * 256},
        {"summary": True, "loss": 0.75},
    ]
    assert points == expected
    assert store.records(RUN, 0, 0, 10) == expected
    assert store.trials(RUN)[0]["metrics"] == {"loss": 0.75}
    assert all(len(json.dumps(p)) <= MAX_RECORD_BYTES for p in points)


def test_a_trial_that_writes_nan_after_a_finite_loss_keeps_the_loss(store, tmp_path):
    """The lines a trial may write that JSON parses as NaN or an infinity: left out of the
    records (the plots' curves), counted, and never the trial's metric, in the flow's memory
    (its results table) as in the store (the gateway)."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        '{"step": 0, "loss": 0.5}\n{"step": 1, "loss": NaN}\n{"step": 2, "loss": 1e999}\n'
        '{"step": 3, "loss": -Infinity}\n'
    )
    recorder = SweepRecorder(store, RUN, LOG)
    recorder.open(_spec(), [{"lr": 0.1}])
    try:
        recorder.watch(0, metrics)
        points = recorder.ended(0, "COMPLETED", "")
    finally:
        recorder.finish({}, "done")
    assert points == [{"step": 0, "loss": 0.5}, {"step": 1}, {"step": 2}, {"step": 3}]
    assert recorder.metrics(0) == {"loss": 0.5} and recorder.non_finite(0) == 3
    [trial] = store.trials(RUN)
    assert trial["metrics"] == {"loss": 0.5} and trial["non_finite_dropped"] == 3
    assert store.records(RUN, 0, 0, 10) == points
