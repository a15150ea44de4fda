"""Local bill files in either export's schema (`read_bill_files`, line by line
`iter_bill_files`, and the export of kind `file` that reads them, `FilesSource`), and the
currency check the ledger makes before it books them (`check_currency`, `currency_error`)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from prefect_gpu_budget.billing.aws_cur2 import is_cur2, iter_cur2_lines
from prefect_gpu_budget.billing.gcp_billing import is_gcp, iter_gcp_lines
from prefect_gpu_budget.billing.lines import SOURCES, BillError, BillLine, BillRead
from prefect_gpu_budget.billing.reading import number_repeats, open_rows, split_where

CURRENCY_COLUMN = {"aws-cur2": "line_item_currency_code", "gcp-billing": "currency"}


def read_bill_files(
    paths: Iterable[str | os.PathLike[str]] | str | os.PathLike[str],
    source: str | None = None,
    max_bytes: int | None = None,
) -> list[BillLine]:
    """The lines of local export files (Parquet, CSV, gzip CSV, JSON Lines; the format told
    from each file's bytes), as one read: a line id repeated across them is numbered.

    With `source` None each file's schema is told from its columns: CUR 2.0's snake_case
    `identity_`/`line_item_`/`bill_` columns, or the GCP export's nested `invoice` and `cost`
    fields; a file with neither, or both, is refused naming its columns. `source`
    (`aws-cur2` or `gcp-billing`) reads every file in that schema. A file named twice is
    refused. GCP rows are nested, so a GCP file is JSON Lines or Parquet. `max_bytes` bounds
    each file's data, decompressed (`reading.open_rows`).
    """
    return number_repeats(list(iter_bill_files(paths, source, max_bytes)))


def iter_bill_files(
    paths: Iterable[str | os.PathLike[str]] | str | os.PathLike[str],
    source: str | None = None,
    max_bytes: int | None = None,
) -> Iterator[BillLine]:
    """`read_bill_files`' lines one at a time, file after file, as their rows are read: not
    numbered (whoever imports them numbers a line id repeated across them)."""
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    if source is not None and source not in SOURCES:
        raise ValueError(f"source is one of {', '.join(SOURCES)}, not {source!r}")
    paths = list(paths)
    seen: set[Path] = set()
    for path in paths:
        real = Path(path).resolve()
        if real in seen:
            raise BillError(str(path), "named twice: its lines would be billed twice")
        seen.add(real)
    for path in paths:
        rows = open_rows(path, max_bytes=max_bytes)
        kind = source or _schema(rows.columns, rows.where)
        yield from iter_cur2_lines(rows) if kind == "aws-cur2" else iter_gcp_lines(rows)


@dataclass(frozen=True)
class FilesSource:
    """Local export files (`read_bill_files`): whatever billing periods they hold, each read
    whole; the periods asked for are not used."""

    NEEDS: ClassVar[tuple[str, ...]] = ("paths",)
    paths: Sequence[str | os.PathLike[str]]
    schema: str | None = None
    """`aws-cur2` or `gcp-billing`; None: told from each file's columns."""
    max_bytes: int | None = None

    @classmethod
    def from_export(cls, export: Any) -> FilesSource:
        return cls(list(export.paths))

    def where(self) -> str:
        return ", ".join(map(str, self.paths))

    def read(self, periods: list[str]) -> dict[tuple[str, str], list[BillLine]]:
        found: dict[tuple[str, str], list[BillLine]] = {}
        for line in read_bill_files(self.paths, self.schema, max_bytes=self.max_bytes):
            found.setdefault((line.source, line.billing_period), []).append(line)
        return found

    def stream(self, periods: list[str]) -> list[BillRead]:
        """The files as one read (a line id repeated across them is numbered), line by line."""
        return [BillRead(iter_bill_files(self.paths, self.schema, max_bytes=self.max_bytes))]


def _schema(columns: list[str], where: str) -> str:
    """The schema a file's columns show. A file with none of CUR 2.0's columns but at least
    half of the GCP export's required ones is read as a GCP export, so that the reader names
    the column it lacks (a file without `cost` is a GCP export that lost it)."""
    from prefect_gpu_budget.billing.gcp_billing import REQUIRED

    aws, gcp = is_cur2(columns), is_gcp(columns)
    if not aws and not gcp and 2 * sum(c in columns for c in REQUIRED) >= len(REQUIRED):
        gcp = True
    if aws != gcp:
        return "aws-cur2" if aws else "gcp-billing"
    shown = ", ".join(columns[:8]) + (", ..." if len(columns) > 8 else "")
    what = "both a CUR 2.0 and" if aws else "neither a CUR 2.0 nor"
    raise BillError(where, f"{what} a GCP billing export by its columns ({shown or 'none'})")


def check_currency(lines: Iterable[BillLine], currency: str = "USD") -> None:
    """Refuse lines in another currency than `currency` (the budget's): `BillError` naming the
    file, the column and the row of the first such line. Codes compare case-insensitively."""
    for line in lines:
        if (error := currency_error(line, currency)) is not None:
            raise error


def currency_error(line: BillLine, currency: str = "USD") -> BillError | None:
    """The `BillError` a line in another currency than `currency` gets (None: it is in it)."""
    want = currency.strip().upper()
    if line.currency.strip().upper() == want:
        return None
    where, row = split_where(line.where)
    return BillError(
        where or line.source,
        f"billed in {line.currency!r}, not in the budget's {want}",
        CURRENCY_COLUMN.get(line.source),
        row,
    )
