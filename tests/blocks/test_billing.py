"""`BillingExport` (blocks/billing.py): an aws-cur2 block reads a period's delivery from S3
(moto in server mode) through its manifest with the credentials of its `AwsCredentials`, and
the import trues a real ledger up from it; a block missing what its kind needs is refused."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest
from pydantic import ValidationError

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.billing.imports import import_export
from prefect_gpu_budget.blocks import BillingExport
from tests.billing import fixtures
from tests.billing.test_cur2_s3 import EXPORT, PREFIX, _deliver
from tests.support.aws_server import AwsServer
from tests.support.jobs import ran_job

NOV = datetime(2026, 11, 1, tzinfo=timezone.utc).timestamp()


def test_an_aws_block_reads_its_delivery_from_s3_and_the_ledger_is_trued_up(
    ledger: Ledger, tmp_path: Path
) -> None:
    ledger.config.set_budget(
        BudgetRule("acme", period_budget_micro=100 * 10**6, period="month"), now=NOV + 3600
    )
    job = ran_job(
        ledger,
        "acme/nlp/a7",
        "2026-11-03T10:00:00Z",
        "2026-11-03T11:20:00Z",
        37.688,
        launcher="sagemaker:lab",  # the bill's cloud ran it
        instance_type="sagemaker:ml.p4d.24xlarge",
    )
    rows = fixtures.cur_rows()
    for row in rows:
        if row["resource_tags"]:
            row["resource_tags"] = {"user_gpu_budget_job": job}
    with AwsServer() as server:
        credentials = server.credentials("us-east-1")
        s3 = credentials.get_client("s3")
        s3.create_bucket(Bucket="lab-billing")
        body = fixtures.write_parquet(tmp_path / "part-0.parquet", rows).read_bytes()
        _deliver(s3, "lab-billing", {"part-0.parquet": body})
        block = BillingExport(
            kind="aws-cur2",
            bucket="lab-billing",
            prefix=PREFIX,
            export_name=EXPORT,
            aws_credentials=credentials,
            provisional_hours=0,
        )
        read = block.read(["2026-11"])
        [done] = import_export(block.source(), ["2026-11"], ledger.bills, block.provisional_hours)
    assert list(read) == [("aws-cur2", "2026-11")] and len(read["aws-cur2", "2026-11"]) == 5
    assert done.jobs_final == 1 and block.where() == f"s3://lab-billing/{PREFIX}/{EXPORT}"
    month = periods.bounds("month", "UTC", NOV)[0]
    assert ledger.views.period_settled("acme", month) == 45_251_000


@pytest.mark.parametrize(
    "fields, missing",
    [
        ({"kind": "aws-cur2", "bucket": "b"}, "export_name"),
        ({"kind": "gcp-billing"}, "table"),
        ({"kind": "file"}, "paths"),
    ],
)
def test_a_block_missing_what_its_kind_needs_is_refused(fields: dict, missing: str) -> None:
    with pytest.raises(ValidationError, match=missing):
        BillingExport(**fields)
