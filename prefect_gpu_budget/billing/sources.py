"""Where a bill is read from: one source type per kind of export, each behind `BillSource`, and
the registry from an export's kind to its type (`SOURCE_TYPES`).

- `aws-cur2`: AWS Cost and Usage Report 2.0 (Data Exports) in S3 (`aws_cur2.Cur2S3Source`);
- `gcp-billing`: the GCP Cloud Billing detailed export in BigQuery
  (`gcp_billing.BigQuerySource`);
- `file`: local files in either schema (`files.FilesSource`).

A new kind of export is a module holding its reader and its source type (a class with `NEEDS`
and `from_export`, and `read`, `stream` and `where`), one line in `SOURCE_TYPES`, and its test:
the `BillingExport` block takes its kinds from here. An import reads through `stream` (line by
line, in bounded memory); a source without one is read whole through `read`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from prefect_gpu_budget.billing.aws_cur2 import Cur2S3Source
from prefect_gpu_budget.billing.files import FilesSource
from prefect_gpu_budget.billing.gcp_billing import BigQuerySource
from prefect_gpu_budget.billing.lines import BillLine, BillRead

__all__ = ["SOURCE_TYPES", "BillSource", "SourceType", "missing", "source_for"]


class BillSource(Protocol):
    """A cloud's billing export, read by billing period."""

    def read(self, periods: list[str]) -> dict[tuple[str, str], list[BillLine]]:
        """Each billing period's lines as the export holds them now, by (source, period)."""
        ...

    def stream(self, periods: list[str]) -> list[BillRead]:
        """The same lines as reads that yield them one at a time, as the export is read."""
        ...

    def where(self) -> str:
        """Where it reads from, for people (and the ledger's record of the import)."""
        ...


class SourceType(Protocol):
    """A kind of export's source type: what it needs of an export's settings, and how it is
    built from them."""

    NEEDS: tuple[str, ...]
    """The settings (the `BillingExport` block's fields) it cannot do without."""

    def from_export(self, export: Any) -> BillSource:
        """The source an export's settings (a `BillingExport` block) describe."""
        ...


SOURCE_TYPES: Mapping[str, SourceType] = {
    "aws-cur2": Cur2S3Source,
    "gcp-billing": BigQuerySource,
    "file": FilesSource,
}
"""Each kind of export (the `BillingExport` block's `kind`), in the order it is listed."""


def missing(kind: str, export: Any) -> list[str]:
    """The settings an export of `kind` needs that `export` leaves empty."""
    return [name for name in SOURCE_TYPES[kind].NEEDS if not getattr(export, name)]


def source_for(kind: str, export: Any) -> BillSource:
    """The source of an export of `kind`, built from its settings (`export`)."""
    return SOURCE_TYPES[kind].from_export(export)
