"""`refresh_aws` against a loopback AWS: moto's EC2 (spot history seeded) and the Price List
stand-in of tests/support/aws_server.py, through the real boto3 clients."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal

import pytest

from prefect_gpu_budget.pricing.aws import refresh_aws
from prefect_gpu_budget.pricing.catalog import SHIPPED, Catalog, read_price_file
from prefect_gpu_budget.units import BudgetInputError, usd_to_micro
from tests.support.aws_server import AwsServer, ec2_product, sagemaker_product

NOW = datetime.now(timezone.utc)


@pytest.fixture(scope="module")
def server() -> Iterator[AwsServer]:
    with AwsServer() as running:
        yield running


@pytest.fixture
def aws(server: AwsServer) -> Iterator[AwsServer]:
    yield server
    server.reset()


def _latest_per_zone_max(rows: list[tuple[str, str, str, datetime]], instance: str) -> Decimal:
    """The rule the refresh follows: each zone's latest price, then the highest zone."""
    latest: dict[str, tuple[datetime, str]] = {}
    for name, zone, price, when in rows:
        if name == instance and (zone not in latest or when > latest[zone][0]):
            latest[zone] = (when, price)
    return max(Decimal(price) for _, price in latest.values())


def test_refresh_reads_the_price_list_and_the_spot_history(aws: AwsServer) -> None:
    aws.behaviour.page_size = 2  # both APIs answer in several pages
    aws.add_products(
        "AmazonEC2",
        [
            ec2_product("g5.xlarge", "us-east-1", "1.0060000000"),
            ec2_product("g5.xlarge", "us-east-1", "1.8360000000", operating_system="Windows"),
            ec2_product("g5.xlarge", "us-east-1", "1.2070000000", tenancy="Dedicated"),
            ec2_product("g5.xlarge", "us-east-1", "1.0060000000", capacitystatus="UnusedCapacity"),
            ec2_product("g5.xlarge", "us-east-1", "2.4000000000", pre_installed_sw="SQL Std"),
            ec2_product("g5.xlarge", "us-west-2", "1.1100000000"),
            ec2_product("g6.xlarge", "us-east-1", "0.8048000000"),
        ],
    )
    aws.add_products(
        "AmazonSageMaker",
        [
            sagemaker_product("ml.g5.xlarge", "us-east-1", "1.2120000000"),
            sagemaker_product("ml.g5.xlarge", "us-east-1", "1.6100000000", usage="Host"),
            sagemaker_product("ml.g5.xlarge", "us-east-1", "1.4100000000", usage="Notebk"),
            sagemaker_product("ml.g5.xlarge", "us-west-2", "1.3000000000"),
        ],
    )
    history = [
        ("g5.xlarge", "us-east-1a", "0.4000", NOW - timedelta(hours=3)),
        ("g5.xlarge", "us-east-1a", "0.4500", NOW - timedelta(hours=1)),
        ("g5.xlarge", "us-east-1b", "0.5200", NOW - timedelta(hours=2)),
        ("g5.xlarge", "us-east-1c", "0.6100", NOW - timedelta(hours=5)),
        ("g5.xlarge", "us-east-1c", "0.3800", NOW - timedelta(minutes=30)),
        ("g6.xlarge", "us-east-1a", "0.9900", NOW - timedelta(minutes=5)),
    ]
    aws.seed_spot_prices("us-east-1", history)

    rows = refresh_aws(
        aws.credentials(), instance_types=["aws:g5.xlarge", "sagemaker:ml.g5.xlarge"]
    )

    by = {(r.key, r.provisioning): r for r in rows}
    assert sorted(by) == [
        ("aws:g5.xlarge", "on-demand"),
        ("aws:g5.xlarge", "spot"),
        ("sagemaker:ml.g5.xlarge", "on-demand"),
        ("sagemaker:ml.g5.xlarge", "spot"),
    ]
    assert by["aws:g5.xlarge", "on-demand"].usd_per_hour == Decimal("1.006")
    assert by["aws:g5.xlarge", "spot"].usd_per_hour == _latest_per_zone_max(history, "g5.xlarge")
    assert by["sagemaker:ml.g5.xlarge", "on-demand"].usd_per_hour == Decimal("1.212")
    assert by["sagemaker:ml.g5.xlarge", "spot"].usd_per_hour == Decimal("1.212")
    shipped = {(r.key, r.provisioning): r for r in read_price_file(SHIPPED)}
    for key, row in by.items():
        known = shipped[key[0], "on-demand"]
        assert (row.gpus, row.vcpu, row.memory_gib) == (known.gpus, known.vcpu, known.memory_gib)
        assert row.as_of == date.today() and row.verified and "us-east-1" in row.source
    assert "Price List" in by["aws:g5.xlarge", "on-demand"].source
    assert "spot price history" in by["aws:g5.xlarge", "spot"].source

    quote = Catalog(rows).quote("sagemaker:ml.g5.xlarge", 2, "spot")
    assert quote.rate_micro_per_hour == 2 * usd_to_micro(Decimal("1.212"))


def test_by_default_it_prices_the_shipped_aws_and_sagemaker_types(aws: AwsServer) -> None:
    shipped = [r for r in read_price_file(SHIPPED) if r.cloud in ("aws", "sagemaker")]
    keys = sorted({r.key for r in shipped})
    sizes = {r.key: r for r in shipped if r.provisioning == "on-demand"}
    seeded: dict[str, Decimal] = {}
    for n, key in enumerate(keys):
        cloud, _, name = key.partition(":")
        price = Decimal("0.5") + Decimal(n) / 8
        seeded[key] = price
        if cloud == "aws":
            size = sizes[key]
            product = ec2_product(
                name, "us-west-2", str(price), gpus=size.gpus, vcpu=size.vcpu, memory_gib=1
            )
            decoy = ec2_product(name, "us-east-1", str(price + 1))
            aws.add_products("AmazonEC2", [product, decoy])
        else:
            aws.add_products(
                "AmazonSageMaker",
                [
                    sagemaker_product(name, "us-west-2", str(price)),
                    sagemaker_product(name, "us-east-1", str(price + 1)),
                ],
            )
    aws.seed_spot_prices("us-west-2", [("p5.48xlarge", "us-west-2a", "30.5", NOW)])

    rows = refresh_aws(aws.credentials(), region="us-west-2")

    on_demand = {r.key: r for r in rows if r.provisioning == "on-demand"}
    assert sorted(on_demand) == keys
    for key, row in on_demand.items():
        assert row.usd_per_hour == seeded[key]
        assert row.memory_gib == sizes[key].memory_gib  # the shipped shape, not the product's
        assert "us-west-2" in row.source
    spot = {r.key: r.usd_per_hour for r in rows if r.provisioning == "spot"}
    sagemaker_keys = {k for k in keys if k.startswith("sagemaker:")}
    assert spot == {"aws:p5.48xlarge": Decimal("30.5"), **{k: seeded[k] for k in sagemaker_keys}}


def test_a_type_aws_does_not_price_gets_no_row(
    aws: AwsServer, caplog: pytest.LogCaptureFixture
) -> None:
    aws.add_products("AmazonEC2", [ec2_product("g5.xlarge", "us-east-1", "1.006")])
    aws.seed_spot_prices("us-east-1", [])
    with caplog.at_level(logging.WARNING, logger="prefect_gpu_budget.pricing.aws"):
        rows = refresh_aws(aws.credentials(), instance_types=["aws:g5.xlarge", "aws:p5.48xlarge"])
    assert [(r.key, r.provisioning) for r in rows] == [("aws:g5.xlarge", "on-demand")]
    assert "aws:p5.48xlarge" in caplog.text


@pytest.mark.parametrize("key", ["gcp:g2-standard-4", "sagemaker:g5.xlarge", "aws:ml.g5.xlarge"])
def test_a_key_outside_aws_is_a_one_line_error(aws: AwsServer, key: str) -> None:
    with pytest.raises(BudgetInputError) as raised:
        refresh_aws(aws.credentials(), instance_types=[key])
    assert "\n" not in str(raised.value) and key in str(raised.value)
