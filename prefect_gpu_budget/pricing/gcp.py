"""GCP machine prices from the Cloud Billing Catalog API.

Compute Engine bills a GPU machine as three SKUs: its GPUs, its vCPUs ("cores") and its memory,
each per hour, with one SKU per provisioning model. `refresh_gcp` reads the Compute Engine SKUs
of one region (through google-cloud-billing, with the credentials of a prefect-gcp
`GcpCredentials` block) and prices every GCP machine type of the catalog as
GPUs x GPU SKU + vCPU x core SKU + GiB x RAM SKU, keeping the machine's shape from the catalog:

- on-demand: `Nvidia L4 GPU running in Americas`, `G2 Instance Core running in Americas`;
- spot: `... GPU attached to Spot Preemptible VMs ...`, `Spot Preemptible G2 Instance Core ...`;
- flex-start (Dynamic Workload Scheduler): `... GPU attached to DWS Defined Duration VMs ...`,
  `DWS Defined Duration A2 Core ...`.

A4 (B200) machines are billed per GPU slice instead: one SKU per GPU that includes its share of
the machine's vCPU and memory (`A4 Nvidia B200 (1 gpu slice) running in Americas`, with the
`Spot Preemptible ` and `DWS Defined Duration ` prefixes), and no core or RAM SKUs.

A provisioning model gets a row only when all of its SKUs are published for the region.
These are Compute Engine prices: Vertex AI training bills the same machines under its own
(Vertex AI service) SKUs.

google-cloud-billing comes with the `vertex` extra and is imported when prices are read.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from datetime import date
from decimal import ROUND_UP, Decimal
from types import ModuleType
from typing import TYPE_CHECKING

from google.api_core import exceptions as api_errors

from prefect_gpu_budget.extras import MissingExtra
from prefect_gpu_budget.pricing.catalog import Catalog, PriceRow, cached_file_rows

if TYPE_CHECKING:
    from google.cloud import billing_v1
    from google.cloud.billing_v1 import Sku
    from prefect_gcp import GcpCredentials

log = logging.getLogger("prefect_gpu_budget.pricing")

COMPUTE_ENGINE = "Compute Engine"

GPU_SKU_NAMES = {
    "L4 24GB": "L4",
    "A100 40GB": "A100",
    "A100 80GB": "A100 80GB",
    "H100 80GB": "H100 80GB",
    "H200 141GB": "H200 141GB",
    "B200 180GB": "B200",
}
"""Catalog GPU model -> its name in SKU descriptions (after an optional `Nvidia Tesla`)."""

HOST_SKU_FAMILIES: dict[str, tuple[str, ...]] = {
    "g2-standard": ("G2",),
    "a2-highgpu": ("A2",),
    "a2-ultragpu": ("A2",),
    "a3-highgpu": ("A3",),
    "a3-ultragpu": ("A3 Ultra", "A3Ultra"),
    "a4-highgpu": ("A4",),
}
"""Machine family -> the family names its SKUs carry (A3 Ultra is also spelt `A3Ultra`)."""

SLICE_FAMILIES = frozenset({"a4-highgpu"})
"""Families billed per GPU slice: one SKU per GPU, vCPU and memory included."""

_GPU = r"^(?:Nvidia )?(?:Tesla )?{gpu} GPU "
_SLICE = r"^{prefix}{host} (?:Nvidia )?{gpu} \(1 gpu slice\) running in "
SLICE_PREFIXES = {
    "on-demand": "",
    "spot": "Spot Preemptible ",
    "flex-start": "DWS Defined Duration ",
}
"""Provisioning -> the words before a slice SKU's family name."""
PATTERNS = {
    "on-demand": (
        _GPU + r"(?:attached to VMs )?running in ",
        r"^{host} Instance {part} running in ",
    ),
    "spot": (
        _GPU + r"attached to Spot Preemptible VMs running in ",
        r"^Spot Preemptible {host} Instance {part} running in ",
    ),
    "flex-start": (
        _GPU + r"attached to DWS Defined Duration VMs running in ",
        r"^DWS Defined Duration {host} (?:Instance )?{part} running in ",
    ),
}
"""Provisioning -> (GPU SKU, core/RAM SKU) description patterns."""
UNITS = {"gpu": "h", "Core": "h", "Ram": "GiBy.h"}


class PriceRefreshError(RuntimeError):
    """The catalog could not be read; the message is one line."""


def _sdk() -> ModuleType:
    """google-cloud-billing's catalog client, or a one-line error naming the extra."""
    try:
        from google.cloud import billing_v1
    except ImportError as exc:
        raise MissingExtra(
            "the GCP price refresh", "vertex", name="google.cloud.billing_v1"
        ) from exc
    return billing_v1


def _usd_per_unit(sku: Sku) -> Decimal | None:
    """The SKU's current first-tier price per usage unit, in USD."""
    if not sku.pricing_info:
        return None
    expression = sku.pricing_info[-1].pricing_expression
    tiers = [t for t in expression.tiered_rates if t.start_usage_amount == 0]
    if not tiers or expression.display_quantity not in (0, 1):
        return None
    price = tiers[0].unit_price
    if price.currency_code and price.currency_code != "USD":
        return None
    return Decimal(price.units) + Decimal(price.nanos) / Decimal(10**9)


def _find(skus: list[Sku], pattern: str, unit: str) -> Decimal | None:
    regex = re.compile(pattern)
    found = [
        _usd_per_unit(s)
        for s in skus
        if regex.match(s.description)
        and s.pricing_info
        and s.pricing_info[-1].pricing_expression.usage_unit == unit
        and not s.category.usage_type.startswith("Commit")
    ]
    prices = {p for p in found if p is not None}
    if len(prices) > 1:
        log.warning("SKUs matching %r disagree (%s); taking the highest", pattern, sorted(prices))
    return max(prices) if prices else None


def price_machine(row: PriceRow, provisioning: str, skus: list[Sku]) -> Decimal | None:
    """The hourly price of `row`'s machine shape under `provisioning`, or None if a SKU is
    missing."""
    gpu = GPU_SKU_NAMES.get(row.gpu_model)
    family = row.instance_type.rsplit("-", 1)[0]
    names = HOST_SKU_FAMILIES.get(family)
    if gpu is None or names is None:
        return None
    host = "(?:" + "|".join(re.escape(name) for name in names) + ")"
    gpu_pattern, host_pattern = PATTERNS[provisioning]
    if family in SLICE_FAMILIES:
        slice_pattern = _SLICE.format(
            prefix=re.escape(SLICE_PREFIXES[provisioning]), host=host, gpu=re.escape(gpu)
        )
        parts = {"gpu": (slice_pattern, row.gpus)}
    else:
        parts = {
            "gpu": (gpu_pattern.format(gpu=re.escape(gpu)), row.gpus),
            "Core": (host_pattern.format(host=host, part="Core"), row.vcpu),
            "Ram": (host_pattern.format(host=host, part="Ram"), row.memory_gib),
        }
    total = Decimal(0)
    for part, (pattern, quantity) in parts.items():
        unit_price = _find(skus, pattern, UNITS[part])
        if unit_price is None:
            return None
        total += unit_price * quantity
    return total.quantize(Decimal("0.000001"), rounding=ROUND_UP)


def _client(credentials: GcpCredentials, api_endpoint: str | None) -> billing_v1.CloudCatalogClient:
    billing_v1 = _sdk()
    return billing_v1.CloudCatalogClient(
        credentials=credentials.get_credentials_from_service_account(),
        transport="rest",
        client_options={"api_endpoint": api_endpoint} if api_endpoint else None,
    )


def compute_engine_skus(
    credentials: GcpCredentials, region: str, api_endpoint: str | None = None
) -> list[Sku]:
    """Every Compute Engine SKU sold in `region`, priced in USD."""
    client = _client(credentials, api_endpoint)
    try:
        service = next(
            (s for s in client.list_services() if s.display_name == COMPUTE_ENGINE), None
        )
        if service is None:
            raise PriceRefreshError(f"the billing catalog lists no {COMPUTE_ENGINE} service")
        pages = client.list_skus(
            request={"parent": service.name, "currency_code": "USD", "page_size": 5000}
        )
        return [s for s in pages if region in s.service_regions]
    except api_errors.GoogleAPICallError as exc:
        message = " ".join(str(exc.message).split())
        raise PriceRefreshError(f"Cloud Billing Catalog API: {message}") from None


def refresh_gcp(
    credentials: GcpCredentials,
    *,
    region: str = "us-central1",
    machines: Iterable[PriceRow] | None = None,
    api_endpoint: str | None = None,
    today: date | None = None,
) -> list[PriceRow]:
    """Fresh on-demand, spot and flex-start rows for GCP machine types, from the billing catalog.

    `machines` gives the shapes to price (GPUs, vCPU, memory); by default every `gcp` machine
    type in the catalog. A machine type with no SKUs for some provisioning gets no row for it.
    """
    shapes: dict[str, PriceRow] = {}
    for row in machines if machines is not None else Catalog([*cached_file_rows()]).rows():
        if row.cloud == "gcp":
            shapes.setdefault(row.instance_type, row)
    skus = compute_engine_skus(credentials, region, api_endpoint)
    as_of = today or date.today()
    rows = []
    for shape in shapes.values():
        for provisioning in PATTERNS:
            price = price_machine(shape, provisioning, skus)
            if price is None:
                log.info("no %s SKUs for %s in %s", provisioning, shape.key, region)
                continue
            rows.append(
                PriceRow(
                    cloud="gcp",
                    instance_type=shape.instance_type,
                    provisioning=provisioning,
                    gpu_model=shape.gpu_model,
                    gpus=shape.gpus,
                    vcpu=shape.vcpu,
                    memory_gib=shape.memory_gib,
                    usd_per_hour=price,
                    source=f"GCP Cloud Billing Catalog API, Compute Engine SKUs, {region}",
                    as_of=as_of,
                    verified=True,
                )
            )
    return rows
