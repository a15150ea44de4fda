"""`BillingExport`: where the cloud's own bill is read from, for `bill import` and the daily
import (`flows/bill_import.py`). Its `kind` names a source type (`billing.sources`), which it
builds from its fields (`source()`) and reads through."""

from __future__ import annotations

from typing import Literal

from prefect.blocks.core import Block
from prefect_aws import AwsCredentials
from prefect_gcp import GcpCredentials
from pydantic import Field, model_validator

from prefect_gpu_budget.billing.lines import BillLine
from prefect_gpu_budget.billing.sources import SOURCE_TYPES, BillSource, missing, source_for
from prefect_gpu_budget.billing.trueup import DEFAULT_PROVISIONAL_HOURS

KINDS = tuple(SOURCE_TYPES)
Kind = Literal[KINDS]  # type: ignore[valid-type]
"""Each kind of export `billing.sources` has a source type for."""


class BillingExport(Block):
    """A cloud's billing export: AWS Cost and Usage Report 2.0 (Data Exports) in S3, the GCP
    Cloud Billing detailed usage cost export in BigQuery, or local files in either schema."""

    _block_type_name = "GPU Billing Export"
    _block_type_slug = "gpu-billing-export"
    _logo_url = "https://raw.githubusercontent.com/PrefectHQ/prefect/main/docs/images/logos/prefect-logo-mark.png"  # noqa: E501
    _documentation_url = "https://github.com/prefect-gpu-budget/prefect-gpu-budget#readme"
    _description = "Where the cloud's bill is read from, to true the GPU spend ledger up."

    kind: Kind = Field(description=f"{', '.join(KINDS[:-1])} or {KINDS[-1]}.")
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
        needs = missing(self.kind, self)
        if needs:
            raise ValueError(f"a {self.kind} export needs {', '.join(needs)}")
        return self

    def source(self) -> BillSource:
        """The source of its kind, built from its fields."""
        return source_for(self.kind, self)

    def where(self) -> str:
        """Where it reads from, for people."""
        return self.source().where()

    def read(self, periods: list[str]) -> dict[tuple[str, str], list[BillLine]]:
        """Each billing period's lines as the export holds them now, by (source, period): for
        S3 and BigQuery, `periods` (`YYYY-MM`) each read whole (an empty one included); for
        files, whatever periods they hold."""
        return self.source().read(periods)
