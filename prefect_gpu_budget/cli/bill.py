"""`bill import` and `bill drift`: the cloud's own bill against the ledger's settlements."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from prefect_gpu_budget import settings
from prefect_gpu_budget.cli.common import console, current_ledger, fail
from prefect_gpu_budget.units import usd


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
        "the block's; 0: every line is final).",
    ),
    as_json: bool = typer.Option(False, "--json", help="What each import did, as JSON."),
) -> None:
    """Import the cloud's bill: each (source, billing period) it holds replaces the last
    import of it, and every budget on a billed job's path is charged what the bill says once
    its lines are final. A bad export exits 2 with one line, and changes nothing."""
    from prefect_gpu_budget.billing.imports import import_lines, over_line, summary
    from prefect_gpu_budget.billing.lines import SOURCES
    from prefect_gpu_budget.billing.trueup import DEFAULT_PROVISIONAL_HOURS, periods_to_read

    if source is not None and source not in SOURCES:
        fail(f"source: one of {', '.join(SOURCES)}, not {source!r}")
    if files:
        from prefect_gpu_budget.billing.files import read_bill_files

        if period:
            fail("period: the files' own periods are imported; --period reads a block")
        lines = read_bill_files(files, source)
        read_from, hours, groups = ", ".join(map(str, files)), DEFAULT_PROVISIONAL_HOURS, ()
    else:
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
        read = export.read(period or periods_to_read(time.time()))
        lines = [line for group in read.values() for line in group]
        read_from, hours, groups = export.where(), export.provisional_hours, tuple(read)
    done = import_lines(
        current_ledger(),
        lines,
        read_from=read_from,
        provisional_hours=hours if provisional_hours is None else provisional_hours,
        periods=groups,
    )
    marks = [mark for item in done for mark in item.over_by_bill]
    if marks and settings.prefect_api_url():
        from prefect_gpu_budget.flows.bill_import import announce_over_by_bill

        announce_over_by_bill(current_ledger(), marks)
    if as_json:
        typer.echo(
            json.dumps(
                [
                    {
                        "source": item.source,
                        "billing_period": item.billing_period,
                        "lines": item.lines,
                        "changed": item.changed,
                        "jobs_final": item.jobs_final,
                        "jobs_provisional": item.jobs_provisional,
                        "booked_usd": usd(item.booked_micro),
                        "untagged_usd": usd(item.untagged_micro),
                        "account_usd": usd(item.account_micro),
                        "over_by_bill": [
                            {
                                "scope": m.scope,
                                "budget_usd": usd(m.budget_micro),
                                "spent_usd": usd(m.spent_micro),
                            }
                            for m in item.over_by_bill
                        ],
                    }
                    for item in done
                ],
                indent=2,
            )
        )
        return
    if not done:
        console.print("no bill lines read: nothing imported")
    for item in done:
        console.print(summary(item), markup=False, highlight=False)
        for mark in item.over_by_bill:
            console.print(over_line(mark), markup=False, highlight=False)


def bill_drift(
    scope: str = typer.Argument(None, help="A scope's subtree (default: every scope)."),
    as_json: bool = typer.Option(False, "--json", help="Every figure, as JSON."),
) -> None:
    """Per job the bill names: what it reserved, what the ledger settled, what the cloud
    billed and the drift (billed - settled), final or provisional; per scope the totals; and,
    apart, the bill's lines no job owns (untagged usage, account-level taxes and credits)."""
    from prefect_gpu_budget.cli.tables import Col, print_table
    from prefect_gpu_budget.units import fmt_usd, validate_scope

    found = current_ledger().bills.drift(validate_scope(scope) if scope else None)
    money = ("reserved", "settled", "billed", "drift")
    if as_json:
        jobs = [
            {
                "job_id": j["job_id"],
                "name": j["name"],
                "scope": j["scope"],
                **{f"{m}_usd": usd(j[f"{m}_micro"]) for m in money},
                "figure": "final" if j["final"] else "provisional",
            }
            for j in found["jobs"]
        ]
        scopes = {
            s: {
                **{f"{m}_usd": usd(t[f"{m}_micro"]) for m in money[1:]},
                "provisional_jobs": t["provisional"],
            }
            for s, t in found["scopes"].items()
        }
        apart = {
            kind: [
                {
                    **{k: v for k, v in line.items() if k != "billed_micro"},
                    "billed_usd": usd(line["billed_micro"]),
                }
                for line in found[kind]
            ]
            for kind in ("untagged", "account")
        }
        typer.echo(json.dumps({"jobs": jobs, "scopes": scopes, **apart}, indent=2))
        return
    if not found["jobs"] and not found["untagged"] and not found["account"]:
        console.print("no bill imported yet: `prefect-gpu-budget bill import`")
        return
    print_table(
        (
            Col("job"),
            Col("scope"),
            Col("reserved", drop=3),
            Col("settled"),
            Col("billed"),
            Col("drift"),
            Col("figure", kind="name", drop=1),
        ),
        [
            (
                j["job_id"][:8],
                j["scope"],
                fmt_usd(j["reserved_micro"]),
                fmt_usd(j["settled_micro"]),
                fmt_usd(j["billed_micro"]),
                fmt_usd(j["drift_micro"]),
                "final" if j["final"] else "provisional",
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
        ),
        [
            (
                s,
                fmt_usd(t["settled_micro"]),
                fmt_usd(t["billed_micro"]),
                fmt_usd(t["drift_micro"]),
                str(t["provisional"]),
            )
            for s, t in sorted(found["scopes"].items())
        ],
    )
    for kind, title in (("untagged", "untagged usage"), ("account", "account-level lines")):
        if found[kind]:
            total = sum(line["billed_micro"] for line in found[kind])
            console.print(
                f"{title} (no job's mark; not spread over scopes): {len(found[kind])} line(s), "
                f"{fmt_usd(total)}",
                markup=False,
                highlight=False,
            )
            print_table(
                (
                    Col("period"),
                    Col("type", kind="name"),
                    Col("billed"),
                    Col("what", kind="text", drop=1),
                ),
                [
                    (
                        line["billing_period"],
                        line["line_type"],
                        fmt_usd(line["billed_micro"]),
                        line["description"] or line["resource_id"] or "",
                    )
                    for line in found[kind]
                ],
            )
