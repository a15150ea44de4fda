"""A placement as the ledger keeps it on the job's row (`gpu_jobs.choice`, written from
`GpuJob.choice`): what the job asked and every offering considered, each as `Considered.as_dict`
gives it. Read back here for `ledger --json`, `status` and the agents' door."""

from __future__ import annotations

import json
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
