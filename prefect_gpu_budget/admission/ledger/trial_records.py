"""What is kept of a record a trial reported: flat and small (`keep`), and a trial's metrics
after its records (`latest_metrics`). Pure: the sweep store (`sweep_records`) keeps what these
functions leave, and the sweep's recorder reads a trial's metrics with them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from itertools import chain
from typing import Any, NamedTuple

MAX_RECORD_BYTES = 4096
"""Largest record kept, as its JSON (after `flat_record`): a page of 1000 records the gateway
loads stays a few MB of Python objects, whatever the trials wrote."""
MAX_RECORD_KEYS = 64
"""Keys kept per record (the first ones with a scalar value)."""
MAX_KEY_CHARS = 64
"""A longer key is dropped with its value."""
MAX_STR_CHARS = 256
"""A longer string value is cut to this many characters."""
_KEPT_FIRST = ("summary", "step")
"""Keys `flat_record` takes before any other: what `latest_metrics` reads."""
_INT_BOUND = 1 << 63
"""Integers kept: those of a signed 64-bit integer (a bigger one could not even be written as
JSON past 4300 digits)."""


def to_json(value: Any) -> str:
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
    if len(to_json(flat)) > MAX_RECORD_BYTES:
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
    return metrics_after(metrics, map(keep, records))


def metrics_after(metrics: Mapping[str, Any], reported: Iterable[Kept]) -> dict[str, Any]:
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
