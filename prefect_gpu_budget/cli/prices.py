"""`prices ...`: the dated price catalog and this site's own prices (only `prices refresh`
loads a cloud SDK)."""

from __future__ import annotations

import typer

from prefect_gpu_budget.cli.common import console, fail
from prefect_gpu_budget.cli.tables import Col, layout, print_table

prices_app = typer.Typer(name="prices", help="The price catalog.", no_args_is_help=True)


@prices_app.command("set-local")
def prices_set_local(
    name: str = typer.Argument(..., help="The NAME in local:NAME."),
    usd_per_hour: str = typer.Option(..., help="What an hour of this machine costs you."),
    gpus: int = typer.Option(1, help="GPUs the machine has."),
    vcpu: int = typer.Option(0, help="vCPU a job on it takes of a pool's machine (0: unknown)."),
    memory_gib: int = typer.Option(0, help="Memory a job on it takes, GiB (0: unknown)."),
) -> None:
    """Price a local machine so jobs on `local:NAME` can be admitted: in the ledger, so every
    host and replica on it prices the machine alike (a CSV: `prices import-local`)."""
    from prefect_gpu_budget.admission.prices import set_ledger_price
    from prefect_gpu_budget.cli.common import current_ledger

    row = set_ledger_price(
        name, usd_per_hour, gpus, ledger=current_ledger(), vcpu=vcpu, memory_gib=memory_gib
    )
    console.print(
        f"local:{name} priced at ${row.usd_per_hour}/h in the ledger ({_ledger_shown()})",
        markup=False,
        highlight=False,
    )


@prices_app.command("import-local")
def prices_import_local(
    path: str = typer.Argument(..., metavar="CSV", help="A prices CSV (`-` reads stdin)."),
) -> None:
    """Put the local machines' prices of a CSV (the catalog's columns, as `prices
    export-local` writes and `prices set-local` wrote before) into the ledger, each replacing
    the ledger's price of that machine; rows of other clouds are left out, saying so."""
    import sys
    import tempfile
    from pathlib import Path

    from prefect_gpu_budget.admission.prices import store_local_price
    from prefect_gpu_budget.cli.common import current_ledger
    from prefect_gpu_budget.pricing.catalog import read_price_file

    if path == "-":
        with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as copy:
            copy.write(sys.stdin.read())
        source = Path(copy.name)
    else:
        source = Path(path)
        if not source.is_file():
            fail(f"CSV: no file {path}")
    try:
        rows = read_price_file(source)  # every row checked before one is written
    finally:
        if path == "-":
            source.unlink(missing_ok=True)
    local = [r for r in rows if r.cloud == "local" and r.provisioning == "on-demand" and r.priced]
    if not local:
        fail(f"CSV: {path} prices no local machine (rows of cloud local, on-demand)")
    ledger = current_ledger()
    for row in local:
        store_local_price(row, ledger)
    names = ", ".join(r.key for r in local)
    console.print(
        f"{len(local)} local price{'s' * (len(local) != 1)} put in the ledger "
        f"({_ledger_shown()}): {names}",
        markup=False,
        highlight=False,
    )
    if len(rows) > len(local):
        left = len(rows) - len(local)
        console.print(
            f"{left} other row{'s' * (left != 1)} left out: only local prices go in the ledger"
        )


@prices_app.command("export-local")
def prices_export_local(
    path: str = typer.Argument("-", metavar="CSV", help="Where to write it (`-`: stdout)."),
) -> None:
    """Write the ledger's local machine prices as a prices CSV (the catalog's columns), for
    `prices import-local` into another ledger or a host's PREFECT_GPU_BUDGET_PRICES file."""
    import sys
    from pathlib import Path

    from prefect_gpu_budget.admission.prices import ledger_prices
    from prefect_gpu_budget.cli.common import current_ledger
    from prefect_gpu_budget.pricing.catalog import write_rows

    rows = ledger_prices(current_ledger().db.url)  # made if new, as every command makes it
    if path == "-":
        import csv

        from prefect_gpu_budget.pricing.catalog import COLUMNS, row_cells

        writer = csv.writer(sys.stdout)
        writer.writerow(COLUMNS)
        writer.writerows(row_cells(r) for r in rows)
        return
    write_rows(Path(path), rows)
    typer.echo(f"{len(rows)} local price{'s' * (len(rows) != 1)} written to {path}", err=True)


def _ledger_shown() -> str:
    """This invocation's ledger, as it may be shown (no password)."""
    from prefect_gpu_budget import settings
    from prefect_gpu_budget.cli.common import given_ledger_url, shown_url

    return shown_url(settings.ledger_url(given_ledger_url()))


@prices_app.command("refresh")
def prices_refresh(
    aws: bool = typer.Option(False, "--aws", help="AWS Price List API and EC2 spot history."),
    gcp: bool = typer.Option(False, "--gcp", help="GCP Cloud Billing Catalog API."),
    aws_credentials: str = typer.Option(None, help="AwsCredentials block name (default: env)."),
    gcp_credentials: str = typer.Option(None, help="GcpCredentials block name (default: env)."),
    aws_region: str = typer.Option("us-east-1"),
    gcp_region: str = typer.Option("us-central1"),
    gcp_endpoint: str = typer.Option(None, help="Billing API endpoint, for a private one."),
) -> None:
    """Read current prices from the clouds, write a dated catalog over the shipped one, and
    print what changed. Quotes use the newest refreshed catalog from then on."""
    from prefect_gpu_budget.pricing.catalog import Catalog
    from prefect_gpu_budget.pricing.refresh import changes, write_refresh

    if not (aws or gcp):
        fail("choose --aws and/or --gcp")
    if gcp:
        from prefect_gpu_budget.pricing import gcp as gcp_prices

        gcp_prices._sdk()  # a missing extra before any prices are read
    rows = []
    if aws:
        from prefect_aws import AwsCredentials

        from prefect_gpu_budget.pricing.aws import refresh_aws

        creds = AwsCredentials.load(aws_credentials) if aws_credentials else AwsCredentials()
        rows += refresh_aws(creds, region=aws_region)
    if gcp:
        from prefect_gcp import GcpCredentials

        from prefect_gpu_budget.pricing.gcp import PriceRefreshError, refresh_gcp

        creds = GcpCredentials.load(gcp_credentials) if gcp_credentials else GcpCredentials()
        try:
            rows += refresh_gcp(creds, region=gcp_region, api_endpoint=gcp_endpoint)
        except PriceRefreshError as exc:
            fail(str(exc))
    old = Catalog.load()
    found = changes(old, rows)
    path = write_refresh(old, rows)
    for change in found:
        console.print(change.describe())
    console.print(f"{len(rows)} prices read, {len(found)} changed; catalog written to {path}")


@prices_app.command("list")
def prices_list() -> None:
    """The catalog rows, with their sources and dates."""
    from prefect_gpu_budget.admission.prices import default_catalog

    catalog = default_catalog()
    rows = []
    for row in catalog.rows():
        bound = catalog.bound_of(row.key, row.provisioning)
        figure = "no figure" if bound is None else f"no figure; at most {bound} (on-demand)"
        rows.append(
            (
                row.key,
                row.provisioning,
                f"{row.gpus}x {row.gpu_model}",
                figure if row.usd_per_hour is None else str(row.usd_per_hour),
                f"{row.as_of}{'' if row.verified or not row.priced else ' (unverified)'}",
                row.source,
            )
        )
    columns = (
        Col("instance"),
        Col("provisioning", "name"),
        Col("GPUs", drop=2),  # whole, or left out
        Col("USD/h", "name"),  # a figure, or why there is none
        Col("as of", "name", drop=3),
        Col("source", "text", drop=1),
    )
    width = console.rich().width
    if _fits_whole(columns, rows, width):
        print_table(columns, rows)
        return
    # too narrow for the sources on their rows: each is said once, below, by its number
    sources = list(dict.fromkeys(row[-1] for row in rows))
    print_table(
        (*columns[:-1], Col("source", drop=1)),
        [(*row[:-1], f"[{sources.index(row[-1]) + 1}]") for row in rows],
    )
    for n, source in enumerate(sources, 1):
        console.print(f"[{n}] {source}", markup=False, highlight=False)


def _fits_whole(columns: tuple[Col, ...], rows: list[tuple[str, ...]], width: int) -> bool:
    """Whether the table shows its last column (the sources) on one line a cell."""
    from rich.cells import cell_len

    shown = layout(columns, rows, width)
    last = len(columns) - 1
    return last in shown and shown[last] >= max(cell_len(row[last]) for row in rows)
