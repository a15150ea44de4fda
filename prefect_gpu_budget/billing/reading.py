"""What the export readers share: a local export file opened as its columns and its rows
(`open_rows`), whatever its format, and the values of a row read as text, times and money.

The format is told from the file's first bytes, never its name (an export's data files are named
by the provider, and a copy may be renamed): Parquet (`PAR1`), gzip (then CSV or JSON Lines
inside), JSON Lines (the first non-blank character is `{`), else CSV with a header row.

Rows come as dicts of the file's own values: from Parquet, pyarrow's Python values (a map column
as a list of (key, value) tuples, a struct as a dict, a timestamp as a datetime); from CSV, text,
an empty field as None; from JSON Lines, JSON values. Row 1 is the first row of data.

A hostile file is refused before it costs more than a stated bound, with nothing written: a file
whose data pass `MAX_FILE_BYTES` (a gzip stream is decompressed in chunks and dropped as it is
counted, so a bomb stops at the bound; a Parquet file by the sizes in its footer), a line longer
than `MAX_LINE_CHARS`, and a NUL byte anywhere in the text (no database stores one in text).
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import date, datetime, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

from prefect_gpu_budget.billing.lines import BillError, BillLine, to_decimal, to_micro

MAX_FILE_BYTES = 256 << 20
"""The most a file's data may hold, decompressed (256 MiB; `bill import --max-file-mib`)."""
MAX_LINE_CHARS = 1 << 20
"""The longest line of a CSV or JSON Lines file (1 Mi characters)."""
_CHUNK = 1 << 20
PARQUET_MAGIC = b"PAR1"
GZIP_MAGIC = b"\x1f\x8b"
_BATCH = 10_000
"""Parquet rows decoded at a time: a month's export may hold millions."""


@dataclass
class Rows:
    """An open export file: its columns (for JSON Lines, the first row's keys) and its rows."""

    where: str
    """The file, as messages name it."""
    kind: str
    """parquet, csv, csv.gz, jsonl or jsonl.gz."""
    columns: list[str]
    rows: Iterator[dict[str, Any]]
    wanted: frozenset[str] | None = None
    """The columns a reader reads, set before the first row: a Parquet file decodes only
    those (a CUR 2.0 export holds a hundred columns, a reader needs a dozen); None: all."""


def open_rows(path: str | Path, where: str | None = None, max_bytes: int | None = None) -> Rows:
    """The export file at `path` as `Rows`; `where` names it in messages (default: the path);
    `max_bytes` bounds its data, decompressed (default `MAX_FILE_BYTES`).

    Refuses (`BillError`, one line naming the file) an empty file, an unreadable or truncated
    Parquet or gzip file, text that is not UTF-8, data past `max_bytes` and a NUL byte (naming
    its row). Errors met later, while the rows are read, are raised by the iterator as
    `BillError`s too, with the row number where one is known (a line past `MAX_LINE_CHARS`).
    """
    where = where or str(path)
    bound = MAX_FILE_BYTES if max_bytes is None else max_bytes
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise BillError(where, f"cannot open: {exc.strerror or exc}") from None
    if not head:
        raise BillError(where, "empty file")
    if head == PARQUET_MAGIC:
        return _parquet(path, where, bound)
    zipped = head[:2] == GZIP_MAGIC
    _scan(path, where, zipped, bound)
    if zipped:
        return _text(lambda: gzip.open(path, "rt", encoding="utf-8-sig", newline=""), where, True)
    return _text(lambda: open(path, encoding="utf-8-sig", newline=""), where, False)


def _scan(path: str | Path, where: str, zipped: bool, bound: int) -> None:
    """Read a text file's bytes once, in chunks (a gzip file decompressed), before any row is
    parsed: refuse it past `bound` bytes or with a NUL byte (naming the row it is on)."""
    total, lines, header = 0, 0, 1
    try:
        with gzip.open(path, "rb") if zipped else open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                if not total and chunk.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"{"):
                    header = 0  # JSON Lines: no header line
                if b"\x00" in chunk:
                    row = lines + chunk[: chunk.index(b"\x00")].count(b"\n") + 1 - header
                    raise BillError(where, "a NUL byte in the text", row=row or None)
                total += len(chunk)
                lines += chunk.count(b"\n")
                if total > bound:
                    what = "decompresses" if zipped else "holds"
                    raise BillError(where, f"{what} past the bound of {bound} bytes")
    except (EOFError, OSError, zlib.error) as exc:
        raise BillError(where, f"unreadable gzip file (truncated?): {_short(exc)}") from None


def _parquet(path: str | Path, where: str, bound: int) -> Rows:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
        columns = list(file.schema_arrow.names)
        meta = file.metadata
        size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    except (pa.ArrowException, OSError) as exc:
        raise BillError(where, f"not a readable Parquet file (truncated?): {_short(exc)}") from None
    if size > bound:
        file.close()
        raise BillError(where, f"decompresses past the bound of {bound} bytes ({size})")

    def rows() -> Iterator[dict[str, Any]]:
        wanted = opened.wanted
        read = columns if wanted is None else [c for c in columns if c in wanted]
        try:
            for batch in file.iter_batches(batch_size=_BATCH, columns=read):
                yield from batch.to_pylist()
        except (pa.ArrowException, OSError) as exc:
            raise BillError(where, f"unreadable Parquet data: {_short(exc)}") from None
        finally:
            file.close()

    opened = Rows(where, "parquet", columns, iter(()))
    opened.rows = rows()
    return opened


def _text(opener: Callable[[], io.TextIOBase], where: str, zipped: bool) -> Rows:
    """CSV or JSON Lines, plain or gzip: opened once to tell which and read the header, then
    streamed."""
    suffix = ".gz" if zipped else ""
    try:
        with opener() as f:
            first = ""
            for line in _lines(f, where, 0):
                if line.strip():
                    first = line
                    break
    except (EOFError, OSError, zlib.error) as exc:
        raise BillError(where, f"unreadable gzip file (truncated?): {_short(exc)}") from None
    except UnicodeDecodeError:
        raise BillError(where, "not UTF-8 text") from None
    if not first:
        raise BillError(where, "empty file")
    if first.lstrip().startswith("{"):
        try:
            columns = list(json.loads(first))
        except (ValueError, TypeError):
            raise BillError(where, "not a JSON object", row=1) from None
        return Rows(where, "jsonl" + suffix, columns, _jsonl(opener, where))
    header = next(csv.reader([first]))
    return Rows(where, "csv" + suffix, header, _csv(opener, where))


@contextmanager
def _guarded(opener: Callable[[], io.TextIOBase], where: str) -> Iterator[io.TextIOBase]:
    """The opened file; a truncated or corrupt gzip stream or bad text met while it is read
    (in the body of the `with`) becomes a `BillError`."""
    try:
        with opener() as f:
            yield f
    except (EOFError, OSError, zlib.error) as exc:
        raise BillError(where, f"unreadable gzip file (truncated?): {_short(exc)}") from None
    except UnicodeDecodeError:
        raise BillError(where, "not UTF-8 text") from None


def _lines(f: io.TextIOBase, where: str, first_row: int) -> Iterator[str]:
    """The file's lines, none read past `MAX_LINE_CHARS` (so a line of a gigabyte costs a
    megabyte); `BillError` naming the row (the line's number plus `first_row`) for a longer
    one."""
    n = first_row
    while line := f.readline(MAX_LINE_CHARS + 1):
        n += 1
        if len(line) > MAX_LINE_CHARS:
            raise BillError(where, f"a line longer than {MAX_LINE_CHARS} characters", row=n)
        yield line


def _csv(opener: Callable[[], io.TextIOBase], where: str) -> Iterator[dict[str, Any]]:
    with _guarded(opener, where) as f:
        reader = csv.reader(_lines(f, where, -1))
        header: list[str] | None = None
        n = 0
        try:
            for fields in reader:
                if not fields or fields == [""]:
                    continue
                if header is None:
                    header = fields
                    continue
                n += 1
                if len(fields) != len(header):
                    raise BillError(
                        where, f"{len(fields)} fields where the header has {len(header)}", row=n
                    )
                yield {k: (v if v != "" else None) for k, v in zip(header, fields, strict=True)}
        except csv.Error as exc:
            raise BillError(where, f"not CSV: {_short(exc)}", row=n + 1) from None


def _jsonl(opener: Callable[[], io.TextIOBase], where: str) -> Iterator[dict[str, Any]]:
    with _guarded(opener, where) as f:
        n = 0
        for line in _lines(f, where, 0):
            if not line.strip():
                continue
            n += 1
            try:
                row = json.loads(line)
            except ValueError:
                raise BillError(where, "not a JSON object (a cut line?)", row=n) from None
            if not isinstance(row, dict):
                raise BillError(where, "not a JSON object", row=n)
            yield row


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 120 else text[:117] + "..."


# -- values -------------------------------------------------------------------------------------


def at(where: str, n: int) -> str:
    """A line's `where`: its file and row, as `split_where` reads it back."""
    return f"{where}, row {n}"


def split_where(where: str) -> tuple[str, int | None]:
    """A `BillLine.where` back into its file and row."""
    head, sep, tail = where.rpartition(", row ")
    return (head, int(tail)) if sep and tail.isdigit() else (where, None)


def text(value: object, where: str, column: str, n: int, *, required: bool = True) -> str | None:
    """A text value, stripped; None for an empty optional one. A NUL is refused."""
    if isinstance(value, str) and value.strip():
        no_nul(value, where, column, n)
        return value.strip()
    if value is None or (isinstance(value, str) and not value.strip()):
        if required:
            raise BillError(where, "empty", column, n)
        return None
    raise BillError(where, f"not text: {type(value).__name__}", column, n)


def no_nul(value: str, where: str, column: str, n: int) -> str:
    """`value`, refused (`BillError` naming the column and row) if it holds a NUL byte."""
    if "\x00" in value:
        raise BillError(where, "a NUL byte in the text", column, n)
    return value


def money(value: object, where: str, column: str, n: int) -> Decimal:
    """An amount of money as given (checked by `to_decimal`: a number or a number's text)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        raise BillError(where, "empty", column, n)
    return to_decimal(value, where, column, n)


def micro(value: object, where: str, column: str, n: int) -> int:
    """An amount of money in micro-dollars (`to_micro`), refused empty as `money` is."""
    if value is None or (isinstance(value, str) and not value.strip()):
        raise BillError(where, "empty", column, n)
    return to_micro(value, where, column, n)


_ISO = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})(?:[T ](\d{2}):(\d{2})(?::(\d{2})(?:\.(\d{1,9}))?)?)?"
    r"\s*(Z|UTC|[+-]\d{2}:?\d{2})?"
)


def when(value: object, where: str, column: str, n: int) -> datetime:
    """A point in time, UTC: a datetime (a naive one is UTC, as Parquet timestamps without a
    zone are in these exports), a date (its midnight, UTC), or ISO 8601 text (`Z`, an offset,
    BigQuery's ` UTC`, or none for UTC; a date alone is its midnight)."""
    if isinstance(value, datetime):
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value
    if isinstance(value, date):
        return datetime(value.year, value.month, value.day, tzinfo=timezone.utc)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise BillError(where, "empty", column, n)
    if not isinstance(value, str):
        raise BillError(where, f"not a date and time: {type(value).__name__}", column, n)
    m = _ISO.fullmatch(value.strip())
    if m is None:
        raise BillError(where, f"not an ISO 8601 date and time: {value[:40]!r}", column, n)
    year, month, day, hour, minute, second, fraction, zone = m.groups()
    try:
        moment = datetime(
            int(year),
            int(month),
            int(day),
            int(hour or 0),
            int(minute or 0),
            int(second or 0),
            int((fraction or "0")[:6].ljust(6, "0")),
            tzinfo=timezone.utc,
        )
    except ValueError:
        raise BillError(where, f"not a real date: {value[:40]!r}", column, n) from None
    if zone and zone not in ("Z", "UTC"):
        sign = -1 if zone[0] == "-" else 1
        digits = zone[1:].replace(":", "")
        offset = sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
        moment = datetime.fromtimestamp(moment.timestamp() - offset, timezone.utc)
    return moment


def span(
    start: object, end: object, where: str, columns: tuple[str, str], n: int
) -> tuple[float, float]:
    """A usage interval in epoch seconds; `BillError` if it ends before it starts."""
    began = when(start, where, columns[0], n).timestamp()
    ended = when(end, where, columns[1], n).timestamp()
    if ended < began:
        raise BillError(where, "ends before it starts", columns[1], n)
    return began, ended


def number_repeats(lines: list[BillLine]) -> list[BillLine]:
    """The lines, those whose `line_id` repeats within the read with other content numbered
    `#2`, `#3`... (lines alike in all their `content` keep one id: one line read twice, which
    the import books once). The numbers go by amount (then position), not by file order, so
    that the same delivery read again, in another order, gives each amount the same id."""
    seen: dict[str, list[int]] = {}
    for i, line in enumerate(lines):
        seen.setdefault(line.line_id, []).append(i)
    out = list(lines)
    for indexes in seen.values():
        if len(indexes) < 2:
            continue
        for i, line_id in zip(indexes, numbered([lines[i] for i in indexes]), strict=True):
            if line_id != lines[i].line_id:
                out[i] = replace(lines[i], line_id=line_id)
    return out


def numbered(lines: Sequence[BillLine]) -> list[str]:
    """The ids of lines of one `line_id` read together (in the order read), numbered as
    `number_repeats` numbers them: by amount, then usage start, then position, each other
    `content` the next number (`#2`, `#3`...), the first keeping the id."""
    order = sorted(
        range(len(lines)), key=lambda i: (lines[i].billed_micro, lines[i].usage_start, i)
    )
    numbers: dict[tuple[object, ...], int] = {}
    ids = [line.line_id for line in lines]
    for i in order:
        k = numbers.setdefault(lines[i].content, len(numbers) + 1)
        if k > 1:
            ids[i] = f"{lines[i].line_id}#{k}"
    return ids
