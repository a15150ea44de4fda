"""`BillingExport`: where the cloud's own bill is read from, for `bill import` and the daily
import (`flows/bill_import.py`)."""

from __future__ import annotations

from typing import Literal

from prefect.blocks.core import Block
from prefect_aws import AwsCredentials
from prefect_gcp import GcpCredentials
from pydantic import Field, model_validator

from prefect_gpu_budget.billing.lines import BillLine
from prefect_gpu_budget.billing.trueup import DEFAULT_PROVISIONAL_HOURS

Kind = Literal["aws-cur2", "gcp-billing", "file"]


class BillingExport(Block):
    """A cloud's billing export: AWS Cost and Usage Report 2.0 (Data Exports) in S3, the GCP
    Cloud Billing detailed usage cost export in BigQuery, or local files in either schema."""

    _block_type_name = "GPU Billing Export"
    _block_type_slug = "gpu-billing-export"
    _logo_url = "https://raw.githubusercontent.com/PrefectHQ/prefect/main/docs/images/logos/prefect-logo-mark.png"  # noqa: E501
    _documentation_url = "https://github.com/prefect-gpu-budget/prefect-gpu-budget#readme"
    _description = "Where the cloud's bill is read from, to true the GPU spend ledger up."

    kind: Kind = Field(description="aws-cur2, gcp-billing or file.")
    bucket: str | None = Field(default=None, description="aws-cur2: the export's S3 bucket.")
    prefix: str = Field(default="", description="aws-cur2: the export's S3 path prefix.")
    export_name: str | None = Field(default=None, description="aws-cur2: the export's name.")
    aws_credentials: AwsCredentials | None = Field(
        default=None, description="aws-cur2: credentials that may read the bucket."
    )
    table: str | None = Field(
        default=None,
        description="gcp-billing: the detailed export table, project.dataset."
        "gcp_billing_export_resource_v1_<ACCOUNT> (or a view of it).",
    )
    gcp_credentials: GcpCredentials | None = Field(
        default=None, description="gcp-billing: credentials that may query the table."
    )
    paths: list[str] = Field(
        default_factory=list, description="file: Parquet, CSV, gzip CSV or JSON Lines files."
    )
    provisional_hours: float = Field(
        default=DEFAULT_PROVISIONAL_HOURS,
        ge=0,
        description="Lines whose usage ended less than this long ago move no budget yet.",
    )

    @model_validator(mode="after")
    def _complete(self) -> BillingExport:
        needs = {"aws-cur2": ("bucket", "export_name"), "gcp-billing": ("table",), "file": ()}
        missing = [name for name in needs[self.kind] if not getattr(self, name)]
        if missing:
            raise ValueError(f"a {self.kind} export needs {', '.join(missing)}")
        if self.kind == "file" and not self.paths:
            raise ValueError("a file export needs paths")
        return self

    def where(self) -> str:
        """Where it reads from, for people."""
        if self.kind == "aws-cur2":
            parts = (f"s3://{self.bucket}", self.prefix.strip("/"), str(self.export_name))
            return "/".join(p for p in parts if p)
        if self.kind == "gcp-billing":
            return f"bigquery:{self.table}"
        return ", ".join(self.paths)

    def read(self, periods: list[str]) -> dict[tuple[str, str], list[BillLine]]:
        """Each billing period's lines as the export holds them now, by (source, period): for
        S3 and BigQuery, `periods` (`YYYY-MM`) each read whole (an empty one included); for
        files, whatever periods they hold."""
        if self.kind == "file":
            from prefect_gpu_budget.billing.files import read_bill_files

            found: dict[tuple[str, str], list[BillLine]] = {}
            for line in read_bill_files(self.paths):
                found.setdefault((line.source, line.billing_period), []).append(line)
            return found
        if self.kind == "aws-cur2":
            from prefect_gpu_budget.billing.aws_cur2 import read_cur2_s3

            credentials = self.aws_credentials or AwsCredentials()
            client = credentials.get_client("s3")  # its client parameters: an endpoint too
            return {
                ("aws-cur2", p): read_cur2_s3(
                    client, str(self.bucket), self.prefix, str(self.export_name), p
                )
                for p in periods
            }
        from prefect_gpu_budget.billing.gcp_billing import read_gcp_bigquery

        client = (self.gcp_credentials or GcpCredentials()).get_bigquery_client()
        return {("gcp-billing", p): read_gcp_bigquery(client, str(self.table), p) for p in periods}
