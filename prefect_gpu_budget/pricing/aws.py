"""Refresh AWS prices: the Price List API (EC2 and SageMaker training) and EC2 spot history.

On-demand EC2 prices come from `GetProducts` for `AmazonEC2`, filtered to one product per type:
shared tenancy, Linux, no pre-installed software, capacity status `Used`, in the region
(`regionCode`). SageMaker training prices come from `AmazonSageMaker` products whose usage type is
`<region prefix>-Train:<instance>`. SageMaker managed spot has no price of its own: it bills the
on-demand rate for fewer billable seconds, so its spot row repeats the on-demand price. EC2 spot
rows take the latest price in each availability zone from DescribeSpotPriceHistory and keep the
highest, so a quote is never below what a zone charges.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from datetime import date, datetime, timezone
from decimal import Decimal
from typing import Any

import boto3
from prefect_aws import AwsCredentials

from prefect_gpu_budget.pricing.catalog import SHIPPED, PriceRow, read_price_file
from prefect_gpu_budget.units import BudgetInputError, shown, to_decimal_usd

log = logging.getLogger("prefect_gpu_budget.pricing.aws")

PRICE_LIST_REGION = "us-east-1"
"""The Price List API answers from us-east-1 (and a few others) for every region's prices."""
CLOUDS = ("aws", "sagemaker")
SPOT_PRODUCTS = ["Linux/UNIX", "Linux/UNIX (Amazon VPC)"]
_TRAIN_USAGE = re.compile(r"(^|-)Train:(?P<instance>ml\.[\w.\-]+)$")
_MEMORY = re.compile(r"([\d.,]+)\s*GiB")


def _client(source: AwsCredentials | boto3.Session, service: str, region: str) -> Any:
    """A client for `service` in `region`, keeping the block's client parameters (endpoint_url)."""
    if isinstance(source, AwsCredentials):
        params = source.aws_client_parameters.get_params_override()
        params["region_name"] = region
        return source.get_boto3_session().client(service, **params)
    return source.client(service, region_name=region)


def _wanted(instance_types: Iterable[str] | None, shipped: dict[str, PriceRow]) -> list[str]:
    if instance_types is None:
        return sorted(shipped)
    keys = []
    for key in instance_types:
        cloud, _, name = key.partition(":")
        if cloud not in CLOUDS or not name or (cloud == "sagemaker") != name.startswith("ml."):
            raise BudgetInputError(
                "instance_types",
                f"must be 'aws:<type>' or 'sagemaker:ml.<type>', got {shown(key)}",
            )
        keys.append(key)
    return sorted(set(keys))


def _products(pricing: Any, service: str, filters: dict[str, str]) -> list[dict[str, Any]]:
    pages = pricing.get_paginator("get_products").paginate(
        ServiceCode=service,
        FormatVersion="aws_v1",
        Filters=[{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in filters.items()],
    )
    return [json.loads(item) for page in pages for item in page["PriceList"]]


def _usd(text: object, field: str) -> Decimal:
    """A Price List amount like `1.0060000000` as a plain Decimal (`1.006`)."""
    return Decimal(format(to_decimal_usd(text, field).normalize(), "f"))


def _on_demand_usd(product: dict[str, Any]) -> Decimal | None:
    """The hourly USD price of a product's OnDemand term (the highest if it has several)."""
    prices = [
        _usd(dim["pricePerUnit"]["USD"], "pricePerUnit")
        for term in product.get("terms", {}).get("OnDemand", {}).values()
        for dim in term.get("priceDimensions", {}).values()
        if dim.get("unit") == "Hrs" and "USD" in dim.get("pricePerUnit", {})
    ]
    prices = [p for p in prices if p > 0]
    return max(prices) if prices else None


def _shape(attributes: dict[str, str], known: PriceRow | None) -> tuple[str, int, int, int]:
    """gpu model, gpus, vcpu, memory GiB: from the shipped row, else from the product."""
    if known is not None:
        return known.gpu_model, known.gpus, known.vcpu, known.memory_gib

    def number(text: str | None) -> int:
        try:
            return int(float((text or "0").replace(",", "")))
        except ValueError:
            return 0

    memory = _MEMORY.search(attributes.get("memory", ""))
    return (
        "",
        number(attributes.get("gpu")),
        number(attributes.get("vcpu") or attributes.get("vCpu")),
        number(memory.group(1)) if memory else 0,
    )


def refresh_aws(
    source: AwsCredentials | boto3.Session,
    *,
    region: str = "us-east-1",
    instance_types: Iterable[str] | None = None,
    today: date | None = None,
) -> list[PriceRow]:
    """Price rows for `aws:` and `sagemaker:` instance types in `region`, read from AWS.

    `instance_types` are catalog keys like `aws:g5.xlarge` or `sagemaker:ml.g5.xlarge`; by default
    every aws and sagemaker type in the shipped catalog. A type that AWS does not price in the
    region gets no row (and a warning in the log).
    """
    shipped_rows = [row for row in read_price_file(SHIPPED) if row.cloud in CLOUDS]
    shipped = {row.key: row for row in shipped_rows}
    keys = _wanted(instance_types, shipped)
    today = today or date.today()
    pricing = _client(source, "pricing", PRICE_LIST_REGION)
    rows: list[PriceRow] = []

    def row(key: str, provisioning: str, usd: Decimal, source_note: str, attrs: dict) -> PriceRow:
        cloud, _, name = key.partition(":")
        known = shipped.get(key)
        gpu_model, gpus, vcpu, memory = _shape(attrs, known)
        return PriceRow(
            cloud, name, provisioning, gpu_model, gpus, vcpu, memory, usd, source_note, today, True
        )

    for key in keys:
        cloud, _, name = key.partition(":")
        found = _listed(pricing, cloud, name, region)
        priced = [(usd, p) for p in found if (usd := _on_demand_usd(p)) is not None]
        if not priced:
            log.warning("no on-demand price for %s in %s in the Price List", key, region)
            continue
        usd, product = max(priced, key=lambda pair: pair[0])
        attributes = product["product"].get("attributes", {})
        service = "AmazonEC2" if cloud == "aws" else "AmazonSageMaker"
        note = f"AWS Price List API {service} {region}"
        rows.append(row(key, "on-demand", usd, note, attributes))
        if cloud == "sagemaker":
            spot_note = f"{note} on-demand rate: managed spot bills it for BillableTimeInSeconds"
            rows.append(row(key, "spot", usd, spot_note, attributes))

    ec2_types = [key.partition(":")[2] for key in keys if key.startswith("aws:")]
    for name, (usd, stamp) in sorted(_spot_prices(source, region, ec2_types).items()):
        note = f"EC2 spot price history {region} (highest zone at {stamp:%Y-%m-%dT%H:%MZ})"
        rows.append(row(f"aws:{name}", "spot", usd, note, {}))
    return rows


def _listed(pricing: Any, cloud: str, name: str, region: str) -> list[dict[str, Any]]:
    """The Price List's products of one instance type in `region`: EC2's Linux, shared, no
    software, used capacity; SageMaker's training usage of it."""
    if cloud == "aws":
        return _products(
            pricing,
            "AmazonEC2",
            {
                "instanceType": name,
                "regionCode": region,
                "operatingSystem": "Linux",
                "tenancy": "Shared",
                "preInstalledSw": "NA",
                "capacitystatus": "Used",
            },
        )
    return [
        p
        for p in _products(pricing, "AmazonSageMaker", {"instanceType": name, "regionCode": region})
        if _train_usage(p) == name
    ]


def _train_usage(product: dict[str, Any]) -> str | None:
    """The instance of a SageMaker training usage type (`USE1-Train:ml.g5.xlarge`), else None."""
    usage = product["product"].get("attributes", {}).get("usagetype", "")
    match = _TRAIN_USAGE.search(usage)
    return match.group("instance") if match else None


def _spot_prices(
    source: AwsCredentials | boto3.Session, region: str, instance_types: list[str]
) -> dict[str, tuple[Decimal, datetime]]:
    """The highest of the zones' current Linux spot prices, per instance type, with its time."""
    if not instance_types:
        return {}
    ec2 = _client(source, "ec2", region)
    pages = ec2.get_paginator("describe_spot_price_history").paginate(
        InstanceTypes=instance_types,
        ProductDescriptions=SPOT_PRODUCTS,
        StartTime=datetime.now(timezone.utc),
    )
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    for page in pages:
        for entry in page["SpotPriceHistory"]:
            zone_key = (entry["InstanceType"], entry["AvailabilityZone"])
            if zone_key not in latest or entry["Timestamp"] > latest[zone_key]["Timestamp"]:
                latest[zone_key] = entry
    prices: dict[str, tuple[Decimal, datetime]] = {}
    for (name, _zone), entry in latest.items():
        usd = _usd(entry["SpotPrice"], "SpotPrice")
        if name not in prices or usd > prices[name][0]:
            prices[name] = (usd, entry["Timestamp"].astimezone(timezone.utc))
    return prices
