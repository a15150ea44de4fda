"""A CUR 2.0 delivery read from S3 (moto in server mode, through a real boto3 client) at the
documented paths: the manifest decides which data files are read."""

from __future__ import annotations

import gzip
import itertools
import json
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from prefect_gpu_budget.billing.aws_cur2 import read_cur2_s3
from prefect_gpu_budget.billing.lines import BillError
from tests.billing.fixtures import AWS_JOB, csv_text, cur_rows, write_parquet
from tests.support.aws_server import AwsServer

EXPORT = "lab-cur2"
PREFIX = "billing/exports"
PERIOD = "2026-11"
DATA = f"{PREFIX}/{EXPORT}/data/BILLING_PERIOD={PERIOD}"
META = f"{PREFIX}/{EXPORT}/metadata/BILLING_PERIOD={PERIOD}"
_buckets = itertools.count()


@pytest.fixture(scope="module")
def server() -> Iterator[AwsServer]:
    with AwsServer() as running:
        yield running


@pytest.fixture
def s3(server: AwsServer) -> Any:
    """A boto3 S3 client as the caller makes it, from an AwsCredentials block."""
    return server.credentials("us-east-1").get_client("s3")


@pytest.fixture
def bucket(s3: Any) -> str:
    name = f"lab-billing-{next(_buckets)}"
    s3.create_bucket(Bucket=name)
    return name


def _parquet(tmp_path: Path, rows: list[dict[str, Any]]) -> bytes:
    return write_parquet(tmp_path / f"p{next(_buckets)}.parquet", rows).read_bytes()


def _deliver(
    s3: Any, bucket: str, files: dict[str, bytes], listed: list[str] | None = None, **extra: Any
) -> list[str]:
    """Put the data files and a Data Exports manifest listing `listed` (default: all of
    them, as full S3 URIs) at the documented paths."""
    for name, body in files.items():
        s3.put_object(Bucket=bucket, Key=f"{DATA}/{name}", Body=body)
    uris = [f"s3://{bucket}/{DATA}/{name}" for name in (files if listed is None else listed)]
    manifest = {
        "executionId": "e-0001",
        "exportArn": "arn:aws:bcm-data-exports:us-east-1:111111111111:export/lab-cur2-0001",
        "columns": [{"name": "identity_line_item_id", "type": "string"}],
        "dataFiles": uris,
        **extra,
    }
    s3.put_object(
        Bucket=bucket, Key=f"{META}/{EXPORT}-Manifest.json", Body=json.dumps(manifest).encode()
    )
    return uris


def test_a_parquet_delivery_is_read_through_its_manifest(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    rows = cur_rows()
    _deliver(
        s3,
        bucket,
        {
            f"{EXPORT}-00001.snappy.parquet": _parquet(tmp_path, rows[:3]),
            f"{EXPORT}-00002.snappy.parquet": _parquet(tmp_path, rows[3:]),
        },
    )
    lines = read_cur2_s3(s3, bucket, PREFIX, EXPORT, PERIOD)
    assert [line.line_id.split("/")[0] for line in lines] == [
        "li-001",
        "li-002",
        "li-003",
        "li-004",
        "li-005",
    ]
    assert sum(line.billed_micro for line in lines) == 50_759_400
    assert [line.job_mark for line in lines] == [AWS_JOB] * 3 + [None, None]
    assert lines[3].where == f"s3://{bucket}/{DATA}/{EXPORT}-00002.snappy.parquet, row 1"


def test_a_gzip_csv_delivery_is_read(s3: Any, bucket: str) -> None:
    _deliver(s3, bucket, {f"{EXPORT}-00001.csv.gz": gzip.compress(csv_text(cur_rows()).encode())})
    lines = read_cur2_s3(s3, bucket, f"/{PREFIX}/", EXPORT, PERIOD)
    assert [line.billed_micro for line in lines] == [
        37_688_000,
        12_563_000,
        -5_000_000,
        4_100_000,
        1_408_400,
    ]


def test_a_file_in_the_data_folder_the_manifest_does_not_list_is_not_read(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    stale = [dict(cur_rows()[0], identity_line_item_id="li-999")]
    _deliver(
        s3,
        bucket,
        {
            f"{EXPORT}-00001.snappy.parquet": _parquet(tmp_path, cur_rows()),
            f"{EXPORT}-00009.snappy.parquet": _parquet(tmp_path, stale),  # an older refresh's
            "notes.txt": b"not a bill",
        },
        listed=[f"{EXPORT}-00001.snappy.parquet"],
    )
    lines = read_cur2_s3(s3, bucket, PREFIX, EXPORT, PERIOD)
    assert len(lines) == 5
    assert not [line for line in lines if line.line_id.startswith("li-999")]


def test_a_listed_file_missing_from_s3_is_refused_by_name(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    _deliver(
        s3,
        bucket,
        {f"{EXPORT}-00001.snappy.parquet": _parquet(tmp_path, cur_rows())},
        listed=[f"{EXPORT}-00001.snappy.parquet", f"{EXPORT}-00002.snappy.parquet"],
    )
    with pytest.raises(BillError) as caught:
        read_cur2_s3(s3, bucket, PREFIX, EXPORT, PERIOD)
    assert caught.value.where == f"s3://{bucket}/{DATA}/{EXPORT}-00002.snappy.parquet"
    assert "listed in the manifest but not in S3" in caught.value.rule


def test_a_truncated_parquet_in_s3_is_refused_by_name(s3: Any, bucket: str, tmp_path: Path) -> None:
    whole = _parquet(tmp_path, cur_rows())
    uris = _deliver(s3, bucket, {f"{EXPORT}-00001.snappy.parquet": whole[: len(whole) - 100]})
    with pytest.raises(BillError) as caught:
        read_cur2_s3(s3, bucket, PREFIX, EXPORT, PERIOD)
    assert caught.value.where == uris[0] and "Parquet" in caught.value.rule


def test_a_missing_column_in_s3_is_named(s3: Any, bucket: str, tmp_path: Path) -> None:
    rows = cur_rows()
    for row in rows:
        del row["line_item_unblended_cost"]
    uris = _deliver(s3, bucket, {f"{EXPORT}-00001.snappy.parquet": _parquet(tmp_path, rows)})
    with pytest.raises(BillError) as caught:
        read_cur2_s3(s3, bucket, PREFIX, EXPORT, PERIOD)
    assert (caught.value.where, caught.value.rule, caught.value.column) == (
        uris[0],
        "missing column",
        "line_item_unblended_cost",
    )


def test_a_line_of_another_period_is_refused(s3: Any, bucket: str, tmp_path: Path) -> None:
    rows = cur_rows()
    rows[1]["bill_billing_period_start_date"] = rows[1]["bill_billing_period_start_date"].replace(
        month=10
    )
    _deliver(s3, bucket, {f"{EXPORT}-00001.snappy.parquet": _parquet(tmp_path, rows)})
    with pytest.raises(BillError) as caught:
        read_cur2_s3(s3, bucket, PREFIX, EXPORT, PERIOD)
    assert (caught.value.column, caught.value.row) == ("bill_billing_period_start_date", 2)
    assert "2026-10" in caught.value.rule


def test_an_undelivered_period_is_refused(s3: Any, bucket: str, tmp_path: Path) -> None:
    _deliver(s3, bucket, {f"{EXPORT}-00001.snappy.parquet": _parquet(tmp_path, cur_rows())})
    with pytest.raises(BillError) as caught:
        read_cur2_s3(s3, bucket, PREFIX, EXPORT, "2026-12")
    assert caught.value.where == f"s3://{bucket}/{PREFIX}/{EXPORT}/metadata/BILLING_PERIOD=2026-12/"
    assert "no Manifest.json" in caught.value.rule
    with pytest.raises(ValueError, match="YYYY-MM"):
        read_cur2_s3(s3, bucket, PREFIX, EXPORT, "2026-13")


def test_manifest_variants_bare_keys_and_legacy_report_keys(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    name = f"{EXPORT}-00001.snappy.parquet"
    s3.put_object(Bucket=bucket, Key=f"{DATA}/{name}", Body=_parquet(tmp_path, cur_rows()))
    for manifest in (
        {"dataFiles": [f"{DATA}/{name}"]},
        {"bucket": bucket, "reportKeys": [f"{DATA}/{name}"]},
        {"dataFiles": [f"s3://{bucket}/{DATA}/{name}"] * 2},  # listed twice, read once
    ):
        s3.put_object(
            Bucket=bucket,
            Key=f"{META}/{EXPORT}-Manifest.json",
            Body=json.dumps(manifest).encode(),
        )
        assert len(read_cur2_s3(s3, bucket, PREFIX, EXPORT, PERIOD)) == 5


def test_the_newest_manifest_is_read_where_refreshes_keep_their_own(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    """A "create new" delivery keeps each refresh's manifest in a folder of its own; the
    newer one here has the name that sorts first, so only its time tells it."""
    old = f"{EXPORT}-old.snappy.parquet"
    new = f"{EXPORT}-new.snappy.parquet"
    s3.put_object(Bucket=bucket, Key=f"{DATA}/{old}", Body=_parquet(tmp_path, cur_rows()[:1]))
    s3.put_object(Bucket=bucket, Key=f"{DATA}/{new}", Body=_parquet(tmp_path, cur_rows()))
    for execution, name in (("e-0002", old), ("e-0001", new)):
        s3.put_object(
            Bucket=bucket,
            Key=f"{META}/{execution}/{EXPORT}-Manifest.json",
            Body=json.dumps({"dataFiles": [f"s3://{bucket}/{DATA}/{name}"]}).encode(),
        )
        time.sleep(1.1)  # S3 dates an object to the second
    assert len(read_cur2_s3(s3, bucket, PREFIX, EXPORT, PERIOD)) == 5


class _Listing:
    """A client that lists two manifests of the same second (and reads nothing)."""

    def get_paginator(self, name: str) -> Any:
        assert name == "list_objects_v2"
        return self

    def paginate(self, Bucket: str, Prefix: str) -> list[dict[str, Any]]:  # noqa: N803
        stamp = datetime(2026, 12, 1, 3, 0, 0, tzinfo=timezone.utc)
        keys = [f"{Prefix}e-1/{EXPORT}-Manifest.json", f"{Prefix}e-2/{EXPORT}-Manifest.json"]
        return [{"Contents": [{"Key": k, "LastModified": stamp} for k in keys]}]


def test_two_newest_manifests_of_one_second_are_refused() -> None:
    with pytest.raises(BillError, match="several newest manifests: .*e-1/.*e-2/"):
        read_cur2_s3(_Listing(), "b", PREFIX, EXPORT, PERIOD)


@pytest.mark.parametrize(
    ("body", "rule"),
    [
        (b"{not json", "not a JSON manifest"),
        (b"[]", "not a JSON manifest"),
        (b'{"columns": []}', "lists no data files"),
        (b'{"dataFiles": "s3://b/k"}', "dataFiles is not a list of S3 URIs"),
        (b'{"dataFiles": ["s3://only-a-bucket"]}', "not an S3 object URI"),
    ],
)
def test_a_bad_manifest_is_refused_by_name(s3: Any, bucket: str, body: bytes, rule: str) -> None:
    s3.put_object(Bucket=bucket, Key=f"{META}/{EXPORT}-Manifest.json", Body=body)
    with pytest.raises(BillError) as caught:
        read_cur2_s3(s3, bucket, PREFIX, EXPORT, PERIOD)
    assert caught.value.where == f"s3://{bucket}/{META}/{EXPORT}-Manifest.json"
    assert caught.value.rule.startswith(rule)


def test_a_line_in_two_files_is_one_line_and_a_different_one_is_numbered(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    rows = cur_rows()[:1]
    other = [dict(rows[0], line_item_net_unblended_cost=1.0)]  # same id, another amount
    _deliver(
        s3,
        bucket,
        {
            f"{EXPORT}-00001.snappy.parquet": _parquet(tmp_path, rows),
            f"{EXPORT}-00002.snappy.parquet": _parquet(tmp_path, rows),  # a copy
            f"{EXPORT}-00003.snappy.parquet": _parquet(tmp_path, other),
        },
    )
    ids = [line.line_id for line in read_cur2_s3(s3, bucket, PREFIX, EXPORT, PERIOD)]
    assert ids == [f"{ids[2]}#2", f"{ids[2]}#2", ids[2]]  # numbered by amount: $1 first


@pytest.mark.parametrize(
    "listed",
    [
        "s3://{bucket}/" + DATA + "/../../../../secret.parquet",
        "s3://{bucket}/billing/other-export/data/part.parquet",
        "s3://elsewhere-{bucket}/" + DATA + "/part.parquet",
        "../../secret.parquet",
        "s3://{bucket}/" + f"{PREFIX}/{EXPORT}/./data/part.parquet",
    ],
)
def test_a_manifest_naming_an_object_outside_its_export_is_refused_unread(
    s3: Any, bucket: str, tmp_path: Path, listed: str
) -> None:
    body = _parquet(tmp_path, cur_rows())
    s3.create_bucket(Bucket=f"elsewhere-{bucket}")
    for where, key in (
        (bucket, "secret.parquet"),
        (bucket, "billing/other-export/data/part.parquet"),
        (f"elsewhere-{bucket}", f"{DATA}/part.parquet"),
    ):
        s3.put_object(Bucket=where, Key=key, Body=body)
    uri = listed.format(bucket=bucket)
    _deliver(s3, bucket, {"part-0.parquet": body}, listed=["part-0.parquet"])
    manifest = {"dataFiles": [f"s3://{bucket}/{DATA}/part-0.parquet", uri]}
    s3.put_object(
        Bucket=bucket, Key=f"{META}/{EXPORT}-Manifest.json", Body=json.dumps(manifest).encode()
    )
    with pytest.raises(BillError) as caught:
        read_cur2_s3(s3, bucket, PREFIX, EXPORT, PERIOD)
    assert caught.value.where == f"s3://{bucket}/{META}/{EXPORT}-Manifest.json"
    assert f"outside the export s3://{bucket}/{PREFIX}/{EXPORT}/" in caught.value.rule


def test_a_data_file_past_the_bound_is_refused_as_it_is_read(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    bomb = gzip.compress(csv_text(cur_rows() * 2000).encode())
    _deliver(s3, bucket, {f"{EXPORT}-00001.csv.gz": bomb})
    with pytest.raises(BillError) as caught:
        read_cur2_s3(s3, bucket, PREFIX, EXPORT, PERIOD, max_bytes=len(bomb) + 1000)
    assert caught.value.where.endswith(f"{EXPORT}-00001.csv.gz")
    assert "decompresses past the bound" in caught.value.rule
    with pytest.raises(BillError, match="holds past the bound of 100 bytes"):
        read_cur2_s3(s3, bucket, PREFIX, EXPORT, PERIOD, max_bytes=100)
