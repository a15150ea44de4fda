"""`bill import`, `bill drift`, `bill forget` and `bill accept`: the cloud's own bill against
the ledger's settlements."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import typer

from prefect_gpu_budget import settings
from prefect_gpu_budget.cli.common import console, current_ledger, fail
from prefect_gpu_budget.units import usd

bill_app = typer.Typer(
    name="bill",
    help="The cloud's own bill: import it, and see it against the settlements.",
    no_args_is_help=True,
)
MONEY = ("reserved", "settled", "billed", "drift")
APART_TITLES = {
    "untagged": "untagged usage (no job's mark; not spread over scopes)",
    "account": "account-level lines (not spread over scopes)",
    "refused": "refused lines (they name a job they cannot be true of; booked nowhere)",
    "copy": "copies (lines already held under another billing period; booked once)",
}


def _say(text: str) -> None:
    console.print(text, markup=False, highlight=False)


@bill_app.command("import")
def bill_import(
    files: list[Path] = typer.Argument(
        None, help="Export files (Parquet, CSV, gzip CSV, JSON Lines); none: the block's."
    ),
    source: str = typer.Option(
        None,
        "--source",
        help="The files' schema, aws-cur2 or gcp-billing (default: told from their columns).",
    ),
    block: str = typer.Option(
        "default", "--block", help="The BillingExport block read when no file is named."
    ),
    period: list[str] = typer.Option(
        None,
        "--period",
        help="A billing period (YYYY-MM) the block's export is read for; "
        "default: the current one, and the last one for 15 days after it closed.",
    ),
    provisional_hours: float = typer.Option(
        None,
        "--provisional-hours",
        min=0,
        help="Lines whose usage ended less than this long ago move no budget (default 48, or "
        "the block's; 0: every line whose usage has ended is final).",
    ),
    max_file_mib: int = typer.Option(
        256,
        "--max-file-mib",
        min=1,
        help="Refuse a file whose data pass this many MiB, decompressed (a gzip bomb).",
    ),
    as_json: bool = typer.Option(False, "--json", help="What each import did, as JSON."),
) -> None:
    """Import the cloud's bill: each (source, billing period) it holds replaces the last
    import of it, and every budget on a billed job's path is charged what the bill says once
    its lines are final. A bad export exits 2 with one line, and changes nothing."""
    from prefect_gpu_budget.billing.imports import import_export

    export, hours, wanted = _what_to_read(files, source, block, period, max_file_mib)
    done = import_export(
        export,
        wanted,
        current_ledger().bills,
        hours if provisional_hours is None else provisional_hours,
    )
    _announce(done)
    if as_json:
        from prefect_gpu_budget.billing.results import as_json as done_json

        typer.echo(json.dumps([done_json(item) for item in done], indent=2))
        return
    if not done:
        console.print("no bill lines read: nothing imported")
    _print_done(done)


def _what_to_read(
    files: list[Path] | None,
    source: str | None,
    block: str,
    period: list[str] | None,
    max_file_mib: int,
) -> tuple[Any, float, list[str]]:
    """The source `bill import` reads (the files named, else the block's), its provisional
    window and the periods to read; a bad choice fails with one line."""
    from prefect_gpu_budget.billing.lines import SOURCES

    if source is not None and source not in SOURCES:
        fail(f"source: one of {', '.join(SOURCES)}, not {source!r}")
    if not files:
        return _block_source(block, source, period)
    if period:
        fail("period: the files' own periods are imported; --period reads a block")
    return _files_source(files, source, max_file_mib)


def _files_source(
    files: list[Path], source: str | None, max_file_mib: int
) -> tuple[Any, float, list[str]]:
    """The export files named, read in `source`'s schema (None: told from their columns),
    the default provisional window, and no period (the files' own are read)."""
    from prefect_gpu_budget.billing.files import FilesSource
    from prefect_gpu_budget.billing.trueup import DEFAULT_PROVISIONAL_HOURS

    read = FilesSource(files, source, max_bytes=max_file_mib << 20)
    return read, DEFAULT_PROVISIONAL_HOURS, []


def _block_source(
    block: str, source: str | None, period: list[str] | None
) -> tuple[Any, float, list[str]]:
    """The source of the `BillingExport` block named `block`, its provisional window, and the
    periods to read (default: those a daily import reads)."""
    from prefect_gpu_budget.billing.trueup import periods_to_read
    from prefect_gpu_budget.blocks.billing import BillingExport

    try:
        export = BillingExport.load(block)
    except ValueError:
        fail(
            f"block: no BillingExport block named {block!r}: name export files, or save "
            "one (kind aws-cur2, gcp-billing or file)"
        )
    if source is not None and export.kind != source:
        fail(f"source: the block {block!r} reads {export.kind}, not {source}")
    return export.source(), export.provisional_hours, period or periods_to_read(time.time())


def _announce(done: list[Any]) -> None:
    """The event and the notification of each closed period over by bill and of each figure
    held, where a Prefect API is set."""
    marks = [mark for item in done for mark in item.over_by_bill]
    held = [h for item in done for h in item.held]
    if (marks or held) and settings.prefect_api_url():
        from prefect_gpu_budget.flows.bill_import import announce_held, announce_over_by_bill

        announce_over_by_bill(current_ledger(), marks)
        announce_held(current_ledger(), held)


def _print_done(done: list[Any]) -> None:
    from prefect_gpu_budget.billing.results import held_line, over_line, summary

    for item in done:
        _say(summary(item))
        for mark in item.over_by_bill:
            _say(over_line(mark))
        for held in item.held:
            _say(held_line(held))


@bill_app.command("forget")
def bill_forget(
    source: str = typer.Argument(..., help="aws-cur2 or gcp-billing."),
    period: str = typer.Argument(..., help="The billing period imported, YYYY-MM."),
    provisional_hours: float = typer.Option(
        48.0,
        "--provisional-hours",
        min=0,
        help="For the jobs still billed by other periods: lines younger than this are "
        "provisional, as at import.",
    ),
) -> None:
    """Take an import of the bill out whole: its lines go, and every job it billed is charged
    again what its other lines bill, or what the ledger settled when none is left."""
    from prefect_gpu_budget.billing.results import summary

    done = current_ledger().bills.forget(source, period, provisional_hours=provisional_hours)
    _say(f"forgot {summary(done)}")


@bill_app.command("accept")
def bill_accept(
    job_id: str = typer.Argument(..., help="The ledger job whose held bill is accepted."),
) -> None:
    """Accept a job's bill held for being far past its reservation: it is charged on every
    budget on the job's path, as any final bill is."""
    from prefect_gpu_budget.units import fmt_usd

    done = current_ledger().bills.accept(job_id)
    moved = ", ".join(f"{scope} {fmt_usd(amount)}" for scope, amount in done.moved.items())
    _say(
        f"accepted the bill of job {job_id}: drift booked {fmt_usd(done.drift_micro)}; "
        f"budgets moved: {moved or 'none'}"
    )


@bill_app.command("drift")
def bill_drift(
    scope: str = typer.Argument(None, help="A scope's subtree (default: every scope)."),
    as_json: bool = typer.Option(False, "--json", help="Every figure, as JSON."),
    period: str = typer.Option(
        None,
        help="The billing period (YYYY-MM) whose jobs and lines are shown (default: the "
        "latest imported); `all` for every period.",
    ),
) -> None:
    """Per job the bill names: what it reserved, what the ledger settled, what the cloud
    billed and the drift (billed - settled), final, provisional or held, and why; per scope the
    totals; and, apart, the bill's lines no job's bill counts (untagged usage, account-level
    taxes and credits, lines refused with the reason, copies of lines held elsewhere). One
    billing period at a time: the latest imported, unless `--period` names another."""
    from prefect_gpu_budget.admission.ledger.bill_views import APART, drift, latest_period
    from prefect_gpu_budget.units import validate_scope

    if period not in (None, "all") and not re.fullmatch(r"\d{4}-(0[1-9]|1[0-2])", period):
        fail(f"period: must be a billing period YYYY-MM or all, got {period!r}")
    scope = validate_scope(scope) if scope else None
    with current_ledger().db.read() as conn:
        chosen = latest_period(conn) if period is None else None if period == "all" else period
        found = drift(conn, scope, chosen)
    if as_json:
        typer.echo(json.dumps({"billing_period": chosen, **_drift_json(found)}, indent=2))
        return
    if not found["jobs"] and not any(found[kind] for kind in APART):
        console.print("no bill imported yet: `prefect-gpu-budget bill import`")
        return
    if len({i["billing_period"] for i in found["imports"]}) > 1 and chosen is not None:
        _say(f"billing period {chosen} (`--period YYYY-MM` for another, `--period all`)")
    _print_jobs(found)
    for kind in APART:
        if found[kind]:
            _print_apart(kind, found[kind])


def _drift_json(found: dict[str, Any]) -> dict[str, Any]:
    from prefect_gpu_budget.admission.ledger.bill_views import APART

    jobs = [
        {
            "job_id": j["job_id"],
            "name": j["name"],
            "scope": j["scope"],
            **{f"{m}_usd": usd(j[f"{m}_micro"]) for m in MONEY},
            "figure": j["figure"],
            "reason": j["reason"],
        }
        for j in found["jobs"]
    ]
    scopes = {
        s: {
            **{f"{m}_usd": usd(t[f"{m}_micro"]) for m in MONEY[1:]},
            "provisional_jobs": t["provisional"],
            "held_jobs": t["held"],
        }
        for s, t in found["scopes"].items()
    }
    apart = {
        kind: [
            {
                **{k: v for k, v in line.items() if k != "billed_micro"},
                "description": _what(line),
                "billed_usd": usd(line["billed_micro"]),
            }
            for line in found[kind]
        ]
        for kind in APART
    }
    return {"jobs": jobs, "scopes": scopes, **apart}


def _what(line: dict[str, Any]) -> str:
    """A line's description, never blank: its own, else its resource, else its type."""
    return line["description"] or line["resource_id"] or line["line_type"]


def _print_jobs(found: dict[str, Any]) -> None:
    from prefect_gpu_budget.cli.tables import Col, print_table
    from prefect_gpu_budget.units import fmt_usd

    print_table(
        (
            Col("job", drop=5),  # the id: `bill drift --json` has it
            Col("scope"),
            Col("reserved", drop=3),
            Col("settled"),
            Col("billed"),
            Col("drift"),
            Col("figure", kind="name", drop=2),  # final or provisional: the bill's state
            Col("why not final", kind="text", drop=6),
        ),
        [
            (
                j["job_id"][:8],
                j["scope"],
                *(fmt_usd(j[f"{m}_micro"]) for m in MONEY),
                j["figure"],
                j["reason"],
            )
            for j in found["jobs"]
        ],
    )
    print_table(
        (
            Col("scope"),
            Col("settled"),
            Col("billed"),
            Col("drift"),
            Col("provisional jobs", drop=1),
            Col("held jobs", drop=1),
        ),
        [
            (
                s,
                *(fmt_usd(t[f"{m}_micro"]) for m in MONEY[1:]),
                str(t["provisional"]),
                str(t["held"]),
            )
            for s, t in sorted(found["scopes"].items())
        ],
    )


def _print_apart(kind: str, lines: list[dict[str, Any]]) -> None:
    from prefect_gpu_budget.cli.tables import Col, print_table
    from prefect_gpu_budget.units import fmt_usd

    total = sum(line["billed_micro"] for line in lines)
    _say(f"{APART_TITLES[kind]}: {len(lines)} line(s), {fmt_usd(total)}")
    reasons = kind in ("refused", "copy")
    columns = [
        Col("period"),
        Col("type", kind="name"),
        Col("billed"),
        Col("what", kind="text"),
    ]
    if reasons:
        columns.append(Col("why", kind="text"))
    print_table(
        columns,
        [
            (
                line["billing_period"],
                line["line_type"],
                fmt_usd(line["billed_micro"]),
                _what(line),
                *((line["reason"] or "",) if reasons else ()),
            )
            for line in lines
        ],
    )
