"""The spend report: where GPU money went in a time window, published on the flow run.

For a scope (or every scope) and the last `hours`, the flow reads the ledger and publishes:

- a table artifact with one row per budgeted scope: cap, running rate, period budget and its
  settled, reserved and remaining spend, running and queued jobs, and the window's spend, job
  count and queue wait (mean and p95 of `admitted_at - requested_at` for admitted jobs);
- a table artifact of the ten costliest jobs of the window;
- once a cloud's bill was imported, a table artifact of each billed job's reservation,
  settlement, bill and drift, and a settled-vs-billed plot per scope;
- a markdown artifact with a short summary (total, biggest scope, who waits and why) and the
  plots, which are also PNG files in `out_dir`.

A job is in the window if it was requested before now and had not ended before the window
began; its spend counts in the window if it ended inside it (the whole of its actual cost).
Running jobs count at their cost so far.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pandas as pd
from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from prefect_gpu_budget.blocks import SpendLedger
from prefect_gpu_budget.sweeps.plots import embed, settled_vs_billed, spend_over_time
from prefect_gpu_budget.units import (
    BudgetInputError,
    cost_micro,
    fmt_duration,
    fmt_usd,
    micro_to_usd,
    org_of,
    validate_scope,
)

TOP_JOBS = 10
STATUS_NAMES = {
    "hourly_cap_usd_per_h": "hourly_cap_usd",
    "running_rate_usd_per_h": "running_rate_usd_per_hour",
    "settled_in_period_usd": "settled_usd",
}
"""Deprecated report column -> the name `status --json` gives the same figure. The report
writes both for one release; the old names (keys here) then go."""
COLUMNS = [
    "scope",
    "hourly_cap_usd_per_h",
    "running_rate_usd_per_h",
    "period",
    "period_budget_usd",
    "settled_in_period_usd",
    "reserved_usd",
    "remaining_usd",
    "running",
    "queued",
    "window_spend_usd",
    "window_jobs",
    "mean_wait_s",
    "p95_wait_s",
    *STATUS_NAMES.values(),
]


def _usd(micro: int | None) -> float | None:
    return None if micro is None else micro_to_usd(micro)


def _jobs(n: int) -> str:
    return f"{n} job{'s' * (n != 1)}"


def _in_window(row: dict[str, Any], since: float, now: float) -> bool:
    return row["requested_at"] <= now and (row["ended_at"] is None or row["ended_at"] >= since)


def _cost(row: dict[str, Any], now: float) -> int:
    """Actual cost once settled; for a running job, what it has cost so far."""
    if row["actual_micro"] is not None:
        return row["actual_micro"]
    if row["started_at"] is None:
        return 0
    return cost_micro(row["rate_micro_per_hour"], max(0.0, now - row["started_at"]), round_up=False)


def _window_spend(rows: list[dict[str, Any]], since: float, now: float) -> int:
    return sum(
        r["actual_micro"] or 0
        for r in rows
        if r["state"] == "settled" and r["ended_at"] is not None and since <= r["ended_at"] <= now
    )


def _waits(rows: list[dict[str, Any]]) -> pd.Series:
    return pd.Series(
        [r["admitted_at"] - r["requested_at"] for r in rows if r["admitted_at"] is not None],
        dtype=float,
    )


def _scope_row(
    status: dict[str, Any], rows: list[dict[str, Any]], since: float, now: float
) -> dict[str, Any]:
    waits = _waits(rows)
    row = {  # the three names marked deprecated are STATUS_NAMES' keys
        "scope": status["scope"],
        "hourly_cap_usd_per_h": _usd(status["hourly_cap_micro"]),  # deprecated
        "running_rate_usd_per_h": _usd(status["running_rate_micro"]),  # deprecated
        "period": status["period"],
        "period_budget_usd": _usd(status["period_budget_micro"]),
        "settled_in_period_usd": _usd(status["settled_micro"]),  # deprecated
        "reserved_usd": _usd(status["reserved_micro"]),
        "remaining_usd": _usd(status["remaining_micro"]),
        "running": status["running"],
        "admitted": status["admitted"],
        "queued": status["queued"],
        "window_spend_usd": _usd(_window_spend(rows, since, now)),
        "window_jobs": len(rows),
        "mean_wait_s": round(float(waits.mean()), 1) if len(waits) else None,
        "p95_wait_s": round(float(waits.quantile(0.95)), 1) if len(waits) else None,
    }
    return {**row, **{new: row[old] for old, new in STATUS_NAMES.items()}}


def _job_row(row: dict[str, Any], now: float) -> dict[str, Any]:
    started, ended = row["started_at"], row["ended_at"]
    runtime = row["billed_seconds"]
    if runtime is None and started is not None:
        runtime = (ended or now) - started
    wait_until = row["admitted_at"] or (now if row["state"] == "queued" else row["ended_at"])
    return {
        "id": row["id"][:8],
        "scope": row["scope"],
        "instance_type": row["instance_type"],
        "nodes": row["nodes"],
        "state": row["state"],
        "actual_usd": micro_to_usd(_cost(row, now)),
        "runtime": "" if runtime is None else fmt_duration(runtime),
        "wait": "" if wait_until is None else fmt_duration(wait_until - row["requested_at"]),
    }


def _wait_chart(df: pd.DataFrame, path: Path) -> Path | None:
    """Mean and p95 queue wait per budgeted scope, as grouped bars."""
    waits = df[["scope", "mean_wait_s", "p95_wait_s"]].dropna(subset=["mean_wait_s"])
    if waits.empty:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(waits) + 2), 3.6))
    xs = range(len(waits))
    ax.bar([x - 0.2 for x in xs], waits["mean_wait_s"], width=0.4, label="mean")
    ax.bar([x + 0.2 for x in xs], waits["p95_wait_s"], width=0.4, label="p95")
    ax.set_xticks(list(xs), list(waits["scope"]), rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("queue wait (s)")
    ax.set_title("queue wait per scope")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _summary(
    jobs: list[dict[str, Any]], scope: str | None, hours: float, since: float, now: float
) -> str:
    total = _window_spend(jobs, since, now)
    by_scope: dict[str, int] = {}
    for r in jobs:
        by_scope[r["scope"]] = by_scope.get(r["scope"], 0) + _window_spend([r], since, now)
    lines = [
        f"# GPU spend report: {scope or 'all scopes'}, last {hours:g} h",
        f"- **Total spend in window:** {fmt_usd(total)} over {_jobs(len(jobs))}",
    ]
    if by_scope and max(by_scope.values()) > 0:
        top = max(by_scope, key=lambda s: by_scope[s])
        lines.append(f"- **Biggest scope:** `{top}` ({fmt_usd(by_scope[top])})")
    waiting = [r for r in jobs if r["state"] == "queued"]
    refused = [r for r in jobs if r["state"] in ("timed_out", "rejected") and r["reason"]]
    waited = _waits(jobs)
    if len(waited) and waited.max() >= 1:
        lines.append(
            f"- **Admitted after waiting:** {_jobs(int((waited >= 1).sum()))} "
            f"(longest {fmt_duration(float(waited.max()))})"
        )
    if waiting:
        lines.append(f"- **Waiting now:** {_jobs(len(waiting))}")
        lines += [
            f"  - `{r['id'][:8]}` in `{r['scope']}` for {fmt_duration(now - r['requested_at'])}: "
            f"{r['reason'] or 'not yet decided'}"
            for r in waiting[:TOP_JOBS]
        ]
    if refused:
        lines.append(f"- **Not admitted:** {_jobs(len(refused))}")
        lines += [
            f"  - `{r['id'][:8]}` in `{r['scope']}` ({r['state']}): {r['reason']}"
            for r in refused[:TOP_JOBS]
        ]
    if not waiting and not refused and not (len(waited) and waited.max() >= 1):
        lines.append("- No job waited for admission.")
    return "\n".join(lines)


def _publish_capacity(led, orgs: list[str]) -> None:
    """Per capacity pool: each team's quota, used, borrowed, lent and lendable; the queue."""
    pools = [p for org in orgs for p in led.views.capacity_status(org)]
    if not pools:
        return
    create_table_artifact(
        key="gpu-budget-team-quotas",
        table=[
            {
                "pool": f"{p['org']}/{p['pool']}",
                "team": t["team"],
                "quota_gpus": t["quota"][0],
                "used_gpus": t["used"][0],
                "borrowed_gpus": t["borrowed"][0],
                "lent_gpus": t["lent"][0],
                "lendable_gpus": t["lendable"][0],
                "quota_vcpu": t["quota"][1],
                "used_vcpu": t["used"][1],
                "quota_memory_gib": t["quota"][2],
                "used_memory_gib": t["used"][2],
                "borrow_pct": t["borrow_pct"],
                "lend_pct": t["lend_pct"],
                "weight": t["weight"],
            }
            for p in pools
            for t in p["teams"]
        ],
        description="Team quotas per capacity pool: quota, used, borrowed, lent, lendable",
    )
    create_table_artifact(
        key="gpu-budget-capacity-queue",
        table=[
            {"pool": f"{p['org']}/{p['pool']}", **q, "job_id": q["job_id"][:8]}
            for p in pools
            for q in p["queue"]
        ],
        description="Jobs waiting for capacity, with the reason each waits",
    )


def _publish_bill(led: Any, scope: str | None, out: Path) -> Path | None:
    """The cloud's bill against the settlements (`bill drift`'s: the latest billing period
    imported, not every month the ledger holds): a table artifact per job and per scope, and
    the settled-vs-billed plot; nothing before a bill was imported."""
    from prefect_gpu_budget.admission.ledger.bill_views import drift as read_drift
    from prefect_gpu_budget.admission.ledger.bill_views import latest_period

    with led.db.read() as conn:
        period = latest_period(conn)
        if period is None:
            return None
        drift = read_drift(conn, scope, period)
    if not drift["jobs"]:
        return None
    money = ("reserved", "settled", "billed", "drift")
    create_table_artifact(
        key="gpu-budget-bill-drift",
        table=[
            {
                "job_id": j["job_id"][:8],
                "scope": j["scope"],
                **{f"{m}_usd": micro_to_usd(j[f"{m}_micro"]) for m in money},
                "figure": "final" if j["final"] else "provisional",
            }
            for j in drift["jobs"]
        ],
        description="What the cloud billed against what the ledger settled, per job",
    )
    unowned = sum(x["billed_micro"] for kind in ("untagged", "account") for x in drift[kind])
    return settled_vs_billed(drift["scopes"], out / "settled-vs-billed.png", unowned_micro=unowned)


@flow(name="gpu-budget-spend-report")
def spend_report(
    scope: str | None = None,
    hours: float = 24.0,
    ledger: SpendLedger | None = None,
    out_dir: str = "gpu-budget-reports",
) -> pd.DataFrame:
    """Publish the spend of `scope` (all scopes if None) in the last `hours` as artifacts:
    1. the table per scope; 2. the costliest jobs; 3. the pools' capacity; 4. the plots and
    the summary."""
    if scope is not None:
        validate_scope(scope)
    if not 0 < hours <= 24 * 366:
        raise BudgetInputError("hours", f"must be > 0 and at most a year, got {hours!r}")
    led = (ledger or SpendLedger()).ledger()
    now = time.time()
    since = now - hours * 3600
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    statuses = led.views.status(scope, now=now)
    jobs = [r for r in led.views.jobs(scope, since=since) if _in_window(r, since, now)]
    in_scope = {
        s["scope"]: [
            r for r in jobs if r["scope"] == s["scope"] or r["scope"].startswith(s["scope"] + "/")
        ]
        for s in statuses
    }
    df = pd.DataFrame(
        [_scope_row(s, in_scope[s["scope"]], since, now) for s in statuses],
        columns=COLUMNS,
    )
    create_table_artifact(
        key="gpu-budget-spend-report",
        table=df.to_dict("records"),  # Prefect writes NaN as null
        description=f"GPU spend per budgeted scope, last {hours:g} h",
    )
    _publish_top_jobs(jobs, hours, now)
    _publish_capacity(led, sorted({org_of(s["scope"]) for s in statuses}))
    plots = _spend_plots(statuses, in_scope, out)
    if not df.empty:
        plots.append(_wait_chart(df, out / "queue-wait.png"))
    plots.append(_publish_bill(led, scope, out))
    create_markdown_artifact(
        key="gpu-budget-spend-summary",
        markdown=_summary(jobs, scope, hours, since, now) + "\n\n" + embed(plots, "Plots"),
        description=f"GPU spend summary, last {hours:g} h",
    )
    return df


def _publish_top_jobs(jobs: list[dict[str, Any]], hours: float, now: float) -> None:
    """The TOP_JOBS costliest jobs of the window, as a table artifact."""
    top = sorted(jobs, key=lambda r: _cost(r, now), reverse=True)[:TOP_JOBS]
    create_table_artifact(
        key="gpu-budget-top-jobs",
        table=[_job_row(r, now) for r in top],
        description=f"The {TOP_JOBS} costliest GPU jobs of the last {hours:g} h",
    )


def _spend_plots(
    statuses: list[dict[str, Any]], in_scope: dict[str, list[dict[str, Any]]], out: Path
) -> list[Path | None]:
    """Each budgeted scope's spend against its budget and its rate against its cap."""
    plots: list[Path | None] = []
    for s in statuses:
        if s["period_budget_micro"] is None and s["hourly_cap_micro"] is None:
            continue
        plots.append(
            spend_over_time(
                in_scope[s["scope"]],
                out / f"spend-{s['scope'].replace('/', '--')}.png",
                budget_micro=s["period_budget_micro"],
                cap_micro_per_hour=s["hourly_cap_micro"],
                title=f"{s['scope']}: spend vs {s['period']} budget, rate vs cap",
            )
        )
    return plots
