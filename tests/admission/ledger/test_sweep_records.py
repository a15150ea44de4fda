"""A sweep's results in the ledger's database (`SweepRecords`): on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import math
import struct
import tracemalloc
import zlib

import pytest
import sqlalchemy as sa

from prefect_gpu_budget.admission.ledger import sweep_records, trial_records
from prefect_gpu_budget.admission.ledger.sweep_records import RESULTS_RETENTION_S, SweepRecords
from prefect_gpu_budget.admission.ledger.tables import (
    sweep_outputs,
    sweep_trials,
    sweeps,
    trial_metrics,
)
from prefect_gpu_budget.admission.ledger.trial_records import (
    MAX_RECORD_BYTES,
    SUMMARY_SEEN,
    flat_record,
    keep,
    latest_metrics,
    non_finite_count,
    shown_metrics,
)

RUN = "11111111-1111-4111-8111-111111111111"
OTHER = "22222222-2222-4222-8222-222222222222"


def _png(width: int = 3, height: int = 2) -> bytes:
    """A real PNG (every byte value appears in it, NULs included)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    rows = b"".join(
        b"\0" + bytes((x * 85 + y) % 256 for x in range(width * 3)) for y in range(height)
    )
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"tEXt", b"all bytes\0" + bytes(range(256)))
        + chunk(b"IEND", b"")
    )


@pytest.fixture
def store(ledger) -> SweepRecords:
    return ledger.sweeps


def _open(store: SweepRecords, run_id: str = RUN, params=None, **kw) -> None:
    params = [{"lr": 0.1}, {"lr": 0.01}, {"lr": 0.001}] if params is None else params
    store.open_sweep(run_id, "team/sweeps", "lr-search", "val_loss", "min", params, **kw)


def test_open_sweep_records_every_trial(store):
    _open(store, now=1000.0)
    sweep = store.sweep(RUN)
    assert sweep is not None
    assert {k: sweep[k] for k in ("scope", "name", "metric", "goal", "trials")} == {
        "scope": "team/sweeps",
        "name": "lr-search",
        "metric": "val_loss",
        "goal": "min",
        "trials": 3,
    }
    assert sweep["started_at"] == 1000.0
    assert sweep["ended_at"] is None and sweep["cancelled_at"] is None
    assert store.trials(RUN) == [
        {
            "trial": i,
            "params": p,
            "metrics": {},
            "records": 0,
            "non_finite_dropped": 0,
            "state": None,
            "reason": "",
        }
        for i, p in enumerate([{"lr": 0.1}, {"lr": 0.01}, {"lr": 0.001}])
    ]
    assert store.sweep(OTHER) is None and store.trials(OTHER) == []


def test_a_sweep_with_no_trials(store):
    _open(store, params=[])
    assert store.sweep(RUN)["trials"] == 0
    assert store.trials(RUN) == []


def test_reopening_a_sweep_replaces_it(store):
    _open(store)
    store.add_records(RUN, 0, [{"step": 0, "val_loss": 1.0}])
    store.end_trial(RUN, 0, "COMPLETED", "")
    store.put_output(RUN, "results.json", "application/json", b"[]")
    store.cancel(RUN, now=1500.0)
    store.end_sweep(RUN, "done")
    store.open_sweep(RUN, "team/other", "again", "acc", "max", [{"depth": 4}], now=2000.0)
    sweep = store.sweep(RUN)
    assert (sweep["scope"], sweep["name"], sweep["metric"], sweep["goal"]) == (
        "team/other",
        "again",
        "acc",
        "max",
    )
    assert (sweep["trials"], sweep["started_at"], sweep["message"]) == (1, 2000.0, "")
    assert sweep["ended_at"] is None
    # a cancelled sweep stays cancelled: its flow run again must not start its trials
    assert store.cancelled(RUN) and sweep["cancelled_at"] == 1500.0
    assert store.trials(RUN) == [
        {
            "trial": 0,
            "params": {"depth": 4},
            "metrics": {},
            "records": 0,
            "non_finite_dropped": 0,
            "state": None,
            "reason": "",
        }
    ]
    assert store.records(RUN, 0, 0, 100) == []
    assert store.outputs(RUN) == {}
    assert store.output(RUN, "results.json") is None


def test_records_keep_their_order_across_calls(store):
    _open(store)
    assert store.add_records(RUN, 1, [{"step": 0, "loss": 3.0}, {"step": 1, "loss": 2.0}]) == 2
    assert store.add_records(RUN, 1, []) == 0
    assert store.add_records(RUN, 1, [{"step": 2, "loss": 1.0, "note": "ok"}]) == 1
    assert store.records(RUN, 1, 0, 100) == [
        {"step": 0, "loss": 3.0},
        {"step": 1, "loss": 2.0},
        {"step": 2, "loss": 1.0, "note": "ok"},
    ]
    trials = store.trials(RUN)
    assert trials[1]["records"] == 3
    assert trials[1]["metrics"] == {"loss": 1.0, "note": "ok"}
    assert trials[0]["records"] == 0 and store.records(RUN, 0, 0, 100) == []


def test_records_of_an_unknown_trial_are_not_kept(store):
    _open(store)
    assert store.add_records(RUN, 7, [{"loss": 1.0}]) == 0
    assert store.add_records(OTHER, 0, [{"loss": 1.0}]) == 0
    assert store.records(RUN, 7, 0, 10) == [] and store.records(OTHER, 0, 0, 10) == []


def test_records_page_by_offset_and_limit(store):
    _open(store)
    store.add_records(RUN, 0, [{"step": i} for i in range(10)])
    assert store.records(RUN, 0, 0, 3) == [{"step": 0}, {"step": 1}, {"step": 2}]
    assert store.records(RUN, 0, 3, 3) == [{"step": 3}, {"step": 4}, {"step": 5}]
    assert store.records(RUN, 0, 8, 5) == [{"step": 8}, {"step": 9}]
    assert store.records(RUN, 0, 10, 5) == []
    assert store.records(RUN, 0, 0, 0) == []
    pages = [store.records(RUN, 0, o, 4) for o in range(0, 10, 4)]
    assert [r for page in pages for r in page] == [{"step": i} for i in range(10)]


def test_records_past_the_cap_are_dropped_but_still_update_metrics(store, monkeypatch):
    monkeypatch.setattr(sweep_records, "MAX_RECORDS", 5)
    _open(store)
    assert store.add_records(RUN, 0, [{"step": i, "loss": 10.0 - i} for i in range(3)]) == 3
    assert store.add_records(RUN, 0, [{"step": i, "loss": 10.0 - i} for i in range(3, 7)]) == 2
    assert store.add_records(RUN, 0, [{"step": 7, "loss": 3.0}]) == 0
    assert store.records(RUN, 0, 0, 100) == [{"step": i, "loss": 10.0 - i} for i in range(5)]
    trial = store.trials(RUN)[0]
    assert trial["records"] == 5
    # the latest metrics follow what was reported, kept or not
    assert trial["metrics"] == {"loss": 3.0}
    store.add_records(RUN, 0, [{"summary": True, "loss": 2.5}])
    assert store.trials(RUN)[0]["metrics"] == {"loss": 2.5}
    assert store.trials(RUN)[0]["records"] == 5


def test_metrics_are_the_last_record_until_a_summary(store):
    _open(store)
    store.add_records(RUN, 0, [{"step": 0, "loss": 2.0, "acc": 0.1}])
    assert store.trials(RUN)[0]["metrics"] == {"loss": 2.0, "acc": 0.1}
    store.add_records(RUN, 0, [{"step": 1, "loss": 1.0}])  # replaces, keys and all
    assert store.trials(RUN)[0]["metrics"] == {"loss": 1.0}
    store.add_records(RUN, 0, [{"summary": True, "best_loss": 0.9, "step": 1}, {"step": 2}])
    assert store.trials(RUN)[0]["metrics"] == {"best_loss": 0.9}
    store.add_records(RUN, 0, [{"step": 3, "loss": 0.1}])  # after the summary: no change
    assert store.trials(RUN)[0]["metrics"] == {"best_loss": 0.9}
    store.add_records(RUN, 0, [{"summary": True, "best_loss": 0.05}])  # a newer summary
    trial = store.trials(RUN)[0]
    assert trial["metrics"] == {"best_loss": 0.05}
    assert SUMMARY_SEEN not in trial["metrics"]
    assert trial["records"] == 6
    assert store.records(RUN, 0, 2, 2) == [
        {"summary": True, "best_loss": 0.9, "step": 1},
        {"step": 2},
    ]


def test_a_summary_in_the_first_call_wins_over_later_records(store):
    _open(store)
    store.add_records(RUN, 2, [{"summary": True, "acc": 0.9}])
    store.add_records(RUN, 2, [{"step": 10, "acc": 0.1}])
    store.add_records(RUN, 2, [{"summary": False, "acc": 0.2}])
    assert store.trials(RUN)[2]["metrics"] == {"acc": 0.9}


def test_nan_and_infinities_are_left_out_and_counted(store):
    _open(store)
    kept = store.add_records(
        RUN,
        0,
        [
            {"step": 0, "loss": 2.0, "up": 1.0},
            {"step": 1, "loss": math.nan, "up": math.inf, "down": -math.inf, "ok": 1.5},
            {"step": 2, "loss": float("nan"), "n": 3},
        ],
    )
    assert kept == 3
    assert store.records(RUN, 0, 0, 10) == [
        {"step": 0, "loss": 2.0, "up": 1.0},
        {"step": 1, "ok": 1.5},
        {"step": 2, "n": 3},
    ]
    trial = store.trials(RUN)[0]
    # the last record's metrics, its non-finite loss keeping the finite one it replaced
    assert trial["metrics"] == {"loss": 2.0, "n": 3}
    assert trial["non_finite_dropped"] == 4


def test_a_metric_written_as_nan_or_infinity_never_erases_a_finite_one(store):
    """What JSON lets a trial write (`NaN`, `Infinity`, `-Infinity`, `1e999`), in records and
    in summaries, in calls of their own: the trial's metric stays its last finite value."""
    _open(store)
    store.add_records(RUN, 0, json.loads('[{"step": 0, "val_loss": 0.25}]'))
    for line in ("NaN", "1e999", "-Infinity", "Infinity"):
        store.add_records(RUN, 0, [json.loads(f'{{"step": 1, "val_loss": {line}}}')])
    store.add_records(RUN, 0, [json.loads('{"summary": true, "val_loss": NaN, "acc": 0.5}')])
    trial = store.trials(RUN)[0]
    assert trial["metrics"] == {"val_loss": 0.25, "acc": 0.5}
    assert trial["non_finite_dropped"] == 5
    assert trial["records"] == 6
    assert all("val_loss" not in r for r in store.records(RUN, 0, 1, 10))
    # a later finite value still replaces it
    store.add_records(RUN, 0, [{"summary": True, "val_loss": 0.2}])
    assert store.trials(RUN)[0]["metrics"] == {"val_loss": 0.2}


def test_non_finite_values_past_the_kept_records_still_count(store, monkeypatch):
    monkeypatch.setattr(sweep_records, "MAX_RECORDS", 2)
    _open(store)
    store.add_records(RUN, 1, [{"step": i, "loss": 1.0 / (i + 1)} for i in range(3)])
    assert store.add_records(RUN, 1, [{"step": 3, "loss": math.inf}, {"step": 4}]) == 0
    trial = store.trials(RUN)[1]
    assert trial["records"] == 2 and trial["non_finite_dropped"] == 1
    assert trial["metrics"] == {}  # the last record reported had no loss


def test_a_row_an_earlier_version_made_counts_no_dropped_values(store):
    _open(store)
    with store.db.tx() as conn:
        conn.execute(sweep_trials.update().values(non_finite=None))
    assert [t["non_finite_dropped"] for t in store.trials(RUN)] == [0, 0, 0]
    store.add_records(RUN, 0, [{"loss": math.nan}])
    assert store.trials(RUN)[0]["non_finite_dropped"] == 1


def test_nested_values_are_dropped(store):
    _open(store)
    records = [
        {"step": 0, "loss": 1.0},
        {"hist": [math.nan, 1], "n": 2},
        {"val": {"loss": math.inf}, "step": 1},
    ]
    assert store.add_records(RUN, 0, records) == 3
    assert store.records(RUN, 0, 0, 10) == [{"step": 0, "loss": 1.0}, {"n": 2}, {"step": 1}]
    assert store.trials(RUN)[0]["metrics"] == {}


def test_flat_record():
    assert flat_record({}) == {}
    assert flat_record({"step": 3, "loss": 0.5, "ok": True, "none": None, "tag": "a"}) == {
        "step": 3,
        "loss": 0.5,
        "ok": True,
        "none": None,
        "tag": "a",
    }
    # nested values go, non-finite floats go (`keep` names them), long strings are cut
    hostile = {"a": [[], []], "b": {"c": 1}, "t": (1,), "nan": math.nan, "inf": -math.inf}
    assert flat_record(hostile) == {}
    assert keep(hostile) == ({}, ("nan", "inf"))
    assert keep({"s": "x" * 1000, "big": 1e999}).non_finite == ("big",)
    assert flat_record({"s": "x" * 1000}) == {"s": "x" * trial_records.MAX_STR_CHARS}
    # keys: strings of at most MAX_KEY_CHARS, at most MAX_RECORD_KEYS of them
    assert flat_record({"k" * 65: 1, "k" * 64: 2, 7: 3}) == {"k" * 64: 2, "7": 3}
    many = flat_record({f"m{i}": i for i in range(200)})
    assert many == {f"m{i}": i for i in range(trial_records.MAX_RECORD_KEYS)}
    # however many keys come first, `summary` and `step` are kept
    late = flat_record({**{f"m{i}": i for i in range(200)}, "summary": True, "step": 9})
    assert late is not None and len(late) == trial_records.MAX_RECORD_KEYS
    assert late["summary"] is True and late["step"] == 9
    # integers past 64 bits go (JSON could not even hold some)
    assert flat_record({"big": 10**30, "small": -(2**63), "n": 2**63 - 1}) == {
        "small": -(2**63),
        "n": 2**63 - 1,
    }
    # still over MAX_RECORD_BYTES: dropped whole
    wide = {f"s{i}": "\u2603" * 256 for i in range(64)}
    assert flat_record(wide) is None
    assert keep({**wide, "nan": math.nan}) == (None, ())  # dropped whole: nothing counted
    assert flat_record([1, 2]) is None  # type: ignore[arg-type]
    # twice is once
    for record in ({"a": [1], "b": "y" * 999, "c": math.nan}, late, many):
        once = flat_record(record)
        assert flat_record(once) == once and keep(once).non_finite == ()


def _hostile_records() -> list[dict]:
    """Records a trial may write within the metrics file's 64 KiB a line, that cost ~50 times
    that as Python objects, or nest as deep as JSON parses."""
    lists = json.loads('{"step": 1, "a": [' + ",".join(["[]"] * 20000) + "]}")
    deep: dict = {"x": 1}
    for _ in range(500):
        deep = {"d": deep}
    deep["step"] = 2
    strings = {"step": 3, **{f"s{i}": "q" * 1000 for i in range(60)}}
    keys = {"step": 4, **{"k" * 70 + str(i): i for i in range(500)}}
    return [lists, deep, strings, keys]


def test_records_are_kept_flat_and_small(store):
    _open(store)
    store.add_records(RUN, 0, _hostile_records())
    kept = store.records(RUN, 0, 0, 10)
    assert kept == [{"step": 1}, {"step": 2}, {"step": 4}]  # the strings were still too big
    for record in kept:
        assert len(json.dumps(record)) <= MAX_RECORD_BYTES
        assert all(not isinstance(v, (list, dict)) for v in record.values())
    assert store.trials(RUN)[0]["metrics"] == {}


def test_a_page_of_the_largest_records_stays_small(store):
    """A page of 1000 records, loaded as the gateway loads it, is a few MB of Python objects:
    the largest records kept, and nested ones a trial wrote (64 KiB lines, ~50x that loaded)."""
    _open(store)
    widest = {f"validation_metric_{i:02d}": 1 + i / 7 for i in range(trial_records.MAX_RECORD_KEYS)}
    record = flat_record(widest)
    assert record is not None and len(json.dumps(record)) > MAX_RECORD_BYTES // 2
    nested = _hostile_records()[0]
    store.add_records(RUN, 0, [nested] * 40 + [record] * 960)
    tracemalloc.start()
    try:
        page = store.records(RUN, 0, 0, 1000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(page) == 1000
    assert peak < 16 << 20, f"{peak / 2**20:.1f} MiB"


def test_latest_metrics():
    records = [
        {"step": 0, "loss": 2.0},
        {"step": 1, "loss": 1.0, "summary": False},
        {"summary": True, "step": 1, "best": 0.5},
        {"step": 2, "loss": 0.1},
    ]
    assert latest_metrics({}, []) == {}
    assert latest_metrics({}, records[:2]) == {"loss": 1.0}
    assert latest_metrics({}, records) == {"best": 0.5, SUMMARY_SEEN: True}
    assert shown_metrics(latest_metrics({}, records)) == {"best": 0.5}
    # a summary seen in an earlier call holds against later records
    earlier = latest_metrics({}, records[:3])
    assert latest_metrics(earlier, records[3:]) == {"best": 0.5, SUMMARY_SEEN: True}
    # metrics without a summary are replaced
    assert latest_metrics({"loss": 9.0}, [{"acc": 1.0}]) == {"acc": 1.0}
    # records dropped whole change nothing
    assert latest_metrics({"loss": 9.0}, [{f"s{i}": "\u2603" * 256 for i in range(64)}]) == {
        "loss": 9.0
    }


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, float("1e999")])
def test_a_non_finite_value_keeps_the_finite_value_it_would_replace(bad):
    assert latest_metrics({"loss": 0.5, "acc": 0.1}, [{"step": 3, "loss": bad}]) == {"loss": 0.5}
    assert latest_metrics({}, [{"loss": bad}]) == {}  # nothing to keep: none
    assert latest_metrics({"loss": 0.5}, [{"summary": True, "loss": bad, "acc": 0.9}]) == {
        "loss": 0.5,
        "acc": 0.9,
        SUMMARY_SEEN: True,
    }
    # after a summary, a later summary's non-finite value keeps the summary's
    done = latest_metrics({}, [{"summary": True, "loss": 0.4}])
    assert latest_metrics(done, [{"summary": True, "loss": bad}]) == done
    assert non_finite_count([{"loss": bad, "up": bad}, {"step": 1}, {"x": [bad]}]) == 2


def test_end_trial_and_end_sweep(store):
    _open(store)
    store.end_trial(RUN, 0, "COMPLETED", "")
    store.end_trial(RUN, 2, "FAILED", "exit code 3: out of memory")
    states = [(t["state"], t["reason"]) for t in store.trials(RUN)]
    assert states == [("COMPLETED", ""), (None, ""), ("FAILED", "exit code 3: out of memory")]
    store.end_sweep(RUN, "2 of 3 trials ended; best lr=0.1", now=5000.0)
    sweep = store.sweep(RUN)
    assert sweep["ended_at"] == 5000.0
    assert sweep["message"] == "2 of 3 trials ended; best lr=0.1"


def test_outputs_round_trip(store):
    _open(store)
    png = _png()
    assert store.put_output(RUN, "curves.png", "image/png", png)
    assert store.put_output(RUN, "summary.md", "text/markdown", "# Best: lr=0.1 ✓\n".encode())
    assert store.put_output(RUN, "empty.json", "application/json", b"")
    assert store.outputs(RUN) == {
        "curves.png": "image/png",
        "empty.json": "application/json",
        "summary.md": "text/markdown",
    }
    media_type, content = store.output(RUN, "curves.png")
    assert media_type == "image/png" and type(content) is bytes and content == png
    assert store.output(RUN, "summary.md") == ("text/markdown", "# Best: lr=0.1 ✓\n".encode())
    assert store.output(RUN, "empty.json") == ("application/json", b"")
    assert store.output(RUN, "missing.png") is None
    # the same name again replaces it
    assert store.put_output(RUN, "curves.png", "image/png", _png(5, 5))
    assert store.output(RUN, "curves.png") == ("image/png", _png(5, 5))
    assert len(store.outputs(RUN)) == 3


def test_an_output_over_the_bound_is_refused(store, monkeypatch):
    monkeypatch.setattr(sweep_records, "MAX_OUTPUT_BYTES", 1000)
    _open(store)
    assert store.put_output(RUN, "plot.png", "image/png", b"p" * 1000)
    assert not store.put_output(RUN, "plot.png", "image/png", b"q" * 1001)
    assert store.output(RUN, "plot.png") == ("image/png", b"p" * 1000)  # the old one stays
    assert not store.put_output(RUN, "big.png", "image/png", b"q" * 1001)
    assert store.outputs(RUN) == {"plot.png": "image/png"}


def test_an_output_at_the_real_bound(store):
    _open(store)
    assert not store.put_output(
        RUN, "big.bin", "application/octet-stream", bytes(sweep_records.MAX_OUTPUT_BYTES + 1)
    )
    assert store.outputs(RUN) == {}


def test_cancel_once(store):
    _open(store)
    assert not store.cancelled(RUN)
    assert store.cancel(RUN, now=1234.0) is True
    assert store.cancelled(RUN)
    assert store.cancel(RUN) is False
    assert store.sweep(RUN)["cancelled_at"] == 1234.0
    assert not store.cancelled(OTHER)


def test_a_sweep_cancelled_before_it_opens_stays_cancelled(store):
    assert store.cancel(RUN, now=1000.0) is True
    assert store.cancel(RUN, now=1001.0) is False  # asked already
    assert store.cancelled(RUN)
    # not opened yet: the gateway's "has the flow started?" check still says no
    assert store.sweep(RUN) is None and not store.started(RUN)
    assert store.trials(RUN) == [] and store.latest("", "", 0) is None
    _open(store, now=1100.0)
    assert store.cancelled(RUN)
    assert store.started(RUN)
    sweep = store.sweep(RUN)
    assert (sweep["scope"], sweep["name"], sweep["goal"], sweep["trials"]) == (
        "team/sweeps",
        "lr-search",
        "min",
        3,
    )
    assert (sweep["started_at"], sweep["cancelled_at"]) == (1100.0, 1000.0)
    assert store.latest("team/sweeps", "lr-search", 0) == RUN
    assert store.cancel(RUN) is False
    assert not store.cancelled(OTHER)


def _rows(store: SweepRecords, run_id: str) -> dict[str, int]:
    with store.db.read() as conn:
        return {
            t.name: conn.execute(
                sa.select(sa.func.count()).select_from(t).where(t.c.run_id == run_id)
            ).scalar_one()
            for t in (sweeps, sweep_trials, trial_metrics, sweep_outputs)
        }


def _full(store: SweepRecords, run_id: str, started: float, ended: float | None) -> None:
    _open(store, run_id, params=[{"lr": 1}, {"lr": 2}], now=started)
    store.add_records(run_id, 0, [{"step": 0}, {"step": 1}])
    store.put_output(run_id, "results.json", "application/json", b"[]")
    if ended is not None:
        store.end_sweep(run_id, "done", now=ended)


ALL = {"gpu_sweeps": 1, "gpu_sweep_trials": 2, "gpu_trial_metrics": 2, "gpu_sweep_outputs": 1}
NONE = dict.fromkeys(ALL, 0)


def test_prune_deletes_the_results_of_old_sweeps(store):
    third = "33333333-3333-4333-8333-333333333333"
    _full(store, RUN, started=1000.0, ended=2000.0)
    _full(store, OTHER, started=1000.0, ended=None)  # never ended: its start counts
    _full(store, third, started=1000.0, ended=5000.0)
    assert store.prune(1000.0) == 0
    assert store.prune(1500.0) == 1  # OTHER: started at 1000, never ended
    assert _rows(store, OTHER) == NONE
    assert _rows(store, RUN) == ALL and _rows(store, third) == ALL
    assert store.prune(2000.0) == 0  # RUN ended at 2000: not before it
    assert store.prune(2000.5) == 1
    assert _rows(store, RUN) == NONE and _rows(store, third) == ALL
    assert store.sweep(RUN) is None and store.records(RUN, 0, 0, 10) == []
    assert store.prune(5001.0) == 1
    assert _rows(store, third) == NONE
    assert store.prune(1e12) == 0


def test_prune_many_sweeps_at_once(store, monkeypatch):
    monkeypatch.setattr(sweep_records, "_PRUNE_BATCH", 2)
    runs = [f"{i:08d}-0000-4000-8000-000000000000" for i in range(5)]
    for i, run in enumerate(runs):
        _full(store, run, started=1000.0 + i, ended=None if i % 2 else 2000.0 + i)
    assert store.prune(2003.5) == 4
    assert [_rows(store, run) == NONE for run in runs] == [True] * 4 + [False]
    assert _rows(store, runs[4]) == ALL


def test_opening_a_sweep_prunes_those_past_the_retention(store):
    _full(store, RUN, started=1000.0, ended=2000.0)
    assert store.cancel(OTHER, now=1500.0)  # a placeholder, never opened, goes too
    _open(store, "33333333-3333-4333-8333-333333333333", now=2000.0 + RESULTS_RETENTION_S)
    assert _rows(store, RUN) == ALL  # ended exactly RESULTS_RETENTION_S ago: kept
    assert _rows(store, OTHER) == NONE
    _open(store, "44444444-4444-4444-8444-444444444444", now=2001.0 + RESULTS_RETENTION_S)
    assert _rows(store, RUN) == NONE
    assert store.sweep("33333333-3333-4333-8333-333333333333") is not None


def test_version_changes_with_the_results(store):
    _open(store)
    seen = [store.version(RUN)]

    def changed() -> None:
        now = store.version(RUN)
        assert now not in seen, f"{now} seen already"
        seen.append(now)

    assert store.version(RUN) == seen[0]  # reading changes nothing
    store.add_records(RUN, 0, [{"step": 0}])
    changed()
    store.add_records(RUN, 1, [{"step": 0}, {"step": 1}])
    changed()
    store.end_trial(RUN, 0, "COMPLETED", "")
    changed()
    store.put_output(RUN, "results.json", "application/json", b"[]")
    changed()
    store.cancel(RUN)
    changed()
    store.end_sweep(RUN, "done")
    changed()
    assert store.version(RUN) == seen[-1]
    store.add_records(OTHER, 0, [{"step": 0}])  # another sweep's (unknown) trial
    store.cancel(OTHER)  # another sweep's placeholder
    assert store.version(RUN) == seen[-1]


def test_sweeps_do_not_see_each_others_results(store):
    _open(store, RUN, params=[{"lr": 1}])
    _open(store, OTHER, params=[{"lr": 2}, {"lr": 3}])
    store.add_records(RUN, 0, [{"step": 0, "mine": True}])
    store.add_records(OTHER, 0, [{"step": 0, "theirs": True}, {"step": 1}])
    store.put_output(RUN, "a.png", "image/png", b"A")
    store.put_output(OTHER, "a.png", "image/png", b"B")
    store.end_trial(OTHER, 0, "FAILED", "theirs")
    store.cancel(OTHER)
    store.end_sweep(OTHER, "theirs")
    assert store.records(RUN, 0, 0, 10) == [{"step": 0, "mine": True}]
    assert store.records(OTHER, 0, 0, 10) == [{"step": 0, "theirs": True}, {"step": 1}]
    assert store.trials(RUN) == [
        {
            "trial": 0,
            "params": {"lr": 1},
            "metrics": {"mine": True},
            "records": 1,
            "non_finite_dropped": 0,
            "state": None,
            "reason": "",
        }
    ]
    assert [t["params"] for t in store.trials(OTHER)] == [{"lr": 2}, {"lr": 3}]
    assert store.output(RUN, "a.png") == ("image/png", b"A")
    assert store.output(OTHER, "a.png") == ("image/png", b"B")
    assert not store.cancelled(RUN) and store.cancelled(OTHER)
    assert store.sweep(RUN)["ended_at"] is None and store.sweep(RUN)["message"] == ""
    before = store.version(RUN)
    _open(store, OTHER, params=[{"lr": 4}])  # re-opening one leaves the other be
    assert store.version(RUN) == before
    assert store.records(RUN, 0, 0, 10) == [{"step": 0, "mine": True}]
    assert store.outputs(RUN) == {"a.png": "image/png"}
    assert store.outputs(OTHER) == {}


def test_cancel_without_returning(tmp_path, monkeypatch):
    """A SQLite before 3.35 (no RETURNING): `cancel` counts the rows its upsert wrote."""
    from prefect_gpu_budget.admission.ledger import Ledger

    led = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    try:
        monkeypatch.setattr(led.db.engine.dialect, "insert_returning", False)
        store = led.sweeps
        assert store.cancel(RUN, now=1000.0) is True and store.cancel(RUN) is False
        _open(store, OTHER, now=1000.0)
        assert store.cancel(OTHER, now=2000.0) is True and store.cancel(OTHER) is False
        assert store.cancelled(RUN) and store.sweep(OTHER)["cancelled_at"] == 2000.0
    finally:
        led.db.dispose()
