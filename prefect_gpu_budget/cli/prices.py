"""`quote` and `prices ...`: the dated price catalog (only `prices refresh` loads a cloud SDK)."""

from __future__ import annotations

import typer

from prefect_gpu_budget.cli.common import console, fail
from prefect_gpu_budget.cli.tables import Col, layout, print_table
from prefect_gpu_budget.units import fmt_usd


def quote(
    instance_type: str = typer.Argument(..., help="cloud:type, e.g. aws:p4d.24xlarge."),
    nodes: int = typer.Option(1, min=1, max=1024),
    hours: str = typer.Option("1", help="Runtime in hours (or a duration like '90m')."),
    provisioning: str = typer.Option("on-demand", help="on-demand, spot or flex-start."),
    gpus: int = typer.Option(None, help="A part of each machine: its GPUs."),
    vcpu: int = typer.Option(None, help="A part of each machine: its vCPU."),
    memory_gib: int = typer.Option(None, help="A part of each machine: its memory, GiB."),
) -> None:
    """Price a job shape from the dated catalog (a whole machine, or a part of one), as the
    gate and `forecast` price it (`pricing.catalog.price_job`)."""
    from prefect_gpu_budget.pricing.catalog import Machines, price_job
    from prefect_gpu_budget.units import cost_micro, parse_duration

    seconds = parse_duration(
        hours if not hours.replace(".", "", 1).isdigit() else f"{hours}h", "hours"
    )
    if gpus is None and vcpu is None and memory_gib is None:
        q, part = price_job(Machines(instance_type, nodes, provisioning))
    else:  # the job model (pydantic) only for a part: a whole machine's quote stays quick
        from prefect_gpu_budget.job import GpuJob

        q, part = price_job(
            GpuJob(
                instance_type=instance_type,
                nodes=nodes,
                provisioning=provisioning,
                max_runtime=seconds,
                gpus=gpus,
                vcpu=vcpu,
                memory_gib=memory_gib,
            )
        )
    per_node = f"{q.row.gpus}x {q.row.gpu_model} per node"
    if part is not None and not part.whole:
        per_node = f"{part.fraction} of each node's price (of {per_node})"
    console.print(
        f"{q.describe()}  {per_node}\n"
        f"{seconds / 3600:g} h: {fmt_usd(cost_micro(q.rate_micro_per_hour, seconds, round_up=True))}"
        f"  (price from {q.row.source}, {q.row.as_of})"
    )
    for warning in q.warnings:
        console.print(f"[yellow]warning:[/] {warning}")


def prices_set_local(
    name: str = typer.Argument(..., help="The NAME in local:NAME."),
    usd_per_hour: str = typer.Option(..., help="What an hour of this machine costs you."),
    gpus: int = typer.Option(1, help="GPUs the machine has."),
    vcpu: int = typer.Option(0, help="vCPU a job on it takes of a pool's machine (0: unknown)."),
    memory_gib: int = typer.Option(0, help="Memory a job on it takes, GiB (0: unknown)."),
) -> None:
    """Price a local machine so jobs on `local:NAME` can be admitted: in the ledger, so every
    host and replica on it prices the machine alike (a CSV: `prices import-local`)."""
    from prefect_gpu_budget.cli.common import current_ledger
    from prefect_gpu_budget.pricing.catalog import set_ledger_price

    row = set_ledger_price(
        name, usd_per_hour, gpus, ledger=current_ledger(), vcpu=vcpu, memory_gib=memory_gib
    )
    console.print(
        f"local:{name} priced at ${row.usd_per_hour}/h in the ledger ({_ledger_shown()})",
        markup=False,
        highlight=False,
    )


def prices_import_local(
    path: str = typer.Argument(..., metavar="CSV", help="A prices CSV (`-` reads stdin)."),
) -> None:
    """Put the local machines' prices of a CSV (the catalog's columns, as `prices
    export-local` writes and `prices set-local` wrote before) into the ledger, each replacing
    the ledger's price of that machine; rows of other clouds are left out, saying so."""
    import sys
    import tempfile
    from pathlib import Path

    from prefect_gpu_budget.cli.common import current_ledger
    from prefect_gpu_budget.pricing.catalog import read_price_file, store_local_price

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


def prices_export_local(
    path: str = typer.Argument("-", metavar="CSV", help="Where to write it (`-`: stdout)."),
) -> None:
    """Write the ledger's local machine prices as a prices CSV (the catalog's columns), for
    `prices import-local` into another ledger or a host's PREFECT_GPU_BUDGET_PRICES file."""
    import sys
    from pathlib import Path

    from prefect_gpu_budget.cli.common import current_ledger
    from prefect_gpu_budget.pricing.catalog import ledger_prices, write_rows

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
    from prefect_gpu_budget.cli.agents import _shown
    from prefect_gpu_budget.cli.common import _state

    return _shown(settings.ledger_url(_state["ledger_url"]))


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


def prices_list() -> None:
    """The catalog rows, with their sources and dates."""
    from prefect_gpu_budget.pricing.catalog import default_catalog

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
