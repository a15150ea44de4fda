"""The shipped catalog: a dated, sourced row per GPU family and provisioning, and rows with no
public figure, which are listed and give shapes but are refused, with their reason, when a job is
quoted (exit 2 from the CLI, nothing written), until a refresh or the user's own file prices them.
"""

from __future__ import annotations

import re
import sys
from datetime import date
from decimal import Decimal
from pathlib import Path

import pytest

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.prices import default_catalog
from prefect_gpu_budget.blocks import GpuBudget
from prefect_gpu_budget.cli import common, main
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.pricing.catalog import COLUMNS, SHIPPED, Catalog, PriceRow, read_price_file
from prefect_gpu_budget.units import BudgetInputError

LAUNCHERS = Path(__file__).parents[2] / "docs" / "launchers.md"
"""The manual's launchers page: the Vertex AI example and the catalog's tables."""

GCP_FAMILIES = {
    # the families Vertex AI's Dynamic Workload Scheduler names, and their GPU
    "g2-standard": "L4 24GB",
    "a2-highgpu": "A100 40GB",
    "a2-ultragpu": "A100 80GB",
    "a3-highgpu": "H100 80GB",
    "a3-ultragpu": "H200 141GB",
    "a4-highgpu": "B200 180GB",
}
AWS_FAMILIES = {
    # the EC2 / SageMaker training equivalents
    "g5": "A10G 24GB",
    "g6": "L4 24GB",
    "p4d": "A100 40GB",
    "p4de": "A100 80GB",
    "p5": "H100 80GB",
    "p5e": "H200 141GB",
    "p5en": "H200 141GB",
    "p6-b200": "B200 180GB",
}
PROVISIONINGS = {
    "gcp": ("on-demand", "spot", "flex-start"),
    "aws": ("on-demand", "spot"),
    "sagemaker": ("on-demand", "spot"),
}
NO_FIGURE = "no public figure recorded"
REFRESH = {"gcp": "prices refresh --gcp", "aws": "prices refresh --aws"}


def _family(row: PriceRow) -> str:
    if row.cloud == "gcp":
        return row.instance_type.rsplit("-", 1)[0]
    return row.instance_type.removeprefix("ml.").split(".")[0]


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No user prices and no refreshed catalog: the shipped rows only."""
    monkeypatch.setenv("PREFECT_GPU_BUDGET_PRICES", str(tmp_path / "prices.csv"))
    monkeypatch.setenv("PREFECT_GPU_BUDGET_CATALOG_DIR", str(tmp_path / "catalogs"))
    default_catalog.cache_clear()
    yield tmp_path
    default_catalog.cache_clear()


def test_every_family_has_a_dated_sourced_row_per_provisioning() -> None:
    rows = read_price_file(SHIPPED)
    assert len({(r.key, r.provisioning) for r in rows}) == len(rows)  # one row per key
    for cloud, families in (
        ("gcp", GCP_FAMILIES),
        ("aws", AWS_FAMILIES),
        ("sagemaker", AWS_FAMILIES),
    ):
        for family, gpu_model in families.items():
            mine = [r for r in rows if r.cloud == cloud and _family(r) == family]
            assert {r.provisioning for r in mine} == set(PROVISIONINGS[cloud]), (cloud, family)
            for row in mine:
                assert row.gpu_model == gpu_model, row
                assert row.gpus > 0 and row.vcpu > 0 and row.memory_gib > 0, row
                assert row.source and date(2024, 1, 1) <= row.as_of <= date.today(), row
                if row.usd_per_hour is None:
                    assert row.source.startswith(NO_FIGURE), row
                    assert REFRESH["gcp" if cloud == "gcp" else "aws"] in row.source, row
                    assert not row.verified, row
                else:
                    assert row.usd_per_hour > 0 and NO_FIGURE not in row.source, row
    # the shapes of one type agree across its provisionings
    shapes: dict[str, set] = {}
    for row in rows:
        shapes.setdefault(row.key, set()).add((row.gpu_model, row.gpus, row.vcpu, row.memory_gib))
    assert {key: shape for key, shape in shapes.items() if len(shape) > 1} == {}


def test_the_shipped_types_are_what_the_launchers_run() -> None:
    from prefect_gpu_budget.launchers.sagemaker_checks import TRAINING_INSTANCE_TYPES
    from prefect_gpu_budget.launchers.vertex_machines import ACCELERATORS, MACHINE_FAMILIES

    for row in read_price_file(SHIPPED):
        if row.cloud == "gcp":
            assert MACHINE_FAMILIES[_family(row)] == ACCELERATORS[row.gpu_model], row
        elif row.cloud == "sagemaker":
            assert row.instance_type in TRAINING_INSTANCE_TYPES, row


def test_a_type_with_no_figure_is_refused_with_the_reason(
    isolated: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{isolated / 'ledger.db'}"
    ledger = Ledger(url)
    ledger.config.set_budget(GpuBudget(scope="acme", hourly_cap_usd=1000).rule())
    before = (ledger.config.budgets(), ledger.views.jobs(), ledger.config.capacity("acme"))

    for argv in (
        ["quote", "gcp:a4-highgpu-8g", "--provisioning", "flex-start"],
        ["quote", "gcp:a3-highgpu-8g", "--provisioning", "flex-start", "--nodes", "2"],
        ["quote", "sagemaker:ml.p6-b200.48xlarge", "--provisioning", "spot"],
        ["pool", "set", "acme", "b200", "--nodes", "1", "--gpus-per-node", "8"]
        + ["--instance-type", "gcp:a4-highgpu-8g"],
    ):
        monkeypatch.setattr(sys, "argv", ["prefect-gpu-budget", "--ledger-url", url, *argv])
        with pytest.raises(SystemExit) as exit_:
            main()
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2, err
        assert "\n" not in err and re.fullmatch(
            r"error: instance_type: no [a-z-]+ price for \S+: no public figure recorded.*"
            r"run `prefect-gpu-budget prices refresh --(gcp|aws)` or add a priced row to your "
            r"prices CSV \(PREFECT_GPU_BUDGET_PRICES\)",
            err,
        ), err
    assert (ledger.config.budgets(), ledger.views.jobs(), ledger.config.capacity("acme")) == before

    # the gate refuses before it writes anything
    from prefect_gpu_budget.admission.gate import Gate

    gate = Gate(ledger, catalog=Catalog.load())
    job = GpuJob(instance_type="gcp:a4-highgpu-8g", provisioning="flex-start", max_runtime="1h")
    with pytest.raises(BudgetInputError, match=NO_FIGURE):
        gate.admit(job, "acme")
    assert ledger.views.jobs() == []

    # and the listing shows the rows, with the reason
    monkeypatch.setattr(sys, "argv", ["prefect-gpu-budget", "prices", "list"])
    monkeypatch.setenv("COLUMNS", "400")
    monkeypatch.setattr(common._Console, "_rich", None)  # made again, as wide as that
    main()
    listed = capsys.readouterr().out
    line = next(x for x in listed.splitlines() if "gcp:a4-highgpu-8g" in x and "flex-start" in x)
    assert "no figure" in line and NO_FIGURE in line


def _user_file(path: Path, *lines: str) -> None:
    path.write_text(",".join(COLUMNS) + "\n" + "".join(f"{line}\n" for line in lines))


def test_a_user_price_replaces_a_row_with_no_figure_and_never_the_reverse(isolated: Path) -> None:
    _user_file(
        isolated / "prices.csv",
        "gcp,a4-highgpu-8g,flex-start,B200 180GB,8,224,3968,70.5,our negotiated rate,2026-11-01,yes",
        "aws,g5.xlarge,on-demand,A10G 24GB,1,4,16,,no public figure recorded: mine,2026-11-01,no",
        "local,spare,on-demand,local GPU,1,0,0,,waiting for the invoice,2026-11-01,no",
    )
    catalog = Catalog.load()
    quote = catalog.quote("gcp:a4-highgpu-8g", 2, "flex-start", today=date(2026, 11, 2))
    assert quote.rate_micro_per_hour == 2 * 70_500_000 and not quote.warnings
    assert catalog.row("aws:g5.xlarge").usd_per_hour == Decimal("1.006")  # still the shipped one
    with pytest.raises(
        BudgetInputError,
        match="^instance_type: no on-demand price for local:spare: waiting for the invoice$",
    ):
        catalog.quote("local:spare")


@pytest.mark.parametrize(
    ("row", "rule"),
    [
        ("aws,g5.xlarge,on-demand,A10G,1,4,16,,,2026-01-01,no", "usd_per_hour is empty"),
        ("aws,g5.xlarge,on-demand,A10G,1,4,16,none,why,2026-01-01,no", "usd_per_hour"),
        ("aws,g5.xlarge,on-demand,A10G,1,4,16,0,mine,2026-01-01,no", "above $0"),
    ],
)
def test_a_user_row_needs_a_price_or_a_reason(
    isolated: Path, row: str, rule: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    prices = isolated / "prices.csv"
    _user_file(prices, row)
    monkeypatch.setattr(sys, "argv", ["prefect-gpu-budget", "quote", "aws:g5.xlarge"])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "\n" not in err, err
    assert err.startswith(f"error: prices: bad row aws:'g5.xlarge' in {prices}: "), err
    assert rule in err, err


def _readme_vertex_job() -> dict[str, str]:
    """The GpuJob of the manual's Vertex AI example (docs/launchers.md), as keyword strings."""
    block = next(
        b
        for b in re.findall(r"```python\n(.*?)```", LAUNCHERS.read_text(), re.S)
        if "VertexLauncher" in b
    )
    call = re.search(r"GpuJob\((.*?)\)\n", block, re.S)
    assert call, block
    return dict(re.findall(r"(\w+)=\"?([\w:.-]+)\"?", call.group(1)))


def test_the_readme_vertex_example_passes_the_price_check(isolated: Path) -> None:
    job = _readme_vertex_job()
    catalog = Catalog.load()
    quote = catalog.quote(job["instance_type"], int(job.get("nodes", 1)), job["provisioning"])
    assert quote.row.cloud == "gcp" and quote.row.priced and quote.rate_micro_per_hour > 0
    # the machine the example used to name is refused with the reason until a refresh
    with pytest.raises(BudgetInputError) as refused:
        catalog.quote("gcp:a3-highgpu-8g", 2, "flex-start")
    assert str(refused.value).startswith(
        "instance_type: no flex-start price for gcp:a3-highgpu-8g: no public figure recorded"
    )
    assert "prices refresh --gcp" in str(refused.value)


def test_the_readme_lists_every_shipped_row() -> None:
    """Its prices table: a line per type, a cell per provisioning, the figure or `no figure`."""
    table = {
        cells[0].strip("` "): [c.strip() for c in cells[1:4]]
        for line in LAUNCHERS.read_text().splitlines()
        if line.startswith("| `") and len(cells := line.strip("|").split("|")) == 4
    }
    for row in read_price_file(SHIPPED):
        cell = table[row.key][("on-demand", "spot", "flex-start").index(row.provisioning)]
        if row.usd_per_hour is None:
            assert cell == "no figure", (row.key, row.provisioning, cell)
        else:
            assert cell.startswith(f"{row.usd_per_hour} (") and str(row.as_of) in cell, cell
