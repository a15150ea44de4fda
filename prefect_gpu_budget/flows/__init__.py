"""Flows: sweeps with results and plots, the spend report, reconcile, and the demo.

The flows load on first use (PEP 562), so that a trial run as `python -m
prefect_gpu_budget.flows.demo_trial` never imports Prefect.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefect_gpu_budget._lazy import lazy_exports

_PUBLIC = {
    "SweepSpec": "prefect_gpu_budget.sweeps.spec",
    "agent_sweep": "prefect_gpu_budget.flows.agent",
    "gpu_sweep": "prefect_gpu_budget.sweeps.flow",
    "reconcile_flow": "prefect_gpu_budget.flows.reconcile",
    "spend_report": "prefect_gpu_budget.flows.spend_report",
}

__all__ = [
    "SweepSpec",
    "agent_sweep",
    "gpu_sweep",
    "reconcile_flow",
    "spend_report",
]

if TYPE_CHECKING:
    from prefect_gpu_budget.flows.agent import agent_sweep
    from prefect_gpu_budget.flows.reconcile import reconcile_flow
    from prefect_gpu_budget.flows.spend_report import spend_report
    from prefect_gpu_budget.sweeps.flow import gpu_sweep
    from prefect_gpu_budget.sweeps.spec import SweepSpec


__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, globals())
