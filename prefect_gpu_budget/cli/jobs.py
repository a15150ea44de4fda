"""`ledger`, `cancel` and `reconcile`: the jobs from request to settlement, an admin's stop,
and the orphans' settling."""

from __future__ import annotations

import json
from typing import Any

import typer

from prefect_gpu_budget.admission.rules.timing import STALE_AFTER_S
from prefect_gpu_budget.cli.app import app
from prefect_gpu_budget.cli.common import console, current_ledger, fail, limits_if_configured
from prefect_gpu_budget.cli.status import budgeted_under, no_such_scope
from prefect_gpu_budget.cli.tables import Col, print_table
from prefect_gpu_budget.placement.recorded import choice_view
from prefect_gpu_budget.units import fmt_usd, iso, micro_to_usd, usd


@app.command("ledger")
def ledger_cmd(
    scope: str = typer.Argument(None),
    as_json: bool = typer.Option(False, "--json"),
    limit: int = typer.Option(200, help="Newest N jobs."),
    before: str = typer.Option(
        None,
        help="Only jobs requested before this one (a job id, as `--json` gives it): the next "
        "page is `--before` the oldest id of this one.",
    ),
) -> None:
    """Every job from request to settlement, newest last, a page at a time (`--limit`,
    `--before`)."""
    if limit <= 0:
        fail(f"limit: must be at least 1 (the newest N jobs), got {limit}")
    ledger = current_ledger()
    if before is not None and not ledger.views.states([before]):
        fail(f"before: no job {before} (give a whole id, as `ledger --json` shows it)")
    rows = ledger.views.jobs(scope, limit=limit, before=before)
    if scope is not None and not rows and before is None and not budgeted_under(scope):
        no_such_scope("ledger", scope)
    out = [_job_json(r) for r in rows]
    if as_json:
        typer.echo(json.dumps(out, indent=2))
        return
    print_table(_LEDGER_COLUMNS, [_job_row(raw, r) for raw, r in zip(rows, out, strict=True)])


def _job_json(r: dict[str, Any]) -> dict[str, Any]:
    """One job of `ledger --json`: its figures in USD, its instants in ISO 8601."""
    return {
        "id": r["id"],
        "scope": r["scope"],
        "name": r["name"],
        **_sweep_trial(r["name"]),
        "instance_type": r["instance_type"],
        "provisioning": r["provisioning"],
        "placement": choice_view(r.get("choice")),
        "nodes": r["nodes"],
        "rate_usd_per_hour": usd(r["rate_micro_per_hour"]),
        "reserved_usd": usd(r["reserved_micro"]),
        "actual_usd": usd(r["actual_micro"]),
        "state": r["state"],
        "outcome": r["outcome"] or _UNRUN.get(r["state"]),
        "reason": r["reason"],
        "flow_run_id": r["flow_run_id"],
        "requested_at": iso(r["requested_at"]),
        "admitted_at": iso(r["admitted_at"]),
        "ended_at": iso(r["ended_at"]),
        "settled_at": iso(r["settled_at"]),
    }


def _job_row(raw: dict[str, Any], r: dict[str, Any]) -> tuple[str, ...]:
    """One job of the `ledger` table, from its row (`raw`) and its JSON (`r`)."""
    return (
        r["id"][:8],
        r["scope"],
        r["name"],
        f"{r['instance_type']} x{r['nodes']}",
        fmt_usd(raw["rate_micro_per_hour"]),
        fmt_usd(raw["reserved_micro"]),
        "-" if raw["actual_micro"] is None else fmt_usd(raw["actual_micro"]),
        r["state"] + (f" ({r['outcome']})" if r["outcome"] else ""),
        (r["requested_at"] or "")[:19],
        (r["flow_run_id"] or "")[:8],
    )


_LEDGER_COLUMNS = (
    Col("id", drop=5),
    Col("scope"),
    Col("job", "name", drop=6),
    Col("instance", "name", drop=7),
    Col("rate/h", drop=4),
    Col("reserved", drop=3),
    Col("actual", drop=2),
    Col("state", "text", drop=1),
    Col("requested", "name", drop=8),
    Col("run", drop=9),
)
"""What a narrow terminal leaves out first: the flow run, when it was asked for, the machine,
the job's name and its id (`ledger --json` has them all), then the money, the state last."""


_UNRUN = {"rejected": "refused", "timed_out": "timed_out", "cancelled": "cancelled"}
"""The outcome of a job that ended without running, by its state."""


def _sweep_trial(name: str) -> dict[str, Any]:
    """A sweep's trial is named `SWEEP/NNNN`: the ledger's link back to the trials table."""
    sweep_name, _, index = name.rpartition("/")
    if sweep_name and len(index) == 4 and index.isdigit():
        return {"sweep": sweep_name, "trial": int(index)}
    return {"sweep": None, "trial": None}


@app.command("cancel")
def cancel_cmd(
    job_ids: list[str] = typer.Argument(
        ..., help="Job ids, or prefixes of them as `ledger` shows them (8 characters)."
    ),
    reason: str = typer.Option("cancelled by an admin", help="Why, for the job's row and run."),
) -> None:
    """Cancel queued jobs and stop running ones, as Slurm's scancel: a running job gets
    SIGTERM, its kill grace, then SIGKILL from its holder, and is settled for what it ran."""
    from prefect_gpu_budget.admission.ledger import ACTIVE
    from prefect_gpu_budget.admission.stopping import stop_job

    ledger = current_ledger()
    open_jobs = ledger.views.jobs(None, ("queued", *ACTIVE))
    chosen = []
    for given in job_ids:  # every id checked before anything is stopped
        found = [r for r in open_jobs if r["id"].startswith(given)] if given else []
        if len(found) > 1:
            fail(f"job_id: {given} names {len(found)} jobs; give more of the id")
        if not found:
            ended = [r for r in ledger.views.jobs(None) if given and r["id"].startswith(given)]
            fail(
                f"job_id: job {given} has ended ({ended[0]['state']})"
                if ended
                else f"job_id: no job {given} (`prefect-gpu-budget ledger` lists them)"
            )
        chosen.append(found[0])
    for row in chosen:
        became = stop_job(ledger, row["id"], row["scope"], reason)
        said = {
            "cancelled": "cancelled while it waited; nothing spent",
            "stopping": "stopping: its holder sends SIGTERM, waits its kill grace, then SIGKILL, "
            "and settles it for what it ran",
        }.get(became or "", "it had ended already")
        console.print(f"{row['id'][:8]} {row['scope']}: {said}")


@app.command("reconcile")
def reconcile_cmd(
    stale_after: str = typer.Option(
        f"{STALE_AFTER_S:g}s", help="Silence after which a holder on another host counts as gone."
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Settle reservations whose holders are gone; safe to run often and concurrently."""
    from prefect_gpu_budget.admission.reconcile import reconcile
    from prefect_gpu_budget.units import parse_duration

    done = reconcile(
        current_ledger(),
        limits_if_configured(),
        stale_after=parse_duration(stale_after, "stale_after"),
    )
    if as_json:
        typer.echo(
            json.dumps([{**d.__dict__, "actual_usd": micro_to_usd(d.actual_micro)} for d in done])
        )
        return
    for d in done:
        console.print(f"{d.job_id[:8]} {d.scope}: {d.action} ({fmt_usd(d.actual_micro)})")
    console.print(f"{len(done)} job(s) reconciled")
