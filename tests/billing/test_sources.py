"""Where a bill is read from (billing/sources.py): one source type per kind of export behind
`BillSource`, built from an export's settings by the registry `SOURCE_TYPES`; what each reads
and where it says it reads from. S3 itself (moto) is in tests/billing/test_cur2_s3.py and
tests/blocks/test_billing.py, BigQuery's rows in tests/billing/test_gcp_billing.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from prefect_gpu_budget.billing import aws_cur2, gcp_billing, sources
from prefect_gpu_budget.billing.aws_cur2 import Cur2S3Source
from prefect_gpu_budget.billing.files import FilesSource
from prefect_gpu_budget.billing.gcp_billing import BigQuerySource
from prefect_gpu_budget.billing.lines import BillLine
from prefect_gpu_budget.billing.sources import SOURCE_TYPES, missing, source_for
from tests.billing.fixtures import cur_rows, write_csv, write_gcp_jsonl

EXPORT = SimpleNamespace(
    bucket="lab-billing",
    prefix="/exports/",
    export_name="gpu",
    aws_credentials=None,
    table="p.billing.gcp_billing_export_resource_v1_X",
    gcp_credentials=None,
    paths=["a.csv", "b.jsonl"],
)


def test_each_kind_has_one_source_type_in_order() -> None:
    assert list(SOURCE_TYPES) == ["aws-cur2", "gcp-billing", "file"]
    assert SOURCE_TYPES["aws-cur2"] is Cur2S3Source
    assert SOURCE_TYPES["gcp-billing"] is BigQuerySource
    assert SOURCE_TYPES["file"] is FilesSource


@pytest.mark.parametrize(
    "kind, where",
    [
        ("aws-cur2", "s3://lab-billing/exports/gpu"),
        ("gcp-billing", "bigquery:p.billing.gcp_billing_export_resource_v1_X"),
        ("file", "a.csv, b.jsonl"),
    ],
)
def test_a_source_is_built_from_its_exports_settings(kind: str, where: str) -> None:
    assert source_for(kind, EXPORT).where() == where
    assert missing(kind, EXPORT) == []


def test_what_a_kind_needs_and_the_export_leaves_empty() -> None:
    empty = SimpleNamespace(bucket=None, export_name="", table=None, paths=[])
    assert missing("aws-cur2", empty) == ["bucket", "export_name"]
    assert missing("gcp-billing", empty) == ["table"]
    assert missing("file", empty) == ["paths"]


def test_files_are_read_whole_by_source_and_period_whatever_the_periods(tmp_path: Path) -> None:
    paths = [write_csv(tmp_path / "cur.csv", cur_rows()), write_gcp_jsonl(tmp_path / "g.jsonl")]
    read = FilesSource(paths).read(["1999-01"])
    assert sorted(read) == [("aws-cur2", "2026-11"), ("gcp-billing", "2026-11")]
    assert [len(group) for _, group in sorted(read.items())] == [5, 3]
    assert FilesSource(paths).where() == f"{paths[0]}, {paths[1]}"
    only_aws = FilesSource([paths[0]], schema="aws-cur2").read([])
    assert list(only_aws) == [("aws-cur2", "2026-11")]


class _Credentials:
    """Stands in for `AwsCredentials` and `GcpCredentials`: hands out a client it remembers."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def get_client(self, service: str) -> str:
        self.asked.append(service)
        return f"{service}-client"

    def get_bigquery_client(self) -> str:
        self.asked.append("bigquery")
        return "bigquery-client"


def test_s3_reads_each_period_asked_whole_an_empty_one_included(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[Any, ...]] = []

    def read(client: str, bucket: str, prefix: str, name: str, period: str) -> list[BillLine]:
        calls.append((client, bucket, prefix, name, period))
        return []

    monkeypatch.setattr(aws_cur2, "read_cur2_s3", read)
    credentials = _Credentials()
    source = Cur2S3Source("b", "p", "e", credentials)
    assert source.read(["2026-10", "2026-11"]) == {
        ("aws-cur2", "2026-10"): [],
        ("aws-cur2", "2026-11"): [],
    }
    assert credentials.asked == ["s3"]
    assert calls == [("s3-client", "b", "p", "e", p) for p in ("2026-10", "2026-11")]


def test_bigquery_reads_each_period_asked_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str, str]] = []
    monkeypatch.setattr(
        gcp_billing,
        "read_gcp_bigquery",
        lambda client, table, period: calls.append((client, table, period)) or [],
    )
    credentials = _Credentials()
    read = BigQuerySource("p.d.t", credentials).read(["2026-11"])
    assert read == {("gcp-billing", "2026-11"): []}
    assert calls == [("bigquery-client", "p.d.t", "2026-11")] and credentials.asked == ["bigquery"]


def test_a_new_kind_is_one_registry_line(monkeypatch: pytest.MonkeyPatch) -> None:
    class Other:
        NEEDS = ("table",)

        def __init__(self, table: str) -> None:
            self.table = table

        @classmethod
        def from_export(cls, export: Any) -> Other:
            return cls(export.table)

        def where(self) -> str:
            return f"other:{self.table}"

        def read(self, periods: list[str]) -> dict[tuple[str, str], list[BillLine]]:
            return {}

    monkeypatch.setitem(sources.SOURCE_TYPES, "other", Other)  # type: ignore[index]
    assert source_for("other", EXPORT).where() == f"other:{EXPORT.table}"
    assert missing("other", SimpleNamespace(table="")) == ["table"]


def test_s3_and_bigquery_stream_each_period_as_a_read_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A period's lines are read as the import takes them, not when the reads are made: an
    empty period is a read that names it."""
    calls: list[tuple[Any, ...]] = []

    def lines(*args: Any) -> Any:
        calls.append(args)
        yield from ()

    monkeypatch.setattr(aws_cur2, "stream_cur2_s3", lines)
    monkeypatch.setattr(gcp_billing, "stream_gcp_bigquery", lines)
    credentials = _Credentials()
    aws = Cur2S3Source("b", "p", "e", credentials).stream(["2026-10", "2026-11"])
    gcp = BigQuerySource("p.d.t", credentials).stream(["2026-11"])
    assert [r.periods for r in aws + gcp] == [
        (("aws-cur2", "2026-10"),),
        (("aws-cur2", "2026-11"),),
        (("gcp-billing", "2026-11"),),
    ]
    assert calls == [] and credentials.asked == ["s3", "bigquery"]
    assert [list(r.lines) for r in aws + gcp] == [[], [], []]
    assert calls == [
        ("s3-client", "b", "p", "e", "2026-10"),
        ("s3-client", "b", "p", "e", "2026-11"),
        ("bigquery-client", "p.d.t", "2026-11"),
    ]
