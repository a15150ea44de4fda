"""AWS Cost and Usage Report 2.0 (Data Exports, table `COST_AND_USAGE_REPORT`) read into
`BillLine`s: a period's delivery from S3 through its manifest (`read_cur2_s3`, or line by line,
`stream_cur2_s3`), or one local file (`read_cur2_file`; line by line, `iter_cur2_lines`).

Columns (CUR 2.0's snake_case names):

- required: `identity_line_item_id`, `bill_billing_period_start_date`,
  `line_item_line_item_type`, `line_item_usage_start_date`, `line_item_usage_end_date`,
  `line_item_unblended_cost`, and `resource_tags` (an export without it could tie no line to a
  job by its tag; a query that flattens the tag into `resource_tags_user_gpu_budget_job`, as the
  legacy CUR names it, stands in for it). In JSON Lines, whose columns are the first row's keys,
  a row may leave `resource_tags` out (no tags).
- optional: `identity_time_interval` (the line id is `identity_line_item_id/identity_time_interval`
  where it is given, as the item id alone repeats over the hours), `line_item_net_unblended_cost`
  (the billed amount where the column exists and the row's value is not null, else
  `line_item_unblended_cost`), `line_item_currency_code` (AWS's exports always have it; a file
  without the column, such as a query that left it out, is taken to be in USD, while a row
  with an empty one is refused), `line_item_resource_id` (only with "include resource IDs"),
  `line_item_line_item_description` and `line_item_usage_type` (the description: AWS's own
  words for the line, else its usage type, else its product code, else its line type, so that
  no line, a Tax line's included, is shown blank).

Dates are ISO 8601 text or Parquet timestamps (a naive one is UTC); money is a number or a
number's text. Formats: Parquet, CSV, gzip CSV and JSON Lines, told from the file's bytes.

The job mark is the tag `gpu-budget-job`. Once activated as a cost allocation tag it appears as
a key of the `resource_tags` map. Which form that key takes is not settled by AWS's pages, so
each form it may take is matched, case-insensitively: `user_gpu_budget_job` (snake_case with
the `user_` prefix, as CUR 2.0 names its columns), `user:gpu-budget-job` (the tag as the
Billing console and the legacy CUR name it), and `gpu-budget-job` bare. The map may be a Parquet
map (pyarrow's list of (key, value) pairs), a list of `{"key", "value"}` records, a JSON object,
or a JSON object's text (CSV). Two of those keys with different values on one line are refused.

A line id that repeats within one read is numbered (`#2`, `#3`...), by amount; every line's
`where` is `<file>, row <n>` (row 1 the file's first row of data).
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timezone
from pathlib import Path
from typing import Any, ClassVar

from prefect_gpu_budget.billing.lines import BillError, BillLine, BillRead
from prefect_gpu_budget.billing.reading import (
    MAX_FILE_BYTES,
    Rows,
    at,
    micro,
    no_nul,
    number_repeats,
    open_rows,
    span,
    text,
    when,
)

SOURCE = "aws-cur2"
TAGS = "resource_tags"
FLAT_TAG = "resource_tags_user_gpu_budget_job"
"""The job tag flattened into a column of its own (a query selecting the map's key)."""
NET = "line_item_net_unblended_cost"
UNBLENDED = "line_item_unblended_cost"
CURRENCY = "line_item_currency_code"
REQUIRED = (
    "identity_line_item_id",
    "bill_billing_period_start_date",
    "line_item_line_item_type",
    "line_item_usage_start_date",
    "line_item_usage_end_date",
    UNBLENDED,
)
"""Required besides `resource_tags` (or its flattened column)."""
_PERIOD = re.compile(r"\d{4}-(0[1-9]|1[0-2])")


def read_cur2_file(path: str | Path) -> list[BillLine]:
    """The lines of one local CUR 2.0 file: Parquet, CSV, gzip CSV or JSON Lines."""
    return number_repeats(cur2_lines(open_rows(path)))


def is_cur2(columns: list[str]) -> bool:
    """Whether a file's columns are CUR 2.0's."""
    return any(c.startswith(("identity_", "line_item_", "bill_")) for c in columns)


def cur2_lines(rows: Rows, period: str | None = None) -> list[BillLine]:
    """The lines of an open file in CUR 2.0 columns, in file order, not yet numbered; with a
    `period`, a line billed in another period is refused."""
    return list(iter_cur2_lines(rows, period))


def iter_cur2_lines(rows: Rows, period: str | None = None) -> Iterator[BillLine]:
    """`cur2_lines` one line at a time, as the rows are read (the columns are checked before
    the first)."""
    columns = set(rows.columns)
    for column in REQUIRED:
        if column not in columns:
            raise BillError(rows.where, "missing column", column)
    if TAGS not in columns and FLAT_TAG not in columns and not rows.kind.startswith("jsonl"):
        raise BillError(rows.where, "missing column", TAGS)
    has_currency = CURRENCY in columns
    rows.wanted = READ
    for n, row in enumerate(rows.rows, start=1):
        line = _line(row, rows.where, n, has_currency)
        if period is not None and line.billing_period != period:
            raise BillError(
                rows.where,
                f"billed in {line.billing_period}, not in the delivery's {period}",
                "bill_billing_period_start_date",
                n,
            )
        yield line


def _line(row: Mapping[str, Any], where: str, n: int, has_currency: bool) -> BillLine:
    item = text(row.get("identity_line_item_id"), where, "identity_line_item_id", n)
    interval = text(
        row.get("identity_time_interval"), where, "identity_time_interval", n, required=False
    )
    period = when(
        row.get("bill_billing_period_start_date"), where, "bill_billing_period_start_date", n
    ).astimezone(timezone.utc)
    start, end = span(
        row.get("line_item_usage_start_date"),
        row.get("line_item_usage_end_date"),
        where,
        ("line_item_usage_start_date", "line_item_usage_end_date"),
        n,
    )
    billed = micro(row.get(UNBLENDED), where, UNBLENDED, n)
    net = row.get(NET)  # checked as the required unblended cost is, whichever is billed
    if net is not None and not (isinstance(net, str) and not net.strip()):
        billed = micro(net, where, NET, n)
    currency = text(row.get(CURRENCY), where, CURRENCY, n, required=has_currency) or "USD"
    return BillLine(
        source=SOURCE,
        billing_period=f"{period.year:04d}-{period.month:02d}",
        line_id=f"{item}/{interval}" if interval else item,
        line_type=text(row.get("line_item_line_item_type"), where, "line_item_line_item_type", n)
        or "",
        usage_start=start,
        usage_end=end,
        billed_micro=billed,
        currency=currency,
        job_mark=_mark(row, where, n),
        resource_id=text(
            row.get("line_item_resource_id"), where, "line_item_resource_id", n, required=False
        ),
        description=_description(row, where, n),
        where=at(where, n),
    )


DESCRIBED_BY = (
    "line_item_line_item_description",
    "line_item_usage_type",
    "line_item_product_code",
    "line_item_line_item_type",
)


READ = frozenset(
    (*REQUIRED, *DESCRIBED_BY, "identity_time_interval", NET, CURRENCY, TAGS, FLAT_TAG)
    + ("line_item_resource_id",)
)
"""Every column a line is read from."""


def _description(row: Mapping[str, Any], where: str, n: int) -> str:
    for column in DESCRIBED_BY:
        found = text(row.get(column), where, column, n, required=False)
        if found:
            return found
    return ""


def is_mark_key(key: str) -> bool:
    """Whether a `resource_tags` key is the `gpu-budget-job` tag's, in any documented form."""
    name = key.strip().lower()
    for prefix in ("user:", "user_"):
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    return name.replace("-", "_") == "gpu_budget_job"


def _mark(row: Mapping[str, Any], where: str, n: int) -> str | None:
    found = {
        value for key, value in tags(row.get(TAGS), where, n).items() if is_mark_key(key) and value
    }
    flat = text(row.get(FLAT_TAG), where, FLAT_TAG, n, required=False)
    if flat:
        found.add(flat)
    for mark in found:
        no_nul(mark, where, TAGS, n)
    if len(found) > 1:
        raise BillError(where, f"two gpu-budget-job tags: {sorted(found)}", TAGS, n)
    return found.pop() if found else None


def tags(value: object, where: str, n: int) -> dict[str, str]:
    """A `resource_tags` value as a dict (None and an empty text: no tags)."""
    if value is None:
        return {}
    if isinstance(value, str):
        if not value.strip():
            return {}
        try:
            value = json.loads(value)
        except ValueError:
            raise BillError(where, "not a JSON object of tags", TAGS, n) from None
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, list | tuple):
        pairs = []
        for entry in value:
            if isinstance(entry, Mapping) and "key" in entry:
                pairs.append((entry["key"], entry.get("value")))
            elif isinstance(entry, list | tuple) and len(entry) == 2:
                pairs.append((entry[0], entry[1]))
            else:
                raise BillError(where, "not a map of tags", TAGS, n)
    else:
        raise BillError(where, f"not a map of tags: {type(value).__name__}", TAGS, n)
    out: dict[str, str] = {}
    for key, item in pairs:
        if not isinstance(key, str) or not (item is None or isinstance(item, str)):
            raise BillError(where, "a tag that is not text", TAGS, n)
        if item is not None:
            out[key] = item.strip()
    return out


# -- S3 -----------------------------------------------------------------------------------------


def read_cur2_s3(client: Any, *where: Any, max_bytes: int | None = None) -> list[BillLine]:
    """A billing period's whole delivery (`stream_cur2_s3`'s lines: the same arguments), as a
    list, numbered."""
    return number_repeats(list(stream_cur2_s3(client, *where, max_bytes=max_bytes)))


def stream_cur2_s3(
    client: Any,
    bucket: str,
    prefix: str,
    export_name: str,
    period: str,
    max_bytes: int | None = None,
) -> Iterator[BillLine]:
    """A billing period's whole delivery, read from S3 through its manifest, line by line
    (not numbered): each data file is copied to a temporary file and read there, one at a time.
    `client` is a boto3 S3 client (`AwsCredentials.get_client("s3")`); `period` is `YYYY-MM`.
    The manifest is looked for under `<prefix>/<export_name>/metadata/BILLING_PERIOD=<period>/`:
    the documented `<export_name>-Manifest.json` there if it exists, else the one object under
    that folder whose name ends in `Manifest.json` (the newest, if a "create new" delivery has
    kept one per refresh in folders of their own; two newest of the same second are refused).

    Manifests read: the Data Exports one, whose `dataFiles` lists the data files' full S3 URIs
    (`s3://bucket/key`); entries given as bare keys are read from `bucket`. The legacy CUR
    manifest's `reportKeys` (keys in its `bucket`, else `bucket`) is accepted too. Its `columns`
    list is not used: each file's own columns are checked. Exactly the listed files are read
    (each once), nothing else in the data folder; a listed file that is not in S3 is refused,
    naming it, as is a line whose billing period is not `period`.

    A manifest may name only objects of the export: in `bucket`, under
    `<prefix>/<export_name>/`, with no `.` or `..` segment; one that names any other is refused
    before anything is read. A manifest past `MANIFEST_BYTES`, and a data file past `max_bytes`
    (`reading.MAX_FILE_BYTES` by default; compressed as it is stored, and again decompressed),
    are refused as they are read, in bounded memory.
    """
    if not _PERIOD.fullmatch(period):
        raise ValueError(f"a billing period is YYYY-MM, not {period!r}")
    base = "/".join(p for p in (prefix.strip("/"), export_name.strip("/")) if p)
    folder = f"{base}/metadata/BILLING_PERIOD={period}/"
    key = _manifest_key(client, bucket, folder, export_name.strip("/"))
    where = f"s3://{bucket}/{key}"
    manifest = _manifest(_get(client, bucket, key, where), where)
    files = _data_files(manifest, bucket, where)
    for file_bucket, file_key in files:
        _check_inside(file_bucket, file_key, bucket, base, where)
    bound = MAX_FILE_BYTES if max_bytes is None else max_bytes
    with tempfile.TemporaryDirectory(prefix="cur2-") as tmp:
        for i, (file_bucket, file_key) in enumerate(files):
            uri = f"s3://{file_bucket}/{file_key}"
            local = Path(tmp) / f"part-{i}"
            body = _get(client, file_bucket, file_key, uri, listed=True)
            with local.open("wb") as out:
                _copy(body, out, bound, uri)
            yield from iter_cur2_lines(open_rows(local, uri, bound), period)
            local.unlink()


@dataclass(frozen=True)
class Cur2S3Source:
    """A CUR 2.0 export (Data Exports) in S3: each billing period's delivery read whole
    through its manifest (`read_cur2_s3`)."""

    NEEDS: ClassVar[tuple[str, ...]] = ("bucket", "export_name")
    bucket: str
    prefix: str
    export_name: str
    credentials: Any = None
    """`prefect_aws.AwsCredentials` (its client parameters, an endpoint too); None: the
    default chain."""

    @classmethod
    def from_export(cls, export: Any) -> Cur2S3Source:
        return cls(
            str(export.bucket), export.prefix, str(export.export_name), export.aws_credentials
        )

    def where(self) -> str:
        parts = (f"s3://{self.bucket}", self.prefix.strip("/"), self.export_name)
        return "/".join(p for p in parts if p)

    def read(self, periods: list[str]) -> dict[tuple[str, str], list[BillLine]]:
        """Each of `periods` (`YYYY-MM`) read whole, an empty one included."""
        client = self._client()
        return {
            (SOURCE, p): read_cur2_s3(client, self.bucket, self.prefix, self.export_name, p)
            for p in periods
        }

    def stream(self, periods: list[str]) -> list[BillRead]:
        """Each of `periods` (`YYYY-MM`) as a read of its own, line by line, an empty one
        included."""
        client = self._client()
        return [
            BillRead(
                stream_cur2_s3(client, self.bucket, self.prefix, self.export_name, p),
                ((SOURCE, p),),
            )
            for p in periods
        ]

    def _client(self) -> Any:
        from prefect_aws import AwsCredentials

        return (self.credentials or AwsCredentials()).get_client("s3")


MANIFEST_BYTES = 16 << 20
"""The largest manifest read (16 MiB: a manifest lists file names, not data)."""


def _check_inside(file_bucket: str, key: str, bucket: str, base: str, where: str) -> None:
    """Refuse a listed object outside the export: another bucket, or not under its prefix."""
    uri = f"s3://{file_bucket}/{key}"
    parts = key.split("/")
    if (
        file_bucket != bucket
        or not key.startswith(f"{base}/")
        or any(part in (".", "..") for part in parts)
    ):
        raise BillError(where, f"lists {uri[:200]}, outside the export s3://{bucket}/{base}/")


def _copy(body: Any, out: Any, bound: int, where: str) -> None:
    """Copy an object's body in chunks, refusing it past `bound` bytes."""
    total = 0
    while chunk := body.read(1 << 20):
        total += len(chunk)
        if total > bound:
            raise BillError(where, f"holds past the bound of {bound} bytes")
        out.write(chunk)


def _client_error() -> type[Exception]:
    from botocore.exceptions import ClientError

    return ClientError


def _manifest_key(client: Any, bucket: str, folder: str, export_name: str) -> str:
    documented = f"{folder}{export_name}-Manifest.json"
    found: list[tuple[Any, str]] = []
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=folder):
            for entry in page.get("Contents", []):
                if entry["Key"] == documented:
                    return documented
                if entry["Key"].lower().endswith("manifest.json"):
                    found.append((entry["LastModified"], entry["Key"]))
    except _client_error() as exc:
        code = exc.response.get("Error", {}).get("Code", "error")
        raise BillError(f"s3://{bucket}/{folder}", f"cannot list: {code}") from None
    if not found:
        raise BillError(
            f"s3://{bucket}/{folder}", "no Manifest.json: this period is not delivered (yet)"
        )
    found.sort()
    if len(found) > 1 and found[-1][0] == found[-2][0]:
        keys = ", ".join(key for stamp, key in found if stamp == found[-1][0])
        raise BillError(f"s3://{bucket}/{folder}", f"several newest manifests: {keys}")
    return found[-1][1]


def _get(client: Any, bucket: str, key: str, where: str, listed: bool = False) -> Any:
    """The object's streaming body; `BillError` naming it if it is missing or unreadable."""
    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"]
    except _client_error() as exc:
        code = exc.response.get("Error", {}).get("Code", "error")
        if code in ("NoSuchKey", "404", "NoSuchBucket", "NotFound"):
            rule = "listed in the manifest but not in S3" if listed else "not in S3"
            raise BillError(where, f"{rule} ({code})") from None
        raise BillError(where, f"cannot read: {code}") from None


def _manifest(body: Any, where: str) -> Mapping[str, Any]:
    data = body.read(MANIFEST_BYTES + 1)
    if len(data) > MANIFEST_BYTES:
        raise BillError(where, f"a manifest past {MANIFEST_BYTES} bytes")
    try:
        manifest = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise BillError(where, "not a JSON manifest") from None
    if not isinstance(manifest, Mapping):
        raise BillError(where, "not a JSON manifest (not an object)")
    return manifest


def _data_files(manifest: Mapping[str, Any], bucket: str, where: str) -> list[tuple[str, str]]:
    """The (bucket, key) of each data file the manifest lists, in its order, each once."""
    if "dataFiles" in manifest:
        entries, home = manifest["dataFiles"], bucket
    elif "reportKeys" in manifest:
        entries, home = manifest["reportKeys"], manifest.get("bucket") or bucket
    else:
        raise BillError(where, "lists no data files (no dataFiles)")
    if not isinstance(entries, list) or not all(isinstance(e, str) and e for e in entries):
        raise BillError(where, "dataFiles is not a list of S3 URIs")
    files: list[tuple[str, str]] = []
    for entry in entries:
        if entry.startswith("s3://"):
            file_bucket, _, key = entry[len("s3://") :].partition("/")
            if not file_bucket or not key:
                raise BillError(where, f"not an S3 object URI: {entry[:80]!r}")
        else:
            file_bucket, key = home, entry.lstrip("/")
        if (file_bucket, key) not in files:
            files.append((file_bucket, key))
    return files
