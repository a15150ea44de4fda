"""A sweep's results in the ledger's database (`SweepRecords`): on SQLite and PostgreSQL."""

from __future__ import annotations

import math
import struct
import zlib

import pytest

from prefect_gpu_budget.admission.ledger import results
from prefect_gpu_budget.admission.ledger.results import (
    SUMMARY_SEEN,
    SweepRecords,
    final_metrics,
    latest_metrics,
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
    return SweepRecords(ledger)


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
        {"trial": i, "params": p, "metrics": {}, "records": 0, "state": None, "reason": ""}
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
    store.cancel(RUN)
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
    assert sweep["ended_at"] is None and not store.cancelled(RUN)
    assert store.trials(RUN) == [
        {
            "trial": 0,
            "params": {"depth": 4},
            "metrics": {},
            "records": 0,
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
    assert store.add_records(RUN, 1, [{"step": 2, "loss": 1.0, "extra": {"a": [1, "b"]}}]) == 1
    assert store.records(RUN, 1, 0, 100) == [
        {"step": 0, "loss": 3.0},
        {"step": 1, "loss": 2.0},
        {"step": 2, "loss": 1.0, "extra": {"a": [1, "b"]}},
    ]
    trials = store.trials(RUN)
    assert trials[1]["records"] == 3
    assert trials[1]["metrics"] == {"loss": 1.0, "extra": {"a": [1, "b"]}}
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
    monkeypatch.setattr(results, "MAX_RECORDS", 5)
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


def test_nan_and_infinities_become_null(store):
    _open(store)
    kept = store.add_records(
        RUN,
        0,
        [
            {"step": 0, "loss": math.nan, "up": math.inf, "down": -math.inf, "ok": 1.5},
            {"step": 1, "loss": float("nan"), "n": 3},
        ],
    )
    assert kept == 2
    assert store.records(RUN, 0, 0, 10) == [
        {"step": 0, "loss": None, "up": None, "down": None, "ok": 1.5},
        {"step": 1, "loss": None, "n": 3},
    ]
    assert store.trials(RUN)[0]["metrics"] == {"loss": None, "n": 3}


def test_nested_nan_and_infinities_become_null(store):
    _open(store)
    records = [{"step": 0, "loss": 1.0}, {"hist": [math.nan, 1]}, {"val": {"loss": math.inf}}]
    assert store.add_records(RUN, 0, records) == 3
    assert store.records(RUN, 0, 0, 10) == [
        {"step": 0, "loss": 1.0},
        {"hist": [None, 1]},
        {"val": {"loss": None}},
    ]


def test_latest_and_final_metrics():
    records = [
        {"step": 0, "loss": 2.0},
        {"step": 1, "loss": 1.0, "summary": False},
        {"summary": True, "step": 1, "best": 0.5},
        {"step": 2, "loss": 0.1},
    ]
    assert latest_metrics({}, []) == {}
    assert final_metrics([]) == {}
    assert latest_metrics({}, records[:2]) == {"loss": 1.0}
    assert latest_metrics({}, records) == {"best": 0.5, SUMMARY_SEEN: True}
    assert final_metrics(records) == {"best": 0.5}
    # a summary seen in an earlier call holds against later records
    earlier = latest_metrics({}, records[:3])
    assert latest_metrics(earlier, records[3:]) == {"best": 0.5, SUMMARY_SEEN: True}
    # metrics without a summary are replaced
    assert latest_metrics({"loss": 9.0}, [{"acc": 1.0}]) == {"acc": 1.0}


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
    monkeypatch.setattr(results, "MAX_OUTPUT_BYTES", 1000)
    _open(store)
    assert store.put_output(RUN, "plot.png", "image/png", b"p" * 1000)
    assert not store.put_output(RUN, "plot.png", "image/png", b"q" * 1001)
    assert store.output(RUN, "plot.png") == ("image/png", b"p" * 1000)  # the old one stays
    assert not store.put_output(RUN, "big.png", "image/png", b"q" * 1001)
    assert store.outputs(RUN) == {"plot.png": "image/png"}


def test_an_output_at_the_real_bound(store):
    _open(store)
    assert not store.put_output(
        RUN, "big.bin", "application/octet-stream", bytes(results.MAX_OUTPUT_BYTES + 1)
    )
    assert store.outputs(RUN) == {}


def test_cancel_once(store):
    _open(store)
    assert not store.cancelled(RUN)
    assert store.cancel(RUN, now=1234.0) is True
    assert store.cancelled(RUN)
    assert store.cancel(RUN) is False
    assert store.sweep(RUN)["cancelled_at"] == 1234.0
    assert store.cancel(OTHER) is False
    assert not store.cancelled(OTHER)


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
