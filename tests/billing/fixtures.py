"""Bill fixtures written at test time: the CUR 2.0 rows and GCP export rows of the billing
reference (documented column names, made-up amounts), in each format a reader takes."""

from __future__ import annotations

import csv
import gzip
import io
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

ARN = "arn:aws:sagemaker:us-east-1:111111111111:training-job/sweep-20261103-100001-a1b2c3"
UNTAGGED_ARN = "arn:aws:sagemaker:us-east-1:111111111111:training-job/untagged-job"
AWS_JOB = "7f1c2d3e-0000-4000-8000-000000000001"
GCP_JOB = "9a0d1e2f-0000-4000-8000-000000000002"


def _t(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _row(
    item: str,
    kind: str,
    start: str,
    end: str,
    resource: str | None,
    usage_type: str,
    amount: float,
    cost: float,
    tags: dict[str, str],
) -> dict[str, Any]:
    return {
        "identity_line_item_id": item,
        "identity_time_interval": f"{start}/{end}",
        "bill_billing_period_start_date": _t("2026-11-01T00:00:00Z"),
        "line_item_line_item_type": kind,
        "line_item_usage_start_date": _t(start),
        "line_item_usage_end_date": _t(end),
        "line_item_resource_id": resource,
        "line_item_usage_type": usage_type,
        "line_item_usage_amount": amount,
        "line_item_currency_code": "USD",
        "line_item_unblended_cost": cost,
        "line_item_net_unblended_cost": cost,
        "product_servicecode": "AmazonSageMaker",
        "resource_tags": tags,
    }


def cur_rows() -> list[dict[str, Any]]:
    """The reference's five CUR 2.0 rows: two tagged training hours, a credit on the same job,
    the month's tax, an untagged job. Dates as datetimes, tags as dicts."""
    tag = {"user_gpu_budget_job": AWS_JOB}
    train = "USE1-Train:ml.p4d.24xlarge"
    h10, h11, m20 = "2026-11-03T10:00:00Z", "2026-11-03T11:00:00Z", "2026-11-03T11:20:00Z"
    return [
        _row("li-001", "Usage", h10, h11, ARN, train, 1.0, 37.688, tag),
        _row("li-002", "Usage", h11, m20, ARN, train, 0.3333, 12.563, tag),
        _row("li-003", "Credit", h10, m20, ARN, train, 0.0, -5.0, tag),
        _row(
            "li-004", "Tax", "2026-11-01T00:00:00Z", "2026-12-01T00:00:00Z", None, "Tax", 0, 4.1, {}
        ),
        _row(
            "li-005",
            "Usage",
            "2026-11-04T09:00:00Z",
            "2026-11-04T10:00:00Z",
            UNTAGGED_ARN,
            "USE1-Train:ml.g5.xlarge",
            1.0,
            1.4084,
            {},
        ),
    ]


def cur_table(rows: list[dict[str, Any]]) -> pa.Table:
    """The rows as CUR 2.0 Parquet types: timestamps, doubles, `resource_tags` a string map."""
    columns = list(rows[0])
    types = {
        "bill_billing_period_start_date": pa.timestamp("ms"),
        "line_item_usage_start_date": pa.timestamp("ms"),
        "line_item_usage_end_date": pa.timestamp("ms"),
        "line_item_usage_amount": pa.float64(),
        "line_item_unblended_cost": pa.float64(),
        "line_item_net_unblended_cost": pa.float64(),
        "resource_tags": pa.map_(pa.string(), pa.string()),
    }
    arrays = {}
    for column in columns:
        values = [r.get(column) for r in rows]
        if column == "resource_tags":
            values = [None if v is None else list(v.items()) for v in values]
        elif types.get(column, pa.string()) == pa.timestamp("ms"):
            values = [None if v is None else v.replace(tzinfo=None) for v in values]
        arrays[column] = pa.array(values, type=types.get(column, pa.string()))
    return pa.table(arrays)


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(cur_table(rows), path, compression="snappy")
    return path


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, datetime):
        return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def csv_text(rows: list[dict[str, Any]]) -> str:
    """CSV as a CUR 2.0 gzip CSV holds it: a header, ISO dates, tags as a JSON object."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(list(rows[0]))
    for row in rows:
        writer.writerow([_cell(v) for v in row.values()])
    return out.getvalue()


def write_csv(path: Path, rows: list[dict[str, Any]], zipped: bool = False) -> Path:
    data = csv_text(rows).encode()
    path.write_bytes(gzip.compress(data) if zipped else data)
    return path


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text(
        "".join(
            json.dumps({k: _cell(v) if isinstance(v, datetime) else v for k, v in r.items()}) + "\n"
            for r in rows
        )
    )
    return path


GCP_LINES = [
    '{"invoice":{"month":"202611"},"service":{"description":"Vertex AI"},"sku":{"id":"FIXT-0001","description":"(fixture) Vertex training A100 GPU"},"usage_start_time":"2026-11-03T10:00:00Z","usage_end_time":"2026-11-03T11:00:00Z","project":{"id":"lab-prj"},"labels":[{"key":"managed-by","value":"prefect-gpu-budget"},{"key":"gpu-budget-job","value":"'
    + GCP_JOB
    + '"}],"cost":3.52,"currency":"USD","cost_type":"regular","credits":[{"name":"Spot discount","amount":-1.10,"type":"DISCOUNT"}],"export_time":"2026-11-03T20:14:00Z","resource":{"name":null,"global_name":null}}',
    '{"invoice":{"month":"202611"},"service":{"description":"Vertex AI"},"sku":{"id":"FIXT-0002","description":"(fixture) Vertex training a2-highgpu-1g core"},"usage_start_time":"2026-11-03T10:00:00Z","usage_end_time":"2026-11-03T11:00:00Z","project":{"id":"lab-prj"},"labels":[{"key":"gpu-budget-job","value":"'
    + GCP_JOB
    + '"}],"cost":0.41,"currency":"USD","cost_type":"regular","credits":[],"export_time":"2026-11-03T20:14:00Z"}',
    '{"invoice":{"month":"202611"},"service":{"description":"Vertex AI"},"sku":{"id":"FIXT-0001","description":"(fixture) Vertex training A100 GPU"},"usage_start_time":"2026-11-03T10:00:00Z","usage_end_time":"2026-11-03T11:00:00Z","project":{"id":"lab-prj"},"labels":[],"cost":0.0,"currency":"USD","cost_type":"tax","credits":[],"export_time":"2026-11-04T02:00:00Z"}',
]
"""The reference's three GCP detailed-export rows, nested as BigQuery returns them: an A100
hour with a spot credit and the job label, the machine's core hour, and a tax row."""


def gcp_rows() -> list[dict[str, Any]]:
    return [json.loads(line) for line in GCP_LINES]


def write_gcp_jsonl(path: Path, rows: list[dict[str, Any]] | None = None) -> Path:
    lines = GCP_LINES if rows is None else [json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


GCP_SCHEMA = pa.schema(
    [
        ("billing_account_id", pa.string()),
        ("invoice", pa.struct([("month", pa.string())])),
        ("service", pa.struct([("id", pa.string()), ("description", pa.string())])),
        ("sku", pa.struct([("id", pa.string()), ("description", pa.string())])),
        ("usage_start_time", pa.timestamp("us", tz="UTC")),
        ("usage_end_time", pa.timestamp("us", tz="UTC")),
        ("project", pa.struct([("id", pa.string())])),
        ("labels", pa.list_(pa.struct([("key", pa.string()), ("value", pa.string())]))),
        ("cost", pa.float64()),
        ("currency", pa.string()),
        ("cost_type", pa.string()),
        (
            "credits",
            pa.list_(
                pa.struct([("name", pa.string()), ("amount", pa.float64()), ("type", pa.string())])
            ),
        ),
        ("export_time", pa.timestamp("us", tz="UTC")),
        ("resource", pa.struct([("name", pa.string()), ("global_name", pa.string())])),
    ]
)
"""The nested fields as a Parquet copy of the BigQuery table holds them."""


def with_times(row: dict[str, Any]) -> dict[str, Any]:
    """A JSON row with its times as datetimes, as BigQuery's client and Parquet give them."""
    out = dict(row)
    for field in ("usage_start_time", "usage_end_time", "export_time"):
        if isinstance(out.get(field), str):
            out[field] = _t(out[field])
    return out


def write_gcp_parquet(path: Path, rows: list[dict[str, Any]] | None = None) -> Path:
    rows = gcp_rows() if rows is None else rows
    pq.write_table(pa.Table.from_pylist([with_times(r) for r in rows], schema=GCP_SCHEMA), path)
    return path


HOUR = 3600.0
SAGEMAKER_JOB = {"launcher": "sagemaker:lab", "instance_type": "sagemaker:ml.g5.xlarge"}
VERTEX_JOB = {"launcher": "vertex:lab", "instance_type": "gcp:a2-highgpu-1g"}


def settled_job(ledger: Any, scope: str, start: float, hours: float, **job: Any) -> dict:
    """A job of `scope` (a SageMaker one unless told) that ran `hours` from `start` at $3.60
    an hour for at most 4 hours, settled as its launcher would settle it."""
    from tests.support.jobs import new_job

    job = {**SAGEMAKER_JOB, "max_runtime_s": 4 * HOUR, **job}
    external_id = job.pop("external_id", None)
    job_id, decision = ledger.queue.request(new_job(scope, **job), now=start - 1)
    assert decision.verdict == "admit", decision
    assert ledger.settlements.mark_started(job_id, start, external_id)
    row = ledger.settlements.settle(
        job_id,
        ended_at=start + hours * HOUR,
        outcome="completed",
        scope=scope,
        now=start + hours * HOUR,
    )
    assert row is not None
    return row


def bill_line(job_id: str | None, start: float, hours: float, usd: str, **kw: Any) -> Any:
    """A CUR 2.0 line (unless told) of `job_id` for `hours` from `start`, billing `usd`."""
    from prefect_gpu_budget.billing.lines import BillLine
    from prefect_gpu_budget.billing.trueup import month_of

    fields = {
        "source": "aws-cur2",
        "billing_period": month_of(start),
        "line_id": f"{job_id}-{start}-{usd}",
        "line_type": "Usage",
        "usage_start": start,
        "usage_end": start + hours * HOUR,
        "billed_micro": round(float(usd) * 1_000_000),
        "currency": "USD",
        "job_mark": job_id,
    }
    return BillLine(**{**fields, **kw})
