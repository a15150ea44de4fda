"""A placement as the ledger keeps it on the job's row (`gpu_jobs.choice`, written from
`GpuJob.choice`): what the job asked and every offering considered, each as `Considered.as_dict`
gives it. Read back here for `ledger --json`, `status` and the agents' door."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from prefect_gpu_budget.units import fmt_usd


def choice_view(text: str | None) -> dict[str, Any] | None:
    """The recorded choice: `accelerators` asked, the `chosen` offering, and the others as
    `passed_over` (offering, expected cost, why); None for a job that named its machine."""
    if not text:
        return None
    recorded = json.loads(text)
    considered = recorded.get("considered", [])
    chosen = next((c for c in considered if c.get("chosen")), None)
    return {
        "accelerators": recorded.get("accelerators"),
        "chosen": chosen,
        "passed_over": [
            {
                "offering": c["offering"],
                "expected_usd": c["expected_usd"],
                "why": c["passed_over"],
            }
            for c in considered
            if not c.get("chosen")
        ],
    }


def choice_line(text: str | None) -> str | None:
    """`H100:8 -> gcp:a3-highgpu-8g spot europe-west4 (vertex-prod), expected $41.20; 3 other
    offerings passed over`: one line for `status`."""
    view = choice_view(text)
    if view is None or view["chosen"] is None:
        return None
    chosen, others = view["chosen"], view["passed_over"]
    return (
        f"{view['accelerators']} -> {chosen['offering']}, expected "
        f"{fmt_usd(round(chosen['expected_usd'] * 1e6))}; {len(others)} other offerings passed over"
    )


def place_line(row: Mapping[str, Any]) -> str:
    """One place of a job, from its ledger row: `gcp:a2-highgpu-1g spot: interrupted, $0.12`."""
    outcome = row.get("outcome") or row.get("state")
    cost = fmt_usd(row.get("actual_micro") or 0)
    return f"{row['instance_type']} {row['provisioning']}: {outcome}, {cost}"


def places_cell(parts: Sequence[Mapping[str, Any]]) -> str:
    """Every place of one trial's job, in order (`place_line`s joined by `; `); "" for a job
    that named its machine and ran in one place."""
    if len(parts) < 2 and not any(part.get("choice") for part in parts):
        return ""
    return "; ".join(place_line(part) for part in parts)


def trial_job(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A trial's job from its ledger rows in request order (more than one when its job was
    placed again): the latest place, with the cost of every place (`actual_micro`) and each
    place listed (`places`, `places_cell`)."""
    latest = dict(parts[-1])
    latest["actual_micro"] = sum(part.get("actual_micro") or 0 for part in parts)
    latest["places"] = places_cell(parts)
    return latest
