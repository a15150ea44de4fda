"""`prefect-gpu-budget prices refresh --aws`: a dated catalog over the shipped one, the changes
printed, and quotes that use it (through a saved AwsCredentials block and loopback AWS)."""

from __future__ import annotations

from datetime import date, datetime, timedelta, timezone
from decimal import Decimal

from typer.testing import CliRunner

from prefect_gpu_budget.admission.prices import default_catalog
from prefect_gpu_budget.cli import app
from prefect_gpu_budget.pricing.catalog import Catalog
from tests.support.aws_server import AwsServer, ec2_product


def test_refresh_writes_a_dated_catalog_and_says_what_changed(prefect_api, tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_GPU_BUDGET_CATALOG_DIR", str(tmp_path / "catalogs"))
    monkeypatch.setenv("PREFECT_GPU_BUDGET_PRICES", str(tmp_path / "none.csv"))
    default_catalog.cache_clear()
    before = Catalog.load().row("aws:g5.xlarge").usd_per_hour
    with AwsServer() as aws:
        aws.add_products("AmazonEC2", [ec2_product("g5.xlarge", "us-east-1", "1.2000000000")])
        aws.seed_spot_prices(
            "us-east-1",
            [
                (
                    "g5.xlarge",
                    "us-east-1a",
                    "0.5000",
                    datetime.now(timezone.utc) - timedelta(hours=1),
                )
            ],
        )
        aws.credentials().save("loopback-aws", overwrite=True)
        result = CliRunner().invoke(
            app, ["prices", "refresh", "--aws", "--aws-credentials", "loopback-aws"]
        )
    assert result.exit_code == 0, result.output
    assert f"aws:g5.xlarge (on-demand): ${before}/h -> $1.2/h" in result.output
    written = tmp_path / "catalogs" / f"catalog-{date.today().isoformat()}.csv"
    assert written.exists() and str(written) in result.output.replace("\n", "")
    default_catalog.cache_clear()
    fresh = Catalog.load()
    assert fresh.row("aws:g5.xlarge").usd_per_hour == Decimal("1.2")
    assert fresh.row("aws:g5.xlarge", "spot").usd_per_hour == Decimal("0.5")
    assert not fresh.quote("aws:g5.xlarge").warnings  # dated today and read from the API
    assert fresh.row("gcp:g2-standard-4").usd_per_hour > 0  # rows it did not read stay
    default_catalog.cache_clear()


def test_refresh_without_a_cloud_is_a_one_line_error():
    result = CliRunner().invoke(app, ["prices", "refresh"])
    assert result.exit_code == 2 and "choose --aws and/or --gcp" in result.output
