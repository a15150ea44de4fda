"""`quote --accelerators`: every offering of the saved launchers and pools for a job that asks
for accelerators, the one the gate would choose marked CHOSEN and why each other was passed
over, as SkyPilot shows its choices before it launches."""

from __future__ import annotations

import json
from typing import Any

from prefect_gpu_budget.cli.common import console, current_ledger
from prefect_gpu_budget.cli.tables import Col, print_table
from prefect_gpu_budget.units import fmt_duration, fmt_usd

COLUMNS = [
    Col("offering"),
    Col("$/h per node"),
    Col("expected"),
    Col("wait"),
    Col("ends in", drop=1),
    Col("reserved", drop=2),
    Col("choice", "text"),
]


def quote_placement(
    accelerators: str,
    nodes: int,
    seconds: float,
    scope: str | None,
    resumable: bool,
    as_json: bool,
    asked: dict[str, Any],
) -> None:
    """Place a job of `seconds` and print every offering considered."""
    from prefect_gpu_budget.job import GpuJob
    from prefect_gpu_budget.placement.placing import place_job

    job = GpuJob(
        accelerators=accelerators,
        nodes=nodes,
        max_runtime=seconds,
        checkpoint="(resumable)" if resumable else None,
        **{k: v for k, v in asked.items() if v is not None},
    )
    placed = place_job(job, scope, current_ledger())
    considered = placed.placement.considered
    if as_json:
        print(json.dumps([c.as_dict() for c in considered], indent=2))
        return
    print_table(COLUMNS, [_row(c) for c in considered])
    chosen = placed.placement.chosen
    console.print(
        f"chosen: {chosen.offering.describe()}, reserving {fmt_usd(chosen.reservation_micro)} "
        f"(the rate x the max runtime: the money bound); expected "
        f"{fmt_usd(chosen.expected.cost_micro)}"
    )


def _row(c: Any) -> list[str]:
    e = c.expected
    return [
        c.offering.describe(),
        fmt_usd(c.offering.rate_micro_per_hour),
        fmt_usd(e.cost_micro),
        fmt_duration(e.wait_s),
        fmt_duration(e.end_s),
        fmt_usd(c.reservation_micro),
        "CHOSEN" if c.passed_over is None else c.passed_over,
    ]
