"""Hostile files are refused by the readers, each with one line naming the file (and the
column and row where there is one), in bounded memory and time: a NUL byte, a line past
`MAX_LINE_CHARS`, data past the bound (a gzip bomb, a plain file, a Parquet file by its
footer). The import's side (nothing written, exit 2) is in tests/cli/test_bill.py."""

from __future__ import annotations

import gzip
import json
import time
import tracemalloc
import zlib
from pathlib import Path

import pytest

from prefect_gpu_budget.billing import reading
from prefect_gpu_budget.billing.files import read_bill_files
from prefect_gpu_budget.billing.lines import BillError
from tests.billing.fixtures import (
    csv_text,
    cur_rows,
    gcp_rows,
    write_gcp_jsonl,
    write_gcp_parquet,
    write_parquet,
)


def write_bomb(path: Path, size: int, line: bytes = b"a") -> Path:
    """A gzip file of `size` bytes of `line` repeated, written in chunks (a few MB on disk)."""
    chunk = (line * ((1 << 20) // len(line) + 1))[: 1 << 20]
    with gzip.open(path, "wb", compresslevel=9) as f:
        for _ in range(size >> 20):
            f.write(chunk)
    return path


def _refused(path: Path, **kw) -> BillError:
    with pytest.raises(BillError) as caught:
        read_bill_files([path], **kw)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)
    return caught.value


@pytest.mark.parametrize("zipped", [False, True])
def test_a_nul_byte_in_a_csv_is_refused_naming_its_row(tmp_path: Path, zipped: bool) -> None:
    text = csv_text(cur_rows()).replace("USE1-Train:ml.g5.xlarge", "USE1-Train\x00ml.g5")
    path = tmp_path / "cur.csv"
    path.write_bytes(gzip.compress(text.encode()) if zipped else text.encode())
    refused = _refused(path)
    assert refused.row == 5 and "NUL" in refused.rule


def test_a_nul_byte_in_json_lines_and_in_parquet_is_refused(tmp_path: Path) -> None:
    rows = gcp_rows()
    rows[1]["labels"][0]["value"] = "job\x00x"
    refused = _refused(write_gcp_jsonl(tmp_path / "gcp.jsonl", rows))
    assert refused.row == 2 and "NUL" in refused.rule
    refused = _refused(write_gcp_parquet(tmp_path / "gcp.parquet", rows))
    assert (refused.column, refused.row) == ("labels", 2)
    cur = cur_rows()
    cur[2]["line_item_usage_type"] = "Train\x00"
    refused = _refused(write_parquet(tmp_path / "cur.parquet", cur))
    assert (refused.column, refused.row) == ("line_item_usage_type", 3)


def test_a_line_past_the_bound_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    rows = cur_rows()
    rows[1]["line_item_usage_type"] = "x" * (reading.MAX_LINE_CHARS + 10)
    path = tmp_path / "cur.csv"
    path.write_text(csv_text(rows))
    refused = _refused(path)
    assert refused.row == 2 and "a line longer than" in refused.rule
    jsonl = tmp_path / "gcp.jsonl"
    jsonl.write_text(json.dumps(gcp_rows()[0]) + "\n" + "{" + " " * (2 << 20) + "}\n")
    assert _refused(jsonl).row == 2


def test_a_gzip_bomb_stops_at_the_bound_in_bounded_memory_and_time(tmp_path: Path) -> None:
    bomb = write_bomb(tmp_path / "bill.csv.gz", 1 << 30)  # one line of a GiB
    assert bomb.stat().st_size < 2 << 20
    tracemalloc.start()
    began = time.monotonic()
    try:
        refused = _refused(bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert f"decompresses past the bound of {reading.MAX_FILE_BYTES} bytes" in refused.rule
    assert peak < 16 << 20, peak
    assert time.monotonic() - began < 20
    rows = write_bomb(tmp_path / "rows.csv.gz", 64 << 20, csv_text(cur_rows()).encode())
    refused = _refused(rows, max_bytes=8 << 20)  # a stated bound, lower
    assert "decompresses past the bound of 8388608 bytes" in refused.rule


def test_a_plain_or_parquet_file_past_the_bound_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "cur.csv"
    plain.write_text(csv_text(cur_rows() * 50))
    assert "holds past the bound of 1000 bytes" in _refused(plain, max_bytes=1000).rule
    parquet = write_parquet(tmp_path / "cur.parquet", cur_rows() * 50)
    assert "decompresses past the bound" in _refused(parquet, max_bytes=1000).rule
    assert len(read_bill_files([parquet])) == 250


def test_a_truncated_bomb_is_still_one_line(tmp_path: Path) -> None:
    data = zlib.compress(b"a" * (1 << 20))
    path = tmp_path / "cut.csv.gz"
    path.write_bytes(gzip.compress(b"a,b\n" * 1000)[:-12] + data[:4])
    assert "gzip" in _refused(path).rule


def test_a_parquet_file_decodes_only_the_columns_a_reader_wants(tmp_path: Path) -> None:
    rows = reading.open_rows(write_parquet(tmp_path / "cur.parquet", cur_rows()))
    assert "product_servicecode" in rows.columns
    rows.wanted = frozenset({"identity_line_item_id", "not_in_the_file"})
    assert [row for row in rows.rows][:2] == [
        {"identity_line_item_id": "li-001"},
        {"identity_line_item_id": "li-002"},
    ]
