"""`refresh_gcp` through the real google-cloud-billing client (REST transport), against a local
stand-in of the Cloud Billing Catalog API serving Compute Engine SKUs with real-world names.

The unit prices in PRICES are us-central1 list prices as published in the catalog; the A2 ones
reproduce the shipped catalog's a2-highgpu-1g rows (on-demand 3.673, flex-start 2.0204). Those in
STAND_IN are made-up figures for SKUs the shipped catalog has no price for: they test the SKU
names and the arithmetic, and are no prices of anything.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import date
from decimal import ROUND_UP, Decimal
from pathlib import Path

import pytest
from prefect_gcp import GcpCredentials

from prefect_gpu_budget.pricing.catalog import PROVISIONINGS, Catalog
from prefect_gpu_budget.pricing.gcp import PriceRefreshError, refresh_gcp
from prefect_gpu_budget.pricing.refresh import write_refresh
from prefect_gpu_budget.units import BudgetInputError, usd_to_micro
from tests.support.gcp_server import FakeBillingCatalog, service_account_info, serving, sku
from tests.support.without_extra import VERTEX_MODULES, run_without

# (description, USD per unit, usage type, unit, regions)
US = ("us-central1", "us-east1", "us-west1")
EU = ("europe-west4",)
PRICES = [
    ("Nvidia L4 GPU running in Americas", 0.5601, "OnDemand", "h", US),
    ("G2 Instance Core running in Americas", 0.024988, "OnDemand", "h", US),
    ("G2 Instance Ram running in Americas", 0.002927, "OnDemand", "GiBy.h", US),
    (
        "Nvidia L4 GPU attached to Spot Preemptible VMs running in Americas",
        0.224,
        "Preemptible",
        "h",
        US,
    ),
    ("Spot Preemptible G2 Instance Core running in Americas", 0.00995, "Preemptible", "h", US),
    ("Spot Preemptible G2 Instance Ram running in Americas", 0.001165, "Preemptible", "GiBy.h", US),
    ("Nvidia Tesla A100 GPU running in Americas", 2.93391, "OnDemand", "h", US),
    ("A2 Instance Core running in Americas", 0.031611, "OnDemand", "h", US),
    ("A2 Instance Ram running in Americas", 0.00424, "OnDemand", "GiBy.h", US),
    (
        "Nvidia Tesla A100 GPU attached to Spot Preemptible VMs running in Americas",
        1.5399,
        "Preemptible",
        "h",
        US,
    ),
    ("Spot Preemptible A2 Instance Core running in Americas", 0.01659, "Preemptible", "h", US),
    ("Spot Preemptible A2 Instance Ram running in Americas", 0.00222, "Preemptible", "GiBy.h", US),
    (
        "Nvidia Tesla A100 GPU attached to DWS Defined Duration VMs running in Americas",
        1.61365,
        "OnDemand",
        "h",
        US,
    ),
    ("DWS Defined Duration A2 Core running in Americas", 0.01739, "OnDemand", "h", US),
    ("DWS Defined Duration A2 Ram running in Americas", 0.00233, "OnDemand", "GiBy.h", US),
    ("Nvidia H100 80GB GPU running in Americas", 9.7966, "OnDemand", "h", US),
    ("A3 Instance Core running in Americas", 0.0291, "OnDemand", "h", US),
    ("A3 Instance Ram running in Americas", 0.00249, "OnDemand", "GiBy.h", US),
    (
        "Nvidia H100 80GB GPU attached to Spot Preemptible VMs running in Americas",
        2.25,
        "Preemptible",
        "h",
        US,
    ),
    ("Spot Preemptible A3 Instance Core running in Americas", 0.0087, "Preemptible", "h", US),
    ("Spot Preemptible A3 Instance Ram running in Americas", 0.00075, "Preemptible", "GiBy.h", US),
    # traps: another GPU whose name starts the same, commitments, reservations, other regions
    ("Nvidia Tesla A100 80GB GPU running in Americas", 3.92628, "OnDemand", "h", US),
    ("Commitment v1: A2 Cpu in Americas for 1 Year", 0.019915, "Commit1Yr", "h", US),
    ("Reserved Nvidia Tesla A100 GPU in Americas", 0.0, "OnDemand", "h", US),
    ("Sole Tenancy Instance Core running in Americas", 0.034, "OnDemand", "h", US),
    ("Nvidia Tesla A100 GPU running in Netherlands", 3.2268, "OnDemand", "h", EU),
    ("A2 Instance Core running in Netherlands", 0.03477, "OnDemand", "h", EU),
    ("A2 Instance Ram running in Netherlands", 0.00466, "OnDemand", "GiBy.h", EU),
]
P, D = "Preemptible", "OnDemand"  # Google tags DWS and the spot A4 slice OnDemand
STAND_IN = [
    ("Nvidia L4 GPU attached to DWS Defined Duration VMs running in Americas", 0.31, D, "h", US),
    ("DWS Defined Duration G2 Core running in Americas", 0.013, D, "h", US),
    ("DWS Defined Duration G2 Ram running in Americas", 0.0017, D, "GiBy.h", US),
    (
        "Nvidia Tesla A100 80GB GPU attached to Spot Preemptible VMs running in Americas",
        1.7,
        P,
        "h",
        US,
    ),
    (
        "Nvidia Tesla A100 80GB GPU attached to DWS Defined Duration VMs running in Americas",
        2.1,
        D,
        "h",
        US,
    ),
    (
        "Nvidia H100 80GB GPU attached to DWS Defined Duration VMs running in Americas",
        4.3,
        D,
        "h",
        US,
    ),
    ("DWS Defined Duration A3 Core running in Americas", 0.011, D, "h", US),
    ("DWS Defined Duration A3 Ram running in Americas", 0.00097, D, "GiBy.h", US),
    ("H200 141GB GPU running in Americas", 9.4, D, "h", US),
    ("A3 Ultra Instance Core running in Americas", 0.03, D, "h", US),
    ("A3 Ultra Instance Ram running in Americas", 0.0026, D, "GiBy.h", US),
    ("H200 141GB GPU attached to Spot Preemptible VMs running in Americas", 3.5, P, "h", US),
    ("Spot Preemptible A3 Ultra Instance Core running in Americas", 0.012, P, "h", US),
    ("Spot Preemptible A3 Ultra Instance Ram running in Americas", 0.001, P, "GiBy.h", US),
    (
        "H200 141GB GPU attached to DWS Defined Duration VMs running in Americas",
        4.6,
        D,
        "h",
        US,
    ),
    ("DWS Defined Duration A3Ultra Core running in Americas", 0.014, D, "h", US),
    ("DWS Defined Duration A3Ultra Ram running in Americas", 0.0012, D, "GiBy.h", US),
    # A4 is billed per GPU slice, vCPU and memory included: no core or RAM SKUs
    ("A4 Nvidia B200 (1 gpu slice) running in Americas", 16.5, D, "h", US),
    ("Spot Preemptible A4 Nvidia B200 (1 gpu slice) running in Americas", 5.1, D, "h", US),
    ("DWS Defined Duration A4 Nvidia B200 (1 gpu slice) running in Americas", 8.2, D, "h", US),
    # traps: a variant GPU, another A3 family, calendar mode and commitments of the slice
    ("Nvidia H100 80GB Plus GPU running in Americas", 10.5, D, "h", US),
    ("DWS Defined Duration A3 Mega Core running in Americas", 0.02, D, "h", US),
    ("DWS Calendar Mode A4 Nvidia B200 (1 gpu slice) running in Americas", 1.0, D, "h", US),
    (
        "Commitment v1: A4 Nvidia B200 (1 gpu slice) in Americas for 1 Year",
        2.0,
        "Commit1Yr",
        "h",
        US,
    ),
]
SKUS = PRICES + STAND_IN
PRICED = {
    # (machine, provisioning): the SKUs that price it, GPU then core then RAM
    ("g2-standard-4", "on-demand"): PRICES[0:3],
    ("g2-standard-4", "spot"): PRICES[3:6],
    ("g2-standard-4", "flex-start"): STAND_IN[0:3],
    ("a2-highgpu-1g", "on-demand"): PRICES[6:9],
    ("a2-highgpu-1g", "spot"): PRICES[9:12],
    ("a2-highgpu-1g", "flex-start"): PRICES[12:15],
    ("a2-ultragpu-1g", "on-demand"): [PRICES[21], *PRICES[7:9]],
    ("a2-ultragpu-1g", "spot"): [STAND_IN[3], *PRICES[10:12]],
    ("a2-ultragpu-1g", "flex-start"): [STAND_IN[4], *PRICES[13:15]],
    ("a3-highgpu-8g", "on-demand"): PRICES[15:18],
    ("a3-highgpu-8g", "spot"): PRICES[18:21],
    ("a3-highgpu-8g", "flex-start"): STAND_IN[5:8],
    ("a3-ultragpu-8g", "on-demand"): STAND_IN[8:11],
    ("a3-ultragpu-8g", "spot"): STAND_IN[11:14],
    ("a3-ultragpu-8g", "flex-start"): STAND_IN[14:17],
    ("a4-highgpu-8g", "on-demand"): STAND_IN[17:18],
    ("a4-highgpu-8g", "spot"): STAND_IN[18:19],
    ("a4-highgpu-8g", "flex-start"): STAND_IN[19:20],
}
FAMILIES = ("g2-standard", "a2-highgpu", "a2-ultragpu", "a3-highgpu", "a3-ultragpu", "a4-highgpu")


@pytest.fixture(scope="module")
def key() -> tuple[dict, str]:
    return service_account_info()


@pytest.fixture
def billing(key: tuple[dict, str]) -> Iterator[FakeBillingCatalog]:
    skus = [sku(d, usd, usage_type=t, unit=u, regions=r) for d, usd, t, u, r in SKUS]
    with serving(FakeBillingCatalog(skus, public_key=key[1], page_size=4)) as server:
        yield server


@pytest.fixture
def shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Catalog:
    monkeypatch.setenv("PREFECT_GPU_BUDGET_PRICES", str(tmp_path / "none.csv"))
    return Catalog.load()


def _expected(shipped: Catalog, machine: str, skus: list[tuple]) -> Decimal:
    shape = next(r for r in shipped.rows() if r.key == f"gcp:{machine}")
    quantities = (shape.gpus, shape.vcpu, shape.memory_gib)[: len(skus)]  # a slice: GPUs only
    total = sum(Decimal(str(s[1])) * q for s, q in zip(skus, quantities, strict=True))
    return total.quantize(Decimal("0.000001"), rounding=ROUND_UP)


def test_refresh_prices_every_gcp_machine_where_skus_exist(
    billing: FakeBillingCatalog, key: tuple[dict, str], shipped: Catalog
) -> None:
    credentials = GcpCredentials(service_account_info=key[0])
    rows = refresh_gcp(credentials, api_endpoint=billing.url)

    assert {(r.instance_type, r.provisioning) for r in rows} == set(PRICED)
    assert {(m.rsplit("-", 1)[0], p) for m, p in PRICED} == {
        (family, p) for family in FAMILIES for p in PROVISIONINGS
    }  # every family DWS names, flex-start included
    for row in rows:
        assert row.usd_per_hour == _expected(
            shipped, row.instance_type, PRICED[row.instance_type, row.provisioning]
        )
        shape = next(r for r in shipped.rows() if r.key == row.key)
        assert (row.gpu_model, row.gpus, row.vcpu, row.memory_gib) == (
            shape.gpu_model,
            shape.gpus,
            shape.vcpu,
            shape.memory_gib,
        )
        assert row.cloud == "gcp" and row.verified and row.as_of == date.today()
        assert "Cloud Billing Catalog API" in row.source and "us-central1" in row.source

    # published list prices reproduce the shipped snapshot rows
    fresh = {(r.instance_type, r.provisioning): r.usd_per_hour for r in rows}
    for provisioning in ("on-demand", "flex-start"):
        old = shipped.row("gcp:a2-highgpu-1g", provisioning).usd_per_hour
        assert abs(fresh["a2-highgpu-1g", provisioning] - old) < Decimal("0.001")

    sku_pages = [q for path, q in billing.requests if path.endswith("/skus")]
    assert len(sku_pages) == -(-len(SKUS) // 4)  # every page, token after token
    assert all(q["currencyCode"] == ["USD"] for q in sku_pages)
    assert set(billing.callers) == {key[0]["client_email"]}


def test_a_refresh_fills_the_rows_with_no_public_figure(
    billing: FakeBillingCatalog,
    key: tuple[dict, str],
    shipped: Catalog,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Shipped rows without a price are refused (flex-start: quoted at the on-demand price,
    an upper bound, where that has a figure) until `prices refresh --gcp` writes a dated
    catalog; from then on every family quotes flex-start at its DWS SKUs."""
    unpriced = [(m, p) for m, p in PRICED if not shipped.row(f"gcp:{m}", p).priced]
    assert ("a4-highgpu-8g", "flex-start") in unpriced and (
        "a3-highgpu-8g",
        "flex-start",
    ) in unpriced
    for machine, provisioning in unpriced:
        if shipped.bound_of(f"gcp:{machine}", provisioning) is not None:
            assert shipped.quote(f"gcp:{machine}", 1, provisioning).bound
            continue
        with pytest.raises(BudgetInputError, match="no public figure recorded"):
            shipped.quote(f"gcp:{machine}", 1, provisioning)

    monkeypatch.setenv("PREFECT_GPU_BUDGET_CATALOG_DIR", str(tmp_path / "catalogs"))
    rows = refresh_gcp(GcpCredentials(service_account_info=key[0]), api_endpoint=billing.url)
    write_refresh(shipped, rows)
    refreshed = Catalog.load()
    for machine, provisioning in PRICED:
        quote = refreshed.quote(f"gcp:{machine}", 2, provisioning)
        expected = _expected(shipped, machine, PRICED[machine, provisioning])
        assert quote.rate_micro_per_hour == 2 * usd_to_micro(expected)
        assert not quote.warnings and not quote.bound  # dated today, read from the API
    # rows of other clouds stay as shipped, with or without a figure
    assert refreshed.row("aws:p6-b200.48xlarge").usd_per_hour is None
    assert refreshed.row("aws:g5.xlarge") == shipped.row("aws:g5.xlarge")


def test_refresh_reads_the_region_asked_for(
    billing: FakeBillingCatalog, key: tuple[dict, str], shipped: Catalog
) -> None:
    credentials = GcpCredentials(service_account_info=key[0])
    [row] = refresh_gcp(credentials, region="europe-west4", api_endpoint=billing.url)
    assert (row.instance_type, row.provisioning) == ("a2-highgpu-1g", "on-demand")
    assert row.usd_per_hour == _expected(shipped, "a2-highgpu-1g", PRICES[-3:])
    assert "europe-west4" in row.source


def test_refresh_with_a_key_the_api_refuses_says_so_in_one_line(
    billing: FakeBillingCatalog,
) -> None:
    other, _ = service_account_info()
    with pytest.raises(PriceRefreshError) as refused:
        refresh_gcp(GcpCredentials(service_account_info=other), api_endpoint=billing.url)
    assert "\n" not in str(refused.value) and "authentication" in str(refused.value)


GCP_EXTRA = (
    "the GCP price refresh needs the 'vertex' extra: pip install 'prefect-gpu-budget[vertex]'"
)


def test_without_the_vertex_extra_refresh_says_which_extra(
    tmp_path: Path, key: tuple[dict, str]
) -> None:
    """Without google-cloud-billing the module imports; a refresh raises one line naming the
    extra (an ImportError), and `prices refresh --gcp` prints it and exits 2, writing nothing."""
    env = {
        "PREFECT_HOME": str(tmp_path / "home"),
        "PREFECT_GPU_BUDGET_PRICES": str(tmp_path / "prices.csv"),
        "PREFECT_GPU_BUDGET_CATALOG_DIR": str(tmp_path / "catalogs"),
        "KEY": json.dumps(key[0]),
    }
    done = run_without(
        VERTEX_MODULES,
        """
        import json, os, sys
        from prefect_gcp import GcpCredentials

        from prefect_gpu_budget.extras import MissingExtra
        from prefect_gpu_budget.pricing.gcp import refresh_gcp

        try:
            refresh_gcp(GcpCredentials(service_account_info=json.loads(os.environ["KEY"])))
        except MissingExtra as exc:
            assert isinstance(exc, ImportError)
            print(exc)
        assert not [m for m in sys.modules if m.startswith("google.cloud.billing")]
        """,
        env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == GCP_EXTRA

    done = run_without(
        VERTEX_MODULES,
        """
        import sys
        from prefect_gpu_budget.cli import main

        sys.argv = ["prefect-gpu-budget", "prices", "refresh", "--gcp"]
        main()
        """,
        env,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"error: {GCP_EXTRA}"
    assert list(tmp_path.rglob("*.csv")) == []
