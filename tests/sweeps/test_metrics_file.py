"""A trial's metrics file read as it grows (`MetricsTail`, `read_all`): real files, each read
within its bounds (line length, file length, memory)."""

from __future__ import annotations

import contextlib
import json
import os
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefect_gpu_budget.sweeps import metrics_file
from prefect_gpu_budget.sweeps.metrics_file import MetricsTail, read_all

BIG_LINE_BYTES = 100 << 20
"""The over-long line the memory tests write: far past MAX_LINE_BYTES and CHUNK_BYTES."""
MEMORY_BOUND = 8 << 20
"""What one read of any file may allocate at its peak."""


def _append(path: Path, data: bytes | str) -> None:
    with open(path, "ab") as out:
        out.write(data.encode() if isinstance(data, str) else data)


def _line(record: object) -> str:
    return json.dumps(record) + "\n"


def test_records_appended_between_reads_come_once_each_in_order(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    _append(path, _line({"step": 0, "loss": 1.0}) + _line({"step": 1, "loss": 0.5}))
    assert tail.read() == [{"step": 0, "loss": 1.0}, {"step": 1, "loss": 0.5}]
    assert tail.read() == []
    _append(path, _line({"step": 2, "loss": 0.25}))
    _append(path, _line({"step": 3, "loss": 0.125}))
    assert tail.read() == [{"step": 2, "loss": 0.25}, {"step": 3, "loss": 0.125}]
    assert tail.read() == []
    assert tail.read(final=True) == []
    assert tail.skipped == 0
    assert tail.offset == path.stat().st_size


def test_a_partial_last_line_waits_for_its_newline(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    _append(path, _line({"step": 0}) + '{"step": 1, "lo')
    assert tail.read() == [{"step": 0}]
    assert tail.read() == []  # still no newline
    _append(path, 'ss": 0.5}')
    assert tail.read() == []
    _append(path, "\n" + '{"step": 2}')
    assert tail.read() == [{"step": 1, "loss": 0.5}]
    _append(path, "\n")
    assert tail.read() == [{"step": 2}]
    assert tail.read(final=True) == []
    assert tail.skipped == 0


def test_final_returns_a_last_line_without_its_newline_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    _append(path, _line({"step": 0}) + '{"summary": true, "acc": 0.9}')
    assert tail.read() == [{"step": 0}]
    assert tail.read(final=True) == [{"summary": True, "acc": 0.9}]
    assert tail.read(final=True) == []
    assert read_all(path) == [{"step": 0}, {"summary": True, "acc": 0.9}]


def test_a_partial_line_that_is_no_json_is_skipped_when_final(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _append(path, _line({"a": 1}) + '{"b": 2')
    tail = MetricsTail(path)
    assert tail.read(final=True) == [{"a": 1}]
    assert tail.skipped == 1


def test_lines_that_are_not_json_objects_are_skipped_and_counted(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        _line({"a": 1}),
        "not json\n",
        "\n",  # empty: skipped, not counted
        "   \t \n",  # blank: skipped, not counted
        "[1, 2, 3]\n",
        "42\n",
        '"a string"\n',
        "null\n",
        "{broken\n",
        "\xff\xfe garbage\n",
        "[" * 50_000 + "\n",  # deeper than the parser recurses, yet short: not JSON
        _line({"b": 2}),
        "\r\n",  # a Windows blank line
        _line({"c": {"nested": [1, 2]}}),
    ]
    _append(path, "".join(lines[:-1]).encode("utf-8", "surrogateescape"))
    _append(path, b"\xff\xfe\x00\x01\n")  # bytes that are no UTF-8
    _append(path, lines[-1])
    tail = MetricsTail(path)
    assert tail.read() == [{"a": 1}, {"b": 2}, {"c": {"nested": [1, 2]}}]
    assert tail.skipped == 9


def test_a_missing_file_has_no_records(tmp_path):
    path = tmp_path / "not-yet.jsonl"
    tail = MetricsTail(path)
    assert tail.read() == []
    assert tail.read(final=True) == []
    assert read_all(path) == []
    assert tail.offset == 0 and tail.skipped == 0
    _append(path, _line({"late": True}))  # the job creates it later
    assert tail.read() == [{"late": True}]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_folder_in_place_of_the_file_has_no_records(tmp_path):
    assert MetricsTail(tmp_path).read(final=True) == []


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_reading_a_folder_leaks_no_descriptor(tmp_path):
    tail = MetricsTail(tmp_path)
    before = _open_fds()
    for _ in range(5):
        with contextlib.suppress(OSError):
            tail.read()
    assert _open_fds() == before


def test_a_fifo_in_place_of_the_file_has_no_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    os.mkfifo(path)
    assert MetricsTail(path).read(final=True) == []


def test_records_split_across_chunks_are_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics_file, "CHUNK_BYTES", 7)
    path = tmp_path / "metrics.jsonl"
    records = [{"step": i, "loss": 1 / (i + 1), "tag": "x" * i} for i in range(40)]
    _append(path, "".join(map(_line, records)))
    assert read_all(path) == records


def test_a_line_longer_than_the_bound_is_skipped_across_reads(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics_file, "MAX_LINE_BYTES", 32)
    monkeypatch.setattr(metrics_file, "CHUNK_BYTES", 10)
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    _append(path, _line({"a": 1}) + '{"long": "' + "y" * 50)
    assert tail.read() == [{"a": 1}]
    assert tail.skipped == 1  # known too long already
    _append(path, "z" * 100)
    assert tail.read() == []
    _append(path, '"}\n' + _line({"b": 2}))
    assert tail.read() == [{"b": 2}]
    _append(path, '{"also_long": "' + "w" * 40 + '"}\n' + _line({"c": 3}))
    assert tail.read() == [{"c": 3}]
    assert tail.skipped == 2


def test_an_unfinished_overlong_line_is_not_returned_when_final(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics_file, "MAX_LINE_BYTES", 16)
    path = tmp_path / "metrics.jsonl"
    _append(path, _line({"a": 1}) + '{"x": "' + "y" * 40 + '"}')
    tail = MetricsTail(path)
    assert tail.read(final=True) == [{"a": 1}]
    assert tail.skipped == 1


def test_a_line_exactly_at_the_bound_is_kept(tmp_path, monkeypatch):
    record = {"k": "v" * 20}
    line = json.dumps(record).encode()
    monkeypatch.setattr(metrics_file, "MAX_LINE_BYTES", len(line))
    monkeypatch.setattr(metrics_file, "CHUNK_BYTES", 5)
    path = tmp_path / "metrics.jsonl"
    _append(path, line + b"\n" + line + b"x\n" + line)
    tail = MetricsTail(path)
    assert tail.read() == [record]
    assert tail.read(final=True) == [record]
    assert tail.skipped == 1


def test_nothing_past_the_file_bound_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics_file, "MAX_FILE_BYTES", 64)
    monkeypatch.setattr(metrics_file, "CHUNK_BYTES", 10)
    path = tmp_path / "metrics.jsonl"
    first = _line({"i": 0, "pad": "a" * 12})  # 32 bytes
    assert len(first) == 32
    _append(path, first * 2)  # exactly the bound
    tail = MetricsTail(path)
    assert tail.read() == [json.loads(first)] * 2
    assert tail.offset == 64
    _append(path, _line({"past": "the bound"}) * 3)
    assert tail.read() == []
    assert tail.read(final=True) == []
    assert tail.offset == 64
    assert read_all(path) == [json.loads(first)] * 2


def test_a_record_across_the_file_bound_is_not_returned(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics_file, "MAX_FILE_BYTES", 40)
    path = tmp_path / "metrics.jsonl"
    _append(path, _line({"i": 0}) + _line({"i": 1, "pad": "p" * 30}) + _line({"i": 2}))
    tail = MetricsTail(path)
    assert tail.read() == [{"i": 0}]
    assert tail.read(final=True) == []  # its first 30-odd bytes are no record
    assert tail.offset == 40
    assert tail.skipped == 1


@pytest.fixture(scope="module")
def huge_line_file(tmp_path_factory) -> Iterator[Path]:
    """A record, a 100 MB line, and a record: written a megabyte at a time."""
    path = tmp_path_factory.mktemp("huge") / "metrics.jsonl"
    block = b"x" * (1 << 20)
    with open(path, "wb") as out:
        out.write(b'{"before": 1}\n')
        for _ in range(BIG_LINE_BYTES // len(block)):
            out.write(block)
        out.write(b'\n{"after": 2}\n')
    yield path
    path.unlink()  # pytest keeps its last runs' folders: not 100 MB of them


def _traced_read(tail: MetricsTail, final: bool) -> tuple[list, int]:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        records = tail.read(final=final)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return records, peak


def test_a_100mb_line_is_skipped_in_bounded_memory(huge_line_file, monkeypatch):
    monkeypatch.setattr(metrics_file, "MAX_FILE_BYTES", 2 * BIG_LINE_BYTES)  # reach past it
    tail = MetricsTail(huge_line_file)
    records, peak = _traced_read(tail, final=False)
    assert records == [{"before": 1}, {"after": 2}]
    assert tail.skipped == 1
    assert tail.offset == huge_line_file.stat().st_size
    assert peak < MEMORY_BOUND, f"peak {peak} bytes while reading"


def test_a_100mb_line_is_skipped_in_bounded_memory_as_it_grows(tmp_path, monkeypatch):
    """The same line read while it is being written: each read holds no more of it."""
    monkeypatch.setattr(metrics_file, "MAX_FILE_BYTES", 2 * BIG_LINE_BYTES)
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    _append(path, b'{"before": 1}\n')
    block = b"x" * (10 << 20)
    peaks = []
    seen = []
    for _ in range(BIG_LINE_BYTES // len(block)):
        _append(path, block)
        records, peak = _traced_read(tail, final=False)
        seen += records
        peaks.append(peak)
    _append(path, b'\n{"after": 2}')
    records, peak = _traced_read(tail, final=True)
    seen += records
    peaks.append(peak)
    assert seen == [{"before": 1}, {"after": 2}]
    assert tail.skipped == 1
    path.unlink()
    assert max(peaks) < MEMORY_BOUND, f"peaks {peaks}"


def test_at_the_default_file_bound_a_100mb_line_ends_the_read(huge_line_file):
    tail = MetricsTail(huge_line_file)
    records, peak = _traced_read(tail, final=True)
    assert records == [{"before": 1}]  # what follows lies past MAX_FILE_BYTES
    assert tail.offset == metrics_file.MAX_FILE_BYTES
    assert tail.skipped == 1
    assert peak < MEMORY_BOUND, f"peak {peak} bytes while reading"
    assert tail.read(final=True) == []
